"""The engine's device programs, each compiled once per shape bucket (see `serve.config`).

`prefill`: R rows of up to T tokens, a chunk each; the head runs only at each row's last real token (at
Inkling's vocabulary the head over every position would be the step's largest matmul), one sample per row.
`decode`: up to `decode_steps` one-token steps in one on-device loop, each row feeding back its own sample,
so a host round-trip buys several tokens. Row r takes `steps[r]` of them (0: a padding row, untouched); the
loop runs max(steps) times. Sampling inside the loop uses each row's parameters and (seed, output index), so
its tokens equal those of one-step calls; the host discards what follows a stop.

Both gather their rows' state out of the cache (the all-rows bucket works in place), run, and scatter it
back; cache and penalty state are donated. `constrain` pins the returned cache to its sharding (a mesh).

Host overhead per call is on the serving critical path, so the programs take the parameters as a flat list of
arrays (an nnx.State pytree costs about a millisecond to flatten at every call) and the step inputs packed into
two arrays (`pack`; one host-to-device copy each instead of fifteen).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from serve import cache_rows
from serve.sampler import Sampled, SamplingBatch, apply_penalties, choose


@struct.dataclass
class StepInputs:
    rows: jax.Array  # [R] cache row of each step row (the scratch row for padding)
    ids: jax.Array  # [R, T]
    n_new: jax.Array  # [R] real tokens per row (decode: 1)
    lengths: jax.Array  # [R] tokens already cached
    page_rows: jax.Array  # [R, pages_per_row]
    steps: jax.Array  # [R] tokens the row samples (prefill: 1 if the chunk ends its known tokens, else 0)
    want_top: jax.Array  # [R] bool: the row asked for top logprobs
    params: SamplingBatch
    media: jax.Array | None = None  # [R, T, hidden] media embeddings (multimodal models' prefill only)
    is_media: jax.Array | None = None  # [R, T] bool: positions that take `media` instead of their token


_INT_COLUMNS = ("rows", "n_new", "lengths", "steps", "want_top")
_PARAM_INTS = ("top_k", "seed", "index")
_PARAM_FLOATS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")


@struct.dataclass
class PackedInputs:
    """StepInputs in a few arrays: ints [R, 8 + T + pages_per_row] (the int columns, the sampling ints, the ids,
    the page rows), floats [R, 6] (the sampling floats), and the media arrays of a multimodal prefill."""
    ints: jax.Array
    floats: jax.Array
    media: jax.Array | None = None
    is_media: jax.Array | None = None


def pack(inp: StepInputs) -> PackedInputs:
    """Host numpy StepInputs -> PackedInputs (numpy)."""
    columns = [getattr(inp, name).astype(np.int32) for name in _INT_COLUMNS]
    columns += [getattr(inp.params, name).astype(np.uint32).view(np.int32) if name == "seed"
                else getattr(inp.params, name).astype(np.int32) for name in _PARAM_INTS]
    ints = np.concatenate([np.stack(columns, axis=1), inp.ids.astype(np.int32), inp.page_rows.astype(np.int32)],
                          axis=1)
    floats = np.stack([getattr(inp.params, name).astype(np.float32) for name in _PARAM_FLOATS], axis=1)
    return PackedInputs(ints, floats, inp.media, inp.is_media)


def unpack(packed: PackedInputs, pages_per_row: int) -> StepInputs:
    """The inverse of `pack`, inside a program."""
    n = len(_INT_COLUMNS) + len(_PARAM_INTS)
    ints = packed.ints
    column = dict(zip(_INT_COLUMNS + _PARAM_INTS, (ints[:, i] for i in range(n))))
    column["seed"] = jax.lax.bitcast_convert_type(column["seed"], jnp.uint32)
    floats = {name: packed.floats[:, i] for i, name in enumerate(_PARAM_FLOATS)}
    params = SamplingBatch(**floats, **{name: column[name] for name in _PARAM_INTS})
    return StepInputs(rows=column["rows"], ids=ints[:, n:ints.shape[1] - pages_per_row], n_new=column["n_new"],
                      lengths=column["lengths"], page_rows=ints[:, ints.shape[1] - pages_per_row:],
                      steps=column["steps"], want_top=column["want_top"] > 0, params=params, media=packed.media,
                      is_media=packed.is_media)


@struct.dataclass
class PenaltyState:
    counts: jax.Array  # [rows, V] int32: output tokens so far
    prompt_mask: jax.Array  # [rows, V] bool: tokens of the prompt


class StepPrograms:
    def __init__(self, graphdef, param_tree, text_config, num_top: int, decode_steps: int, pages_per_row: int,
                 constrain: Callable = lambda cache: cache):
        self.graphdef = graphdef
        self.param_tree = param_tree  # treedef of the parameter leaves the programs take
        self.pages_per_row = pages_per_row
        self.text = text_config
        self.num_top = num_top
        self.decode_steps = decode_steps
        self.constrain = constrain

    def _model(self, param_leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.param_tree, param_leaves))

    def prefill(self, param_leaves, cache, penalties: PenaltyState, packed: PackedInputs, *, gather: bool):
        model = self._model(param_leaves)
        inp = unpack(packed, self.pages_per_row)
        sub = self._rows_in(cache, inp, gather)
        embeds = None
        if inp.media is not None:
            tokens = model.embed_tokens(inp.ids)
            embeds = jnp.where(inp.is_media[..., None], inp.media.astype(tokens.dtype), tokens)
        logits, sub = model.extend(inp.ids, sub, inp.n_new, embeds=embeds, logits_at=jnp.maximum(inp.n_new - 1, 0))
        out, counts = self._sample(logits, penalties, inp, inp.params, inp.steps > 0, penalties.counts)
        cache = self._rows_out(cache, inp, sub, gather)
        return cache, penalties.replace(counts=counts), jax.tree.map(lambda x: x[None], out)

    def decode(self, param_leaves, cache, penalties: PenaltyState, packed: PackedInputs, *, gather: bool):
        model = self._model(param_leaves)
        inp = unpack(packed, self.pages_per_row)
        sub = self._rows_in(cache, inp, gather)
        rows = inp.ids.shape[0]
        zeros = lambda shape, dtype: jnp.zeros((self.decode_steps, rows) + shape, dtype)  # noqa: E731
        empty = Sampled(zeros((), jnp.int32), zeros((), jnp.float32), zeros((self.num_top,), jnp.int32),
                        zeros((self.num_top,), jnp.float32))

        def step(k, carry):
            sub, counts, ids, outs = carry
            active = k < inp.steps
            logits, sub = model.extend(ids, sub, active.astype(jnp.int32), logits_at=jnp.zeros((rows,), jnp.int32))
            params = inp.params.replace(index=inp.params.index + k)
            out, counts = self._sample(logits, penalties, inp, params, active, counts)
            outs = jax.tree.map(lambda buffer, x: buffer.at[k].set(x), outs, out)
            return sub, counts, jnp.where(active, out.tokens, ids[:, 0])[:, None], outs

        sub, counts, _, outs = jax.lax.fori_loop(0, jnp.max(inp.steps), step,
                                                 (sub, penalties.counts, inp.ids, empty))
        cache = self._rows_out(cache, inp, sub, gather)
        return cache, penalties.replace(counts=counts), outs

    def _sample(self, logits, penalties: PenaltyState, inp: StepInputs, p: SamplingBatch, active, counts):
        """One token per row; penalties (and their [R, V] gathers) only when a row uses them. Returns the
        samples and the updated output-token counts of the active penalised rows."""
        penalised = (p.presence != 0) | (p.frequency != 0) | (p.repetition != 1)
        any_penalised = jnp.any(penalised)
        logits = logits.astype(jnp.float32)
        adjusted = jax.lax.cond(
            any_penalised,
            lambda: apply_penalties(logits, counts[inp.rows], penalties.prompt_mask[inp.rows], p),
            lambda: logits)
        out = choose(logits, adjusted, p, self.num_top, jnp.any(inp.want_top & active))
        counted = (active & penalised).astype(jnp.int32)
        counts = jax.lax.cond(any_penalised, lambda c: c.at[inp.rows, out.tokens].add(counted), lambda c: c, counts)
        return out, counts

    def _rows_in(self, cache, inp: StepInputs, gather: bool):
        sub = cache_rows.take_rows(self.text, cache, inp.rows) if gather else cache
        return sub.replace(lengths=inp.lengths, page_table=inp.page_rows)

    def _rows_out(self, cache, inp: StepInputs, sub, gather: bool):
        return self.constrain(cache_rows.put_rows(self.text, cache, inp.rows, sub) if gather else sub)
