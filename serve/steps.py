"""The engine's device programs, each compiled once per shape bucket (see `serve.config`).

`prefill`: R rows of up to T tokens, a chunk each; the head runs only at each row's last real token (at
Inkling's vocabulary the head over every position would be the step's largest matmul), one sample per row.
`decode`: up to `decode_steps` one-token steps in one on-device loop, each row feeding back its own sample,
so a host round-trip buys several tokens. Row r takes `steps[r]` of them (0: a padding row, untouched); the
loop runs max(steps) times. Sampling inside the loop uses each row's parameters and (seed, output index), so
its tokens equal those of one-step calls; the host discards what follows a stop.

Both gather their rows' state out of the cache (the all-rows bucket works in place), run, and scatter it
back; cache and penalty state are donated. `constrain` pins the returned cache to its sharding (a mesh).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
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


@struct.dataclass
class PenaltyState:
    counts: jax.Array  # [rows, V] int32: output tokens so far
    prompt_mask: jax.Array  # [rows, V] bool: tokens of the prompt


class StepPrograms:
    def __init__(self, graphdef, text_config, num_top: int, decode_steps: int,
                 constrain: Callable = lambda cache: cache):
        self.graphdef = graphdef
        self.text = text_config
        self.num_top = num_top
        self.decode_steps = decode_steps
        self.constrain = constrain

    def prefill(self, params, cache, penalties: PenaltyState, inp: StepInputs, *, gather: bool):
        model = nnx.merge(self.graphdef, params)
        sub = self._rows_in(cache, inp, gather)
        embeds = None
        if inp.media is not None:
            tokens = model.embed_tokens(inp.ids)
            embeds = jnp.where(inp.is_media[..., None], inp.media.astype(tokens.dtype), tokens)
        logits, sub = model.extend(inp.ids, sub, inp.n_new, embeds=embeds, logits_at=jnp.maximum(inp.n_new - 1, 0))
        out, counts = self._sample(logits, penalties, inp, inp.params, inp.steps > 0, penalties.counts)
        cache = self._rows_out(cache, inp, sub, gather)
        return cache, penalties.replace(counts=counts), jax.tree.map(lambda x: x[None], out)

    def decode(self, params, cache, penalties: PenaltyState, inp: StepInputs, *, gather: bool):
        model = nnx.merge(self.graphdef, params)
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
