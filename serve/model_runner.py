"""Runs scheduled chunks on the device: the cache, the compiled steps (one per shape bucket), the sampler state
(penalty counts) and the snapshot pool.

A step of R rows and T tokens per row gathers its rows' state out of the cache (the bucket "all rows" runs on the
whole cache in place), extends them, samples one token per row from its last real position, and scatters the
rows back; cache and sampler state are donated. Every bucket is compiled ahead of time by `warm_up`, and a call
outside the buckets is an error, never a silent compilation.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from inkling_jax.cache import cache_bytes
from inkling_jax.model import InklingModel
from serve import cache_rows
from serve.config import EngineConfig
from serve.sampler import Sampled, SamplingBatch, sample
from serve.scheduler import Chunk

log = logging.getLogger(__name__)

CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_compilations = []


def compilation_count() -> int:
    """XLA compilations in this process since the first call (for checking that serving compiles nothing)."""
    if not _compilations:
        _compilations.append(0)
        jax.monitoring.register_event_duration_secs_listener(_count_compilation)
    return _compilations[0]


def _count_compilation(event: str, *_, **__) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compilations[0] += 1


@struct.dataclass
class StepInputs:
    rows: jax.Array  # [R] cache row of each step row (the scratch row for padding)
    ids: jax.Array  # [R, T]
    n_new: jax.Array  # [R] real tokens per row
    lengths: jax.Array  # [R] tokens already cached
    page_rows: jax.Array  # [R, pages_per_row]
    keep: jax.Array  # [R] bool: the row's sample becomes its next token
    params: SamplingBatch


@struct.dataclass
class PenaltyState:
    counts: jax.Array  # [rows, V] int32: output tokens so far
    prompt_mask: jax.Array  # [rows, V] bool: tokens of the prompt


class ModelRunner:
    def __init__(self, model: InklingModel, config: EngineConfig):
        self.config = config
        self.text = model.config.text
        self.vocab = self.text.unpadded_vocab_size
        self.graphdef, self.params = nnx.split(model)
        self.model = model
        self.num_pages = config.num_pages or self._pages_for_memory(model)
        if self.num_pages < config.pages_per_row:
            raise ValueError(f"{self.num_pages} pages cannot hold one sequence of {config.max_model_len} tokens")
        self.reset()
        self._steps: dict[tuple[int, int], object] = {}
        self._save = self._restore = self._init_penalties = None
        log.info("KV pool: %d pages of %d tokens (%.1f MiB); %d slots (+1 scratch) of ring and conv state "
                 "(%.1f MiB each); %d prefix snapshots", self.num_pages, config.page_size,
                 self._page_bytes() * self.num_pages / 2**20, config.max_num_seqs,
                 cache_rows.bytes_per_row(self.text, self.cache) / 2**20, config.snapshots)

    def reset(self) -> None:
        """Fresh device state (also after a failed step, whose donated buffers may be gone)."""
        cfg = self.config
        self.cache = self.model.init_cache(cfg.num_rows, cfg.max_model_len, page_size=cfg.page_size,
                                           num_pages=self.num_pages)
        self.snapshots = cache_rows.empty_snapshots(self.text, self.cache, cfg.snapshots)
        self.penalties = PenaltyState(jnp.zeros((cfg.num_rows, self.vocab), jnp.int32),
                                      jnp.zeros((cfg.num_rows, self.vocab), bool))

    # ------------------------------------------------------------------------------------------------------
    # Memory

    def _page_bytes(self) -> int:
        full = self.text.num_layers - len(self.text.local_layer_ids)
        shape = self.text.attention(False)
        return 2 * full * self.config.page_size * shape.num_kv_heads * shape.head_dim * self.model.dtype.itemsize

    def _pages_for_memory(self, model: InklingModel) -> int:
        """Pages that fit in `memory_fraction` of the free device memory after the per-slot state, the
        snapshots, the sampler state and the largest step's logits; without memory statistics (CPU) enough
        pages for every slot at full length."""
        cfg = self.config
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return cfg.max_num_seqs * cfg.pages_per_row
        free = (stats["bytes_limit"] - stats["bytes_in_use"]) * cfg.memory_fraction
        fixed = cache_bytes(self.text, cfg.num_rows, cfg.max_model_len, model.dtype, page_size=cfg.page_size,
                            num_pages=1) - self._page_bytes()
        per_row = fixed // cfg.num_rows
        fixed += cfg.snapshots * per_row + cfg.num_rows * self.vocab * 5
        fixed += 3 * cfg.rows[-1] * cfg.max_chunk * self.vocab * 4  # logits and their softmax, in fp32
        pages = int((free - fixed) // self._page_bytes())
        log.info("device memory: %.1f GiB free x %.2f; %.1f GiB for slots, snapshots and step buffers; "
                 "%d pages", free / cfg.memory_fraction / 2**30, cfg.memory_fraction, fixed / 2**30, pages)
        return pages

    # ------------------------------------------------------------------------------------------------------
    # Compilation

    def warm_up(self) -> float:
        """Compile every step bucket and helper; returns the seconds it took."""
        start = time.perf_counter()
        # On CPU (tests, demos) compile time dominates: XLA's cheaper backend passes cut it by about half.
        options = CPU_COMPILE_OPTIONS if jax.default_backend() == "cpu" else None
        step = jax.jit(self._step_fn, static_argnames="gather", donate_argnums=(1, 2))
        for rows, chunk in self.config.buckets:
            inputs = jax.device_put(self._inputs([], rows, chunk))
            self._steps[rows, chunk] = step.lower(self.params, self.cache, self.penalties, inputs,
                                                  gather=rows != self.config.num_rows).compile(options)
        scalar = np.int32(0)
        tokens = np.zeros((self.config.max_model_len,), np.int32)
        self._init_penalties = jax.jit(self._init_penalties_fn, donate_argnums=0).lower(
            self.penalties, scalar, tokens, scalar).compile(options)
        if self.config.snapshots:
            self._save = jax.jit(self._save_fn, donate_argnums=1).lower(
                self.cache, self.snapshots, scalar, scalar).compile(options)
            self._restore = jax.jit(self._restore_fn, donate_argnums=0).lower(
                self.cache, self.snapshots, scalar, scalar).compile(options)
        seconds = time.perf_counter() - start
        log.info("compiled %d step buckets (rows x tokens: %s) in %.1fs", len(self._steps), self.config.buckets,
                 seconds)
        return seconds

    def _step_fn(self, params, cache, penalties: PenaltyState, inp: StepInputs, *, gather: bool):
        model = nnx.merge(self.graphdef, params)
        sub = cache_rows.take_rows(self.text, cache, inp.rows) if gather else cache
        sub = sub.replace(lengths=inp.lengths, page_table=inp.page_rows)
        logits, sub = model.extend(inp.ids, sub, inp.n_new)
        cache = cache_rows.put_rows(self.text, cache, inp.rows, sub) if gather else sub
        num_rows = inp.ids.shape[0]
        last = logits[jnp.arange(num_rows), jnp.maximum(inp.n_new - 1, 0)]
        p = inp.params
        penalised = (p.presence != 0) | (p.frequency != 0) | (p.repetition != 1)
        any_penalised = jnp.any(penalised)
        counts, prompt_mask = jax.lax.cond(
            any_penalised, lambda: (penalties.counts[inp.rows], penalties.prompt_mask[inp.rows]),
            lambda: (jnp.zeros((num_rows, self.vocab), jnp.int32), jnp.zeros((num_rows, self.vocab), bool)))
        out = sample(last, p, counts, prompt_mask, self.config.max_logprobs)
        counted = (inp.keep & penalised).astype(jnp.int32)
        new_counts = jax.lax.cond(any_penalised, lambda c: c.at[inp.rows, out.tokens].add(counted), lambda c: c,
                                  penalties.counts)
        return cache, penalties.replace(counts=new_counts), out

    def _init_penalties_fn(self, penalties: PenaltyState, row, tokens, num_prompt):
        """Row `row` starts a sequence whose known tokens are `tokens` (-1 padded); the first `num_prompt`
        are its prompt."""
        position = jnp.arange(tokens.shape[0])
        index = jnp.where(tokens >= 0, tokens, self.vocab)  # padding: out of range, dropped
        counts = jnp.zeros((self.vocab,), jnp.int32).at[index].add((position >= num_prompt).astype(jnp.int32),
                                                                    mode="drop")
        in_prompt = jnp.zeros((self.vocab,), bool).at[jnp.where(position < num_prompt, index, self.vocab)].set(
            True, mode="drop")
        return PenaltyState(penalties.counts.at[row].set(counts), penalties.prompt_mask.at[row].set(in_prompt))

    def _save_fn(self, cache, snapshots, row, snapshot):
        return cache_rows.save_snapshot(self.text, cache, snapshots, row, snapshot)

    def _restore_fn(self, cache, snapshots, row, snapshot):
        return cache_rows.restore_snapshot(self.text, cache, snapshots, row, snapshot)

    # ------------------------------------------------------------------------------------------------------
    # Execution

    def execute(self, chunks: list[Chunk]) -> dict[int, tuple]:
        """Run one scheduled step; returns seq_id -> (token, logprob, top_ids, top_logprobs) for every chunk
        that ends its sequence's known tokens."""
        for chunk in chunks:
            seq = chunk.seq
            if chunk.restore is not None:
                self.cache = self._restore(self.cache, self.snapshots, np.int32(seq.slot), np.int32(chunk.restore))
            if chunk.admitted and seq.params.uses_penalties:
                tokens = np.full((self.config.max_model_len,), -1, np.int32)
                tokens[:len(seq)] = seq.token_ids
                self.penalties = self._init_penalties(self.penalties, np.int32(seq.slot), tokens,
                                                      np.int32(seq.num_prompt))
        dispatched = [(group, self._dispatch(group)) for group in self._groups(chunks)]
        results = {}
        for group, out in dispatched:
            host: Sampled = jax.device_get(out)
            rows = self._row_index(group)
            for chunk, row in zip(group, rows):
                if chunk.seq.num_cached + chunk.num_tokens == len(chunk.seq):
                    results[chunk.seq.seq_id] = (int(host.tokens[row]), float(host.logprobs[row]),
                                                 host.top_ids[row], host.top_logprobs[row])
        return results

    def save_snapshot(self, slot: int, snapshot: int) -> None:
        self.snapshots = self._save(self.cache, self.snapshots, np.int32(slot), np.int32(snapshot))

    @staticmethod
    def _groups(chunks: list[Chunk]) -> list[list[Chunk]]:
        """One step for the decodes (one token each), one for the prefill chunks."""
        decode = [c for c in chunks if c.num_tokens == 1]
        prefill = [c for c in chunks if c.num_tokens > 1]
        return [group for group in (decode, prefill) if group]

    def _row_index(self, group: list[Chunk]) -> list[int]:
        rows = self.config.row_bucket(len(group))
        return [c.seq.slot for c in group] if rows == self.config.num_rows else list(range(len(group)))

    def _dispatch(self, group: list[Chunk]):
        rows = self.config.row_bucket(len(group))
        chunk = self.config.chunk_bucket(max(c.num_tokens for c in group))
        inputs = jax.device_put(self._inputs(group, rows, chunk))
        self.cache, self.penalties, out = self._steps[rows, chunk](self.params, self.cache, self.penalties, inputs)
        return out

    def _inputs(self, group: list[Chunk], rows: int, chunk: int) -> StepInputs:
        """Host arrays of one step; padding rows point at the scratch row and add nothing."""
        cfg = self.config
        every_row = rows == cfg.num_rows
        index = self._row_index(group) if group else []
        cache_row = np.arange(rows, dtype=np.int32) if every_row else np.full((rows,), cfg.scratch_row, np.int32)
        ids = np.zeros((rows, chunk), np.int32)
        n_new, lengths, index_out = (np.zeros((rows,), np.int32) for _ in range(3))
        page_rows = np.zeros((rows, cfg.pages_per_row), np.int32)
        keep = np.zeros((rows,), bool)
        floats = {name: np.full((rows,), value, np.float32) for name, value in
                  (("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("presence", 0.0), ("frequency", 0.0),
                   ("repetition", 1.0))}
        top_k = np.zeros((rows,), np.int32)
        seed = np.zeros((rows,), np.uint32)
        for c, row in zip(group, index):
            seq, p = c.seq, c.seq.params
            cache_row[row] = seq.slot
            ids[row, :c.num_tokens] = seq.token_ids[seq.num_cached:seq.num_cached + c.num_tokens]
            n_new[row], lengths[row] = c.num_tokens, seq.num_cached
            page_rows[row, :len(seq.block_ids)] = seq.block_ids
            keep[row] = seq.num_cached + c.num_tokens == len(seq)
            for name, value in (("temperature", p.temperature), ("top_p", p.top_p), ("min_p", p.min_p),
                                ("presence", p.presence_penalty), ("frequency", p.frequency_penalty),
                                ("repetition", p.repetition_penalty)):
                floats[name][row] = value
            top_k[row], seed[row], index_out[row] = p.top_k, p.seed or 0, seq.num_output
        params = SamplingBatch(top_k=top_k, seed=seed, index=index_out, **floats)
        return StepInputs(cache_row, ids, n_new, lengths, page_rows, keep, params)
