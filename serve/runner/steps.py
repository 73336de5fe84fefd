"""The engine's device programs, each compiled once per shape bucket (see `serve.engine.config`).

`prefill`: R rows of up to T tokens, a chunk each; the head runs only at each row's last real token (at
Inkling's vocabulary the head over every position would be the step's largest matmul), one sample per row. Its
variant with prompt-logprob targets (`serve.runner.prompt_logprobs`) runs the head at every position and also
returns the positions' logprobs.
`decode`: step `step` of a run of one-token steps over the same inputs, each row feeding back its own sample
(`RowState.last_token`, on the device) so the host dispatches the next step without waiting for this one and reads
the samples of the whole run at once. Row r takes `steps[r]` of them (0: a padding row, untouched). Sampling uses
each row's parameters and (seed, output index), so the tokens equal those of one call per token; the host
discards what follows a stop. The run is host-driven rather than an on-device loop because XLA's GPU while loop
reads its condition on the host at every iteration and copies loop-carried buffers: idle device time per token
(see docs/performance.md).
`mixed`: a decode step of some rows and prefill chunks of others in one program, which reads the weights once
(`InklingModel.extend_sets`; `serve.runner.mixed_steps` says when the runner takes it).

All gather their rows' state out of the cache (the all-rows bucket works in place), run, and scatter it
back; cache and penalty state are donated. `constrain` pins the returned cache to its sharding (a mesh); `whole`
puts the `full` sampler's logits whole on every device (a mesh), one gather of [R, V] rather than the collective
per pass of the cutoff searches that XLA would otherwise give the vocabulary-split filters (`sampler.top_k_top_p`).

Host overhead per call is on the serving critical path, so the programs take the parameters as a flat list of
arrays (`inkling_jax.generate.flat_params`) and the step inputs packed into two arrays (`pack`; one
host-to-device copy each instead of fifteen).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from inkling_jax.nn.token_sets import ChunkSet
from serve.engine.config import EngineConfig
from serve.engine.scheduler import Chunk
from serve.lora.view import route
from serve.runner import cache_rows, prompt_logprobs
from serve.runner.routing_record import pool_slots, routing_columns
from serve.runner.sampler import FLOAT_FIELDS, INT_FIELDS, NO_SEQUENCE, SamplingBatch, batch_of, pack_samples, sample


@struct.dataclass
class StepInputs:
    rows: jax.Array  # [R] cache row of each step row (padding rows: distinct rows past the cache)
    ids: jax.Array  # [R, T]
    n_new: jax.Array  # [R] real tokens per row (decode: 1)
    lengths: jax.Array  # [R] tokens already cached
    page_rows: jax.Array  # [R, pages_per_row]
    steps: jax.Array  # [R] tokens the row samples (prefill: 1 if the chunk ends its known tokens, else 0)
    next_token: jax.Array  # [R] the known token after the chunk, -1 if none (a drafter's MTP head reads it)
    adapters: jax.Array  # [R] LoRA adapter slot of each row (0: the base; `serve.lora`)
    applied: jax.Array  # [R] tokens a continued run of rounds' carry counts that the host has applied since (else 0)
    params: SamplingBatch
    media: jax.Array | None = None  # [R, T, hidden] media embeddings (multimodal models' prefill only)
    is_media: jax.Array | None = None  # [R, T] bool: positions that take `media` instead of their token


_INT_COLUMNS = ("rows", "n_new", "lengths", "steps", "next_token", "adapters", "applied")


@struct.dataclass
class PackedInputs:
    """StepInputs in a few arrays: ints [R, 10 + T + pages_per_row] (the int columns, the sampler's int fields, the
    ids, the page rows), floats [R, 6] (the sampler's float fields), and the media arrays of a multimodal
    prefill."""
    ints: jax.Array
    floats: jax.Array
    media: jax.Array | None = None
    is_media: jax.Array | None = None


def pack(inp: StepInputs) -> PackedInputs:
    """Host numpy StepInputs -> PackedInputs (numpy)."""
    columns = [getattr(inp, name).astype(np.int32) for name in _INT_COLUMNS]
    columns += [getattr(inp.params, name).astype(dtype).view(np.int32) for name, dtype in INT_FIELDS.items()]
    ints = np.concatenate([np.stack(columns, axis=1), inp.ids.astype(np.int32), inp.page_rows.astype(np.int32)],
                          axis=1)
    floats = np.stack([getattr(inp.params, name).astype(np.float32) for name in FLOAT_FIELDS], axis=1)
    return PackedInputs(ints, floats, inp.media, inp.is_media)


def unpack(packed: PackedInputs, pages_per_row: int) -> StepInputs:
    """The inverse of `pack`, inside a program."""
    n = len(_INT_COLUMNS) + len(INT_FIELDS)
    ints = packed.ints
    column = dict(zip(_INT_COLUMNS + tuple(INT_FIELDS), (ints[:, i] for i in range(n))))
    floats = {name: packed.floats[:, i] for i, name in enumerate(FLOAT_FIELDS)}
    params = SamplingBatch(**floats, **{name: jax.lax.bitcast_convert_type(column[name], dtype)
                                        for name, dtype in INT_FIELDS.items()})
    return StepInputs(rows=column["rows"], ids=ints[:, n:ints.shape[1] - pages_per_row], n_new=column["n_new"],
                      lengths=column["lengths"], page_rows=ints[:, ints.shape[1] - pages_per_row:],
                      steps=column["steps"], next_token=column["next_token"], adapters=column["adapters"],
                      applied=column["applied"], params=params, media=packed.media, is_media=packed.is_media)


@struct.dataclass
class RowState:
    """What the programs carry per cache row from step to step, besides the cache. `last_token` is kept by the
    plain programs (not by speculative rounds, which carry their own)."""
    counts: jax.Array  # [rows, V] int32: output tokens so far (penalties)
    prompt_mask: jax.Array  # [rows, V] bool: tokens of the prompt (penalties)
    last_token: jax.Array  # [rows] int32: the row's last sample, which a decode input id of -1 stands for


def init_penalties(row_state: RowState, row, tokens, num_prompt) -> RowState:
    """Row `row` starts a sequence whose known tokens are `tokens` (-1 padded); the first `num_prompt` are its
    prompt."""
    vocab = row_state.counts.shape[1]
    position = jnp.arange(tokens.shape[0])
    index = jnp.where(tokens >= 0, tokens, vocab)  # padding: out of range, dropped
    counts = jnp.zeros((vocab,), jnp.int32).at[index].add((position >= num_prompt).astype(jnp.int32), mode="drop")
    in_prompt = jnp.zeros((vocab,), bool).at[jnp.where(position < num_prompt, index, vocab)].set(True, mode="drop")
    return row_state.replace(counts=row_state.counts.at[row].set(counts),
                             prompt_mask=row_state.prompt_mask.at[row].set(in_prompt))


class StepPrograms:
    def __init__(self, merge: Callable, text_config, num_top: int, filters: bool, pages_per_row: int,
                 constrain: Callable = lambda cache: cache, whole: Callable = lambda logits: logits,
                 routing_page_size: int | None = None):
        """filters: the full sampler's filters (`sampler.sample`); routing_page_size: the page size, where the
        programs record routing (`serve.runner.routing_record`); None: they record nothing."""
        self.merge = merge  # parameter leaves -> model (see `flat_params`)
        self.pages_per_row = pages_per_row
        self.text = text_config
        self.num_top, self.filters = num_top, filters
        self.constrain = constrain
        self.whole = whole
        self.routing_page_size = routing_page_size

    def prefill(self, param_leaves, cache, row_state: RowState, packed: PackedInputs, targets=None, *,
                gather: bool, full: bool):
        """A prefill chunk per row; `full` as in `decode`. With `targets` [R, T] (`prompt_logprobs.prompt_targets`)
        the head also runs at every position, and a fourth output holds their prompt logprobs
        (`prompt_logprobs.score_positions`);
        a drafting program's drafts [R, K] come last (`_draft`)."""
        model = self.merge(param_leaves)
        inp = unpack(packed, self.pages_per_row)
        route(model, inp.adapters)
        sub = self._rows_in(cache, inp, gather)
        last = jnp.maximum(inp.n_new - 1, 0)
        hidden, sub, experts = model.extend_routed(inp.ids, sub, inp.n_new, embeds=_embeds(model, inp))
        logits = model.logits(hidden[jnp.arange(hidden.shape[0]), last])
        out, row_state = self._sample(model, logits, row_state, inp.rows, inp.params, inp.steps > 0, full)
        sub, drafts = self._draft(param_leaves, model, inp, hidden, sub, out.tokens)
        cache = self._rows_out(cache, inp, sub, gather)
        outputs = cache, row_state, self._packed(out, experts, inp)[None]
        if targets is not None:
            outputs += (prompt_logprobs.score_positions(model.logits, hidden, targets, self.num_top),)
        return outputs if drafts is None else (*outputs, drafts)

    def _draft(self, param_leaves, model, inp: StepInputs, hidden, sub, tokens):
        """(sub, drafts or None) after a prefill chunk: speculative programs draft the tokens after each row's
        sample here (`serve.runner.speculative`); plain ones have nothing to do."""
        return sub, None

    def decode(self, param_leaves, cache, row_state: RowState, packed: PackedInputs, step, *, gather: bool,
               full: bool):
        """Step `step` (int32 scalar) of the run; returns (cache, row_state, samples [1, R, 2 + 2K]
        (`sampler.pack_samples`; recording routing, its columns after them: `_packed`)). A row's first step feeds
        its input id, or where that is -1 (a token sampled by a step not yet read) the row's last sample; later
        steps feed the row's last sample.
        `full`: the sampler with penalties, filters and logprobs (see `sampler.sample`)."""
        model = self.merge(param_leaves)
        inp = unpack(packed, self.pages_per_row)
        route(model, inp.adapters)
        active = step < inp.steps
        inp = inp.replace(lengths=inp.lengths + jnp.minimum(step, inp.steps))  # what the run's earlier steps added
        sub = self._rows_in(cache, inp, gather)
        ids = _decode_ids(row_state, inp, step == 0)
        inp = inp.replace(n_new=active.astype(jnp.int32))
        hidden, sub, experts = model.extend_routed(ids, sub, inp.n_new)
        params = inp.params.replace(index=inp.params.index + step)
        out, row_state = self._sample(model, model.logits(hidden[:, 0]), row_state, inp.rows, params, active, full)
        cache = self._rows_out(cache, inp, sub, gather)
        return cache, row_state, self._packed(out, experts, inp)[None]

    def mixed(self, param_leaves, cache, row_state: RowState, decode: PackedInputs, prefill: PackedInputs, *,
              gather: bool, full: bool):
        """The decode rows' step (`decode`'s first: one token each) and the prefill rows' chunk (as `prefill`) in one
        program, every position-wise module over both sets' tokens at once (`InklingModel.extend_sets`), so that
        the step reads each weight once; the sets sample together. `gather`: whether the decode rows are gathered
        (the prefill rows always are); `full` as in `decode`. Returns (cache, row_state, the decode rows' samples
        [1, R, ...], the prefill rows' [1, R', ...]), each as its own program gives them."""
        model = self.merge(param_leaves)
        dec, pre = unpack(decode, self.pages_per_row), unpack(prefill, self.pages_per_row)
        dec = dec.replace(n_new=(dec.steps > 0).astype(jnp.int32))  # as a decode run's first step
        route(model, jnp.concatenate([dec.adapters, jnp.repeat(pre.adapters, pre.ids.shape[1])]))  # per token
        # Decode rows first: a whole-cache decode set returns every row, and the prefill rows go over it.
        (hidden_d, hidden_p), (sub_d, sub_p), (experts_d, experts_p) = model.extend_sets([
            ChunkSet(_decode_ids(row_state, dec, True), self._rows_in(cache, dec, gather), dec.n_new),
            ChunkSet(pre.ids, self._rows_in(cache, pre, True), pre.n_new, _embeds(model, pre))])
        last = hidden_p[jnp.arange(hidden_p.shape[0]), jnp.maximum(pre.n_new - 1, 0)]
        logits = model.logits(jnp.concatenate([hidden_d[:, 0], last]))
        both = lambda a, b: jnp.concatenate([a, b])  # noqa: E731
        out, row_state = self._sample(model, logits, row_state, both(dec.rows, pre.rows),
                                      jax.tree.map(both, dec.params, pre.params),
                                      both(dec.n_new > 0, pre.steps > 0), full)
        split = dec.rows.shape[0]
        out_d, out_p = jax.tree.map(lambda x: x[:split], out), jax.tree.map(lambda x: x[split:], out)
        cache = self._rows_out(self._rows_out(cache, dec, sub_d, gather), pre, sub_p, True)
        return (cache, row_state, self._packed(out_d, experts_d, dec)[None],
                self._packed(out_p, experts_p, pre)[None])

    def _packed(self, out, experts, inp: StepInputs):
        """The samples packed (`sampler.pack_samples`), followed where the programs record routing by each
        position's pool slot and experts (`routing_record.routing_columns`)."""
        packed = pack_samples(out)
        if self.routing_page_size is None:
            return packed
        slots = pool_slots(inp.page_rows, inp.lengths, inp.n_new, self.routing_page_size, experts.shape[1])
        return jnp.concatenate([packed, routing_columns(experts, slots)], axis=1)

    def _sample(self, model, logits, row_state: RowState, rows, p: SamplingBatch, active, full):
        """One token per row of logits [R, V], whose cache rows are `rows` [R]. Returns the samples and the row
        state with the active rows' samples as their last tokens and, with the `full` sampler (penalised rows always
        run it), the active penalised rows' samples added to their output-token counts. A batch-invariant model's
        rows are sampled in fixed-order sums (`sampler.sample`'s `invariant`). The full sampler applies penalties
        to every row (neutral values change nothing): a branch on whether any row uses them would cost a host
        round-trip (see `sampler.sample`)."""
        if not full:
            out = sample(logits, p, None, None, self.num_top, full=False)
            return out, _with_last_token(row_state, rows, active, out.tokens)
        take = lambda x: x.at[rows].get(mode="clip")  # noqa: E731  (padding rows read the scratch row)
        out = sample(self.whole(logits), p, take(row_state.counts), take(row_state.prompt_mask), self.num_top,
                     invariant=model.backend.batch_invariant, filters=self.filters)
        counts = row_state.counts.at[rows, out.tokens].add((active & p.uses_penalties).astype(jnp.int32),
                                                           mode="drop")
        return out, _with_last_token(row_state.replace(counts=counts), rows, active, out.tokens)

    def _rows_in(self, cache, inp: StepInputs, gather: bool):
        sub = cache_rows.take_rows(cache, inp.rows) if gather else cache
        sub = cache_rows.clear_conv_state(sub, (inp.lengths == 0) & (inp.n_new > 0))  # rows that start a sequence
        return sub.replace(lengths=inp.lengths, page_table=inp.page_rows)

    def _rows_out(self, cache, inp: StepInputs, sub, gather: bool):
        return self.constrain(cache_rows.put_rows(cache, inp.rows, sub) if gather else sub)


def _decode_ids(row_state: RowState, inp: StepInputs, first):
    """[R, 1] the token each decode row feeds: its input id where `first` (a run's first step) and that is not -1,
    else the row's last sample (padding rows read the scratch row's)."""
    last = row_state.last_token.at[inp.rows].get(mode="clip")
    return jnp.where(first & (inp.ids[:, 0] >= 0), inp.ids[:, 0], last)[:, None]


def _with_last_token(row_state: RowState, rows, active, tokens) -> RowState:
    """`tokens` [R] as the last samples of the active rows among `rows` (padding rows, past the cache, drop out)."""
    index = jnp.where(active, rows, row_state.last_token.shape[0])
    return row_state.replace(last_token=row_state.last_token.at[index].set(tokens, mode="drop"))


def _embeds(model, inp: StepInputs):
    """A multimodal prefill's input embeddings: its tokens' with the media features at their positions; None
    without media."""
    if inp.media is None:
        return None
    tokens = model.embed_tokens(inp.ids)
    return jnp.where(inp.is_media[..., None], inp.media.astype(tokens.dtype), tokens)


def step_inputs(cfg: EngineConfig, group: list[Chunk], index: list[int], rows: int, chunk: int,
                media_like=None) -> StepInputs:
    """Host arrays of one step of `rows` rows x `chunk` tokens: chunk group[i] in row index[i]; padding rows add
    nothing. In a gathered step each padding row gets its own row number past the cache (they read the scratch
    row, the last one, and their writes are dropped), so that the rows a step scatters back are distinct (see
    `cache_rows.put_rows`). media_like: (width, dtype) of media features where the model has media towers."""
    every_row = rows == cfg.num_rows
    cache_row = np.arange(rows, dtype=np.int32) + (0 if every_row else cfg.num_rows)
    ids = np.zeros((rows, chunk), np.int32)
    n_new, lengths, steps = (np.zeros((rows,), np.int32) for _ in range(3))
    next_token = np.full((rows,), -1, np.int32)
    adapters = np.zeros((rows,), np.int32)
    page_rows = np.zeros((rows, cfg.pages_per_row), np.int32)
    params, index_out = [NO_SEQUENCE] * rows, [0] * rows
    media = is_media = None
    if media_like is not None:
        media = np.zeros((rows, chunk, media_like[0]), media_like[1])
        is_media = np.zeros((rows, chunk), bool)
    for c, row in zip(group, index):
        seq = c.seq
        cache_row[row] = seq.slot
        start = seq.num_cached
        ids[row, :c.num_tokens] = seq.token_ids[start:start + c.num_tokens]  # (a pending token: -1)
        n_new[row], lengths[row] = c.num_tokens, start
        if start + c.num_tokens < len(seq):
            next_token[row] = seq.token_ids[start + c.num_tokens]
        page_rows[row, :len(seq.block_ids)] = seq.block_ids
        steps[row], adapters[row] = c.samples, seq.lora_slot
        params[row], index_out[row] = seq.params, seq.num_output
        if media is not None and seq.media is not None:
            positions, features = seq.media
            inside = (positions >= start) & (positions < start + c.num_tokens)
            media[row, positions[inside] - start] = features[inside]
            is_media[row, positions[inside] - start] = True
    return StepInputs(cache_row, ids, n_new, lengths, page_rows, steps, next_token, adapters,
                      np.zeros((rows,), np.int32), batch_of(params, index_out), media, is_media)
