"""The Inkling model: normed embedding, decoder layers (attention + ShortConv, dense MLP or MoE + ShortConv),
final norm, the muP-divided untied head; media towers whose outputs replace placeholder rows.

    model = InklingModel(config, dtype=jnp.float32, rngs=nnx.Rngs(0))   # backend=Backend(...): which kernels
    logits = model(input_ids)                          # [B, T, unpadded_vocab]
    cache = model.init_cache(batch, max_len)
    logits, cache = model.extend(prompt_ids, cache)    # prefill (a chunk; rows may be right-padded)
    logits, cache = model.extend(next_ids[:, None], cache)   # one decode step
"""

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.config import InklingConfig
from inkling_jax.nn import kernels
from inkling_jax.nn.cache import Cache, init_cache
from inkling_jax.nn.decoder import DecoderLayer
from inkling_jax.nn.layers import RMSNorm, normal
from inkling_jax.nn.moe import MoE
from inkling_jax.nn.mtp import MTPHead
from inkling_jax.nn.token_sets import ChunkSet, LayerSet
from inkling_jax.nn.towers import AudioTower, VisionTower
from inkling_jax.parallel.vocab import take_rows

# Rematerialisation for training, per decoder layer: the policy says which intermediates the backward pass may
# keep; the rest is recomputed. "none": keep all (no remat); "full": keep only the layer inputs; "dots": keep
# the outputs of matmuls without batch dimensions (the projections), recompute the cheap elementwise work.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _layer_forward(layer, x, positions, segment_ids, expert_ids):
    """One decoder layer without a cache: (x, MoE expert ids or None); the unit `nnx.remat` wraps."""
    x, _, ids = layer(x, positions, segment_ids=segment_ids, expert_ids=expert_ids)
    return x, ids


class InklingModel(nnx.Module):
    def __init__(self, config: InklingConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, backend: Backend = Backend()):
        """backend: the kernels every layer runs (`inkling_jax.backend`; `with_backend` gives a model another)."""
        cfg = config.text
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.backend = backend
        self.embed = nnx.Param(normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.embed_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, backend=backend)
        self.layers = nnx.List([
            DecoderLayer(cfg, local=cfg.is_local(i), dense=cfg.is_dense(i), dtype=dtype, rngs=rngs, backend=backend)
            for i in range(cfg.num_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, backend=backend)
        self.unembed = nnx.Param(normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.vision = None if config.vision is None else VisionTower(config.vision, cfg.hidden_size, dtype=dtype,
                                                                       rngs=rngs, backend=backend)
        self.audio = None if config.audio is None else AudioTower(config.audio, cfg.hidden_size, dtype=dtype,
                                                                    rngs=rngs, backend=backend)
        self.mtp = None if config.mtp is None else MTPHead(config, dtype=dtype, rngs=rngs, backend=backend)
        self.mesh = None  # set by `placement.shard_model`: the embedding lookup then runs per vocabulary slice

    # ------------------------------------------------------------------------------------------------------
    # Public API

    def __call__(self, input_ids, pixel_values=None, audio_input_ids=None, audio_input_ids_mask=None, *,
                 segment_ids=None, positions=None):
        """Logits [B, T, unpadded_vocab] of a whole sequence (no cache).

        pixel_values [N, T, P, P, C] and audio_input_ids [A, F, bins] (+ mask [A, F]) fill the image and audio
        placeholder tokens of input_ids in order. segment_ids/positions describe packed sequences.
        """
        return self.logits(self.hidden_states(input_ids, pixel_values, audio_input_ids, audio_input_ids_mask,
                                              segment_ids=segment_ids, positions=positions)[0])

    def hidden_states(self, input_ids, pixel_values=None, audio_input_ids=None, audio_input_ids_mask=None, *,
                      segment_ids=None, positions=None, expert_ids=None, embeds=None, remat: str = "none"):
        """Final-normed hidden states [B, T, hidden] and the MoE choices of each MoE layer (for routing replay:
        pass the same list back as `expert_ids`; an entry's -1 rows are routed afresh). embeds [B, T, hidden]:
        input embeddings to use instead of embedding input_ids (media merged by the caller, as `extend` takes
        them). remat: a REMAT_POLICIES name, what each layer keeps for the backward pass (training)."""
        x = self.embed_inputs(input_ids, pixel_values, audio_input_ids, audio_input_ids_mask) if embeds is None \
            else embeds
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1])[None], input_ids.shape)
        chosen = []
        moe_layer = 0
        call_layer = _layer_forward if REMAT_POLICIES[remat] is None else nnx.remat(
            _layer_forward, policy=REMAT_POLICIES[remat])
        for layer in self.layers:
            given = None
            if isinstance(layer.mlp, MoE):
                given = None if expert_ids is None else expert_ids[moe_layer]
                moe_layer += 1
            x, ids = call_layer(layer, x, positions, segment_ids, given)
            if ids is not None:
                chosen.append(ids)
        return self.norm(x), chosen

    def logits(self, hidden):
        """The untied head on final-normed hidden states, cut to the unpadded vocabulary."""
        cfg = self.config.text
        scaled = hidden / jnp.asarray(cfg.logits_mup_width_multiplier, hidden.dtype)
        # Slice the product, not the weight: XLA copies a row slice of the weight before the matmul, the whole
        # head on every decode step.
        return self._head(scaled)[..., : cfg.unpadded_vocab_size]

    def _head(self, x):
        """x @ the head's [vocab, hidden] weight transposed. Serving forms hold it quantised
        (`inkling_jax.quant.head`)."""
        return kernels.matmul(x, self.unembed[...], backend=self.backend, transposed=True)

    def mtp_logits(self, input_ids):
        """Teacher-forced MTP drafts of a text sequence: one logits array [B, T, V] per depth."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head (config.mtp is None)")
        hidden, _ = self.hidden_states(input_ids)
        return self.mtp(hidden, input_ids, self.embed_tokens, self.logits)

    def init_cache(self, batch: int, max_len: int, **kwargs) -> Cache:
        return init_cache(self.config.text, batch, max_len, self.dtype, **kwargs)

    def extend(self, input_ids, cache: Cache, n_new=None, pixel_values=None, audio_input_ids=None,
               audio_input_ids_mask=None, *, embeds=None, logits_at=None, keep_conv_inputs: bool = False):
        """Append a chunk [B, T] to every row of the cache; returns (logits [B, T, V], cache).

        Row b's chunk holds `n_new[b]` real tokens (default T) followed by padding, which is neither cached nor
        counted. T == 1 is a decode step; any T is a prefill chunk (chunked prefill continues a row).
        embeds [B, T, hidden]: input embeddings to use instead of embedding input_ids (media merged by the
        caller). logits_at [B]: apply the head only at that index of each row's chunk; logits are then [B, V]
        (the head is the largest matmul of a step at Inkling's vocabulary). keep_conv_inputs: see
        `extend_hidden`.
        """
        hidden, cache = self.extend_hidden(input_ids, cache, n_new, pixel_values, audio_input_ids,
                                           audio_input_ids_mask, embeds=embeds, keep_conv_inputs=keep_conv_inputs)
        if logits_at is not None:
            hidden = hidden[jnp.arange(hidden.shape[0]), logits_at]
        return self.logits(hidden), cache

    def extend_hidden(self, input_ids, cache: Cache, n_new=None, pixel_values=None, audio_input_ids=None,
                      audio_input_ids_mask=None, *, embeds=None, keep_conv_inputs: bool = False):
        """`extend`, returning the final-normed hidden states [B, T, hidden] instead of logits (what the MTP
        head reads). Layer caches past the trunk's (a drafter's, appended by a server) pass through untouched.
        keep_conv_inputs: the ShortConv states come back with every input of the chunk, [B, width - 1 + T, C]
        (`ShortConv`), for a caller that keeps fewer than n_new tokens (speculative verification)."""
        hidden, cache, _ = self.extend_routed(input_ids, cache, n_new, pixel_values, audio_input_ids,
                                              audio_input_ids_mask, embeds=embeds, keep_conv_inputs=keep_conv_inputs)
        return hidden, cache

    def extend_routed(self, input_ids, cache: Cache, n_new=None, pixel_values=None, audio_input_ids=None,
                      audio_input_ids_mask=None, *, embeds=None, keep_conv_inputs: bool = False):
        """`extend_hidden`, and the experts each MoE layer chose for every position of the chunk, [B, T, MoE layers,
        top_k] int32 (None without MoE layers): what routing replay records."""
        x = self.embed_inputs(input_ids, pixel_values, audio_input_ids, audio_input_ids_mask) if embeds is None \
            else embeds
        (hidden,), (cache,), (experts,) = self._extend([x], [cache], [n_new], keep_conv_inputs)
        return hidden, cache, experts

    def extend_sets(self, sets: list[ChunkSet]):
        """Several chunks, each over its own rows, in one pass: `ChunkSet`s whose caches share one cache's page pools
        and rings (`serve.runner.cache_rows.take_rows` of it) and touch disjoint pages and rings. The position-wise
        work (projections, MLP, MoE) runs once over all the sets' tokens, so each weight is read once
        (`DecoderLayer.over_sets`); each set's tokens see only its own rows, as in `extend_routed`. Returns three
        lists, per set: the final-normed hidden states [B_i, T_i, hidden], its Cache (each with the pools after
        every set's writes), and its experts [B_i, T_i, MoE layers, top_k] (None without MoE layers)."""
        xs = [self.embed_tokens(s.input_ids) if s.embeds is None else s.embeds for s in sets]
        return self._extend(xs, [s.cache for s in sets], [s.n_new for s in sets])

    def _extend(self, xs: list, caches: list[Cache], n_news: list, keep_conv_inputs: bool = False):
        """The layers over sets of embedded chunks xs[i] [B_i, T_i, hidden], each continuing its cache; returns
        (hidden, caches, experts) per set, as `extend_sets` does."""
        n_news = [jnp.full((x.shape[0],), x.shape[1], jnp.int32) if n is None else n for x, n in zip(xs, n_news)]
        positions = [c.lengths[:, None] + jnp.arange(x.shape[1])[None, :] for x, c in zip(xs, caches)]
        new_layers, chosen = [[] for _ in xs], [[] for _ in xs]
        for i, layer in enumerate(self.layers):
            sets = [LayerSet(p, c.layers[i], n, c.page_table, c.ring_rows) for p, c, n in zip(positions, caches,
                                                                                                n_news)]
            xs, layer_caches, ids = layer.over_sets(xs, sets, keep_conv_inputs=keep_conv_inputs)
            for j, layer_cache in enumerate(layer_caches):
                new_layers[j].append(layer_cache)
                if ids is not None:
                    chosen[j].append(ids[j].reshape(*xs[j].shape[:2], -1))
        caches = [c.replace(lengths=c.lengths + n, layers=tuple(layers) + c.layers[len(layers):])
                  for c, n, layers in zip(caches, n_news, new_layers)]
        experts = [jnp.stack(ids, axis=2).astype(jnp.int32) if ids else None for ids in chosen]
        return [self.norm(x) for x in xs], caches, experts

    # ------------------------------------------------------------------------------------------------------
    # Inputs

    def embed_tokens(self, ids):
        """The normed token embedding (no media): shared by the trunk and the MTP head."""
        return self.embed_norm(take_rows(self.embed[...], ids, self.mesh))

    def embed_inputs(self, input_ids, pixel_values=None, audio_input_ids=None, audio_input_ids_mask=None):
        x = self.embed_tokens(input_ids)
        if pixel_values is not None:
            if self.vision is None:
                raise ValueError("pixel_values given but this model has no vision tower")
            x = merge_placeholders(x, input_ids, self.config.image_token_id, self.vision(pixel_values), "image")
        if audio_input_ids is not None:
            if self.audio is None:
                raise ValueError("audio_input_ids given but this model has no audio tower")
            frames = audio_input_ids.reshape(-1, audio_input_ids.shape[-1])
            if audio_input_ids_mask is not None:
                # Padding frames are not tokens: keep the valid ones, in order (a host-side, concrete mask).
                frames = frames[jnp.asarray(audio_input_ids_mask).reshape(-1).astype(bool)]
            x = merge_placeholders(x, input_ids, self.config.audio_token_id, self.audio(frames), "audio")
        return x


def merge_placeholders(x, input_ids, token_id: int, features, kind: str):
    """Replace the rows of x at `token_id` placeholders, in reading order, by `features [N, hidden]`."""
    is_slot = (input_ids == token_id).reshape(-1)
    count = int(is_slot.sum())  # concrete: media is merged outside jit, where counts can be checked
    if count != features.shape[0]:
        raise ValueError(f"{kind}: {count} placeholder tokens (id {token_id}) but {features.shape[0]} "
                         f"{kind} embeddings; the prompt and the media do not match")
    flat = x.reshape(-1, x.shape[-1])
    source = jnp.clip(jnp.cumsum(is_slot) - 1, 0, max(count - 1, 0))
    merged = jnp.where(is_slot[:, None], features.astype(x.dtype)[source] if count else flat, flat)
    return merged.reshape(x.shape)


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
