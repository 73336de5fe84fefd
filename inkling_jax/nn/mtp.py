"""The multi-token-prediction (MTP) head: one small decoder block per extra depth, for speculative decoding.

Depth k reads the previous depth's hidden state (depth 0: the trunk's final-normed hidden state) and the
embedding of the next known token, and predicts one token further:

    e = RMSNorm_k(trunk embed_norm(Embed[token]))        (two norms: the trunk's, then the depth's own)
    z = [RMSNorm_hidden(h_prev), e] @ W_in                (hidden first)
    h = Block_k(z)                                        (a full decoder layer with a dense MLP)
    logits = (h / mup) @ Unembed^T                        (no final norm; embedding and head are the trunk's)

transformers' Inkling has no MTP module, so there is no oracle to compare with; this follows the SGLang
implementation as the spec transcribes it (section 3).
"""

import dataclasses

import jax.numpy as jnp
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.config import InklingConfig
from inkling_jax.nn.cache import Cache, LayerCache
from inkling_jax.nn.decoder import DecoderLayer  # each depth's block is an ordinary decoder layer
from inkling_jax.nn.layers import Linear, RMSNorm


class MTPLayer(nnx.Module):
    def __init__(self, config: InklingConfig, depth: int, *, dtype, rngs: nnx.Rngs, backend: Backend = Backend()):
        cfg = config.text
        self.embed_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, backend=backend)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, backend=backend)
        self.input_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, dtype=dtype, rngs=rngs, backend=backend)
        self.block = DecoderLayer(cfg, local=depth in config.mtp.local_layer_ids, dense=True, dtype=dtype,
                                  rngs=rngs, backend=backend)

    def __call__(self, h_prev, token_embeds, positions, segment_ids=None):
        return self.block(self.inputs(h_prev, token_embeds), positions, segment_ids=segment_ids)[0]

    def inputs(self, h_prev, token_embeds):
        """The block's input z (hidden first, then the embedding)."""
        return self.input_proj(jnp.concatenate([self.hidden_norm(h_prev), self.embed_norm(token_embeds)], axis=-1))

    def extend(self, h_prev, token_embeds, cache: Cache, layer_cache: LayerCache, n_new):
        """The depth over a chunk [B, T] at positions `cache.lengths + t`, with its own `layer_cache` (the page
        table, ring rows and lengths are `cache`'s). Returns (h [B, T, H], the updated LayerCache)."""
        positions = cache.lengths[:, None] + jnp.arange(h_prev.shape[1])[None, :]
        h, new_cache, _ = self.block(self.inputs(h_prev, token_embeds), positions, cache=layer_cache, n_new=n_new,
                                     page_table=cache.page_table, ring_rows=cache.ring_rows)
        return h, new_cache


class MTPHead(nnx.Module):
    def __init__(self, config: InklingConfig, *, dtype, rngs: nnx.Rngs, backend: Backend = Backend()):
        self.layers = nnx.List([MTPLayer(config, k, dtype=dtype, rngs=rngs, backend=backend)
                                for k in range(config.mtp.num_layers)])

    def __call__(self, trunk_hidden, input_ids, embed, head):
        """Teacher-forced drafts over a whole sequence.

        trunk_hidden [B, T, H] final-normed; `embed(ids)` gives the trunk's normed embeddings and `head(h)` the
        logits. Depth k at position t sees token t + k + 1 and predicts token t + k + 2; positions past the
        end of the sequence see token 0 and are meaningless. Returns one logits array [B, T, V] per depth.
        """
        return [head(h) for h in self.hidden_states(trunk_hidden, input_ids, embed)]

    def extend(self, trunk_hidden, next_ids, embed, cache: Cache, n_new):
        """Serving: the first len(cache.layers) depths (those a server drafts with) over a chunk in step with
        the trunk, `cache.layers` holding one LayerCache per depth. The entry of every depth at position p is
        computed from the trunk's hidden state at p and the token at p + 1 (`next_ids [B, T]`), so the depths'
        caches advance with the trunk's and a rejected draft is undone by not advancing them. Returns (each
        depth's hidden states [B, T, H], cache)."""
        if len(cache.layers) > len(self.layers):
            raise ValueError(f"a cache of {len(cache.layers)} MTP depths for a head of {len(self.layers)}")
        token_embeds = embed(next_ids)
        out, layers = [], []
        for layer, layer_cache in zip(self.layers, cache.layers):
            h, new_cache = layer.extend(trunk_hidden, token_embeds, cache, layer_cache, n_new)
            out.append(h)
            layers.append(new_cache)
        return out, cache.replace(lengths=cache.lengths + n_new, layers=tuple(layers))

    def step(self, depth: int, h_prev, ids, embed, cache: Cache, active):
        """One draft token per row through depth `depth` at position `cache.lengths`: h_prev [B, H] (the trunk's
        or the previous draft step's output), ids [B] the token after that position; rows where `active` is
        false write nothing. Returns (h [B, H], cache with that depth's entry written and lengths + active)."""
        n_new = active.astype(jnp.int32)
        h, new_cache = self.layers[depth].extend(h_prev[:, None], embed(ids[:, None]), cache, cache.layers[depth],
                                                 n_new)
        layers = cache.layers[:depth] + (new_cache,) + cache.layers[depth + 1:]
        return h[:, 0], cache.replace(lengths=cache.lengths + n_new, layers=layers)

    def hidden_states(self, trunk_hidden, input_ids, embed, *, segment_ids=None, positions=None):
        """Each depth's output hidden state [B, T, H] (what the head turns into logits). segment_ids/positions
        describe packed sequences, as for the trunk (training); a depth's token at t + k + 1 past its
        segment's end is another segment's and meaningless there."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1])[None], input_ids.shape)
        h, out = trunk_hidden, []
        for k, layer in enumerate(self.layers):
            shifted = jnp.pad(input_ids[:, k + 1:], ((0, 0), (0, k + 1)))
            h = layer(h, embed(shifted), positions, segment_ids)
            out.append(h)
        return out


def first_depths(config: InklingConfig, depths: int) -> InklingConfig:
    """`config` with an MTP head of its first `depths` depths only (0: no head); as it is if it has no more."""
    if config.mtp is None or depths >= config.mtp.num_layers:
        return config
    if depths <= 0:
        return dataclasses.replace(config, mtp=None)
    return dataclasses.replace(config, mtp=dataclasses.replace(
        config.mtp, num_layers=depths, local_layer_ids=tuple(i for i in config.mtp.local_layer_ids if i < depths)))


def keep_first_depths(view, depths: int) -> None:
    """Cuts the MTP head of `view`, a model view its caller built (changed in place), to its first `depths`
    depths (0: no head), config included."""
    view.config = first_depths(view.config, depths)
    if view.config.mtp is None:
        view.mtp = None
    elif len(view.mtp.layers) > depths:
        view.mtp.layers = nnx.List(list(view.mtp.layers)[:depths])
