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

import jax.numpy as jnp
from flax import nnx

from inkling_jax.config import InklingConfig
from inkling_jax.nn.decoder import DecoderLayer  # each depth's block is an ordinary decoder layer
from inkling_jax.nn.layers import Linear, RMSNorm


class MTPLayer(nnx.Module):
    def __init__(self, config: InklingConfig, depth: int, *, dtype, rngs: nnx.Rngs):
        cfg = config.text
        self.embed_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.input_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.block = DecoderLayer(cfg, local=depth in config.mtp.local_layer_ids, dense=True, dtype=dtype,
                                  rngs=rngs)

    def __call__(self, h_prev, token_embeds, positions, segment_ids=None):
        z = self.input_proj(jnp.concatenate([self.hidden_norm(h_prev), self.embed_norm(token_embeds)], axis=-1))
        return self.block(z, positions, segment_ids=segment_ids)[0]


class MTPHead(nnx.Module):
    def __init__(self, config: InklingConfig, *, dtype, rngs: nnx.Rngs):
        self.layers = nnx.List([MTPLayer(config, k, dtype=dtype, rngs=rngs) for k in range(config.mtp.num_layers)])

    def __call__(self, trunk_hidden, input_ids, embed, head):
        """Teacher-forced drafts over a whole sequence.

        trunk_hidden [B, T, H] final-normed; `embed(ids)` gives the trunk's normed embeddings and `head(h)` the
        logits. Depth k at position t sees token t + k + 1 and predicts token t + k + 2; positions past the
        end of the sequence see token 0 and are meaningless. Returns one logits array [B, T, V] per depth.
        """
        return [head(h) for h in self.hidden_states(trunk_hidden, input_ids, embed)]

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
