"""The runner's compilation: every step bucket and helper compiled ahead of time (`warm_up`), the KV pool cut to
what fits beside the compiled programs' buffers, and each program run once before serving, so that no request
waits for a compile or a first kernel load. A mixin of `ModelRunner`, whose state it compiles for."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time

import jax
import numpy as np

from serve.engine import memory_plan
from serve.runner import cache_rows
from serve.runner.compilation import compile_options
from serve.runner.steps import init_penalties, pack

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 30.0  # how often the warm-up logs how far its tracing has come
SLOWEST_LOGGED = 5  # programs named in the warm-up's log line of the slowest compilations


class StepCompilation:
    def warm_up(self, spare: float = 0.05) -> float:
        """Compile every step bucket and helper; returns the seconds it took. `spare`: the room beyond the largest
        program's buffers that the KV pool leaves (`memory_plan.pages_that_fit`)."""
        start = time.perf_counter()
        # XLA compiles outside the GIL: each program compiles on the pool as soon as it is traced, while the next
        # ones are, and the buckets compile side by side.
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            compiling, reported = {}, start
            for key, program in self._lowered_programs():
                compiling[key] = pool.submit(_timed_compile, program, compile_options(key))
                if time.perf_counter() - reported >= PROGRESS_EVERY_S:  # a large model's warm-up takes minutes
                    reported = time.perf_counter()
                    log.info("warm-up: %d programs traced in %.0fs, %d of them compiled", len(compiling),
                             reported - start, sum(f.done() for f in compiling.values()))
            log.info("traced %d programs in %.1fs; compiling the rest of them", len(compiling),
                     time.perf_counter() - start)
            built = {key: future.result() for key, future in compiling.items()}  # (program, seconds)
        compiled = {key: program for key, (program, _) in built.items()}
        seconds = {key: took for key, (_, took) in built.items()}
        slowest = sorted(seconds, key=seconds.get, reverse=True)[:SLOWEST_LOGGED]
        log.info("slowest to compile (side by side, or found in the compilation cache): %s",
                 ", ".join(f"{key} {seconds[key]:.1f}s" for key in slowest))
        pages = memory_plan.pages_that_fit(compiled, self.num_pages, self.page_bytes_per_device(),
                                           memory_plan.free_bytes(self.placement.device_list),
                                           self.config.num_pages is not None, spare)
        if pages != self.num_pages:  # a smaller pool, and the programs again for its shapes
            self._resize_pool(pages)
            # The cut took the spare; checked again, only a real shortfall cuts more (each check compiles anew).
            self.warm_up(spare=0.0)
            return time.perf_counter() - start
        self._init_penalties = compiled.pop("init_penalties")
        self._scoring = compiled.pop("prompt_logprobs", None)
        self._save, self._restore = compiled.pop("save", None), compiled.pop("restore", None)
        mixed_keys = [key for key in compiled if key[0] == "mixed"]  # ("mixed", decode rows, chunk tokens, full)
        self._mixed = {(key[1], key[2] // self.config.max_chunk, key[3]): compiled.pop(key) for key in mixed_keys}
        self._steps = compiled
        self._run_once()
        seconds = time.perf_counter() - start
        log.info("compiled %d step programs (rows x tokens: %s; decode up to %d tokens per call) and %d mixed ones "
                 "(decode rows %s with prompt chunks of %s rows x %d tokens) in %.1fs", len(self._steps),
                 self.config.buckets, self.config.decode_steps, len(self._mixed), self.config.mixed_buckets,
                 self.config.mixed_prefills, self.config.max_chunk, seconds)
        return seconds

    def _lowered_programs(self):
        """(key, lowered program) for every step bucket and helper, each traced when asked for."""
        jit = self.placement.jit
        step_out = {"decode": None, "prefill": None, "scoring": None, "mixed": None}
        if self.cache_shardings is not None:
            replicated = self.placement.replicated()
            drafts = (replicated,) if self.speculative else ()  # a drafting program's drafts; a round's carry
            step_out = {"decode": (self.cache_shardings, replicated, replicated) + drafts,
                        "prefill": (self.cache_shardings, replicated, replicated) + drafts,
                        "scoring": (self.cache_shardings, replicated, replicated, replicated) + drafts,
                        "mixed": (self.cache_shardings, replicated, replicated, replicated)}
        # With speculative decoding a decode step is a round, `K + 1` tokens per row.
        decode = jit(self.programs.round if self.speculative else self.programs.decode,
                     out_shardings=step_out["decode"], static_argnames=("gather", "full"), donate_argnums=(1, 2))
        prefill = jit(self.programs.prefill, out_shardings=step_out["prefill"], static_argnames=("gather", "full"),
                      donate_argnums=(1, 2))
        for rows, chunk in self.config.buckets:
            inputs = self.placement.put(pack(self._inputs([], rows, chunk)))
            gather = rows != self.config.num_rows
            for full in self.config.samplers(chunk):
                if chunk > 1:
                    yield (rows, chunk, full), prefill.lower(self.params, self.cache, self.row_state, inputs,
                                                             gather=gather, full=full)
                else:
                    carry = (self._no_round[rows],) if self.speculative else ()
                    yield (rows, chunk, full), decode.lower(self.params, self.cache, self.row_state, inputs,
                                                            self._step_index[0], *carry, gather=gather, full=full)
        if self.config.mixed_buckets:
            mixed = jit(self.programs.mixed, out_shardings=step_out["mixed"], static_argnames=("gather", "full"),
                        donate_argnums=(1, 2))
            for (rows, chunk_rows), inputs in self._mixed_inputs().items():
                for full in self.config.samplers(1):
                    yield ("mixed", rows, chunk_rows * self.config.max_chunk, full), mixed.lower(
                        self.params, self.cache, self.row_state, *inputs, gather=rows != self.config.num_rows,
                        full=full)
        if self.config.score_prompts:
            rows, chunk = self.config.prompt_logprobs_rows, self.config.max_chunk
            scoring = jit(self.programs.prefill, out_shardings=step_out["scoring"],
                          static_argnames=("gather", "full"), donate_argnums=(1, 2))
            yield "prompt_logprobs", scoring.lower(
                self.params, self.cache, self.row_state, self.placement.put(pack(self._inputs([], rows, chunk))),
                self.placement.put(np.full((rows, chunk), -1, np.int32)), gather=rows != self.config.num_rows,
                full=True)
        scalar = self.placement.put(np.int32(0))
        tokens = self.placement.put(np.zeros((self.config.max_model_len,), np.int32))
        yield "init_penalties", jit(init_penalties, donate_argnums=0).lower(
            self.row_state, scalar, tokens, scalar)
        if self.config.snapshots:
            save, restore = (functools.partial(f, self.text) for f in (cache_rows.save_snapshots,
                                                                      cache_rows.restore_snapshot))
            yield "save", jit(save, out_shardings=self.snapshot_shardings, donate_argnums=1).lower(
                self.cache, self.snapshots, self.placement.put(np.zeros((2, self.snapshot_batch), np.int32)))
            yield "restore", jit(restore, out_shardings=self.cache_shardings, donate_argnums=0).lower(
                self.cache, self.snapshots, scalar, scalar)

    def page_bytes_per_device(self) -> int:
        """Bytes of one KV page on each device (its share of the KV heads)."""
        return memory_plan.page_bytes(self.model.config.text, self.config, self.model.dtype,
                                      self.placement.kv_shards(self.text), self.drafter)

    def _resize_pool(self, pages: int) -> None:
        if pages < self.config.pages_per_row:
            raise ValueError(f"after the step programs' buffers, {pages} pages fit: not one sequence of "
                             f"{self.config.max_model_len} tokens (lower --max-model-len or the step buckets)")
        self.num_pages = pages
        self.row_state = None  # freed, with the cache, before the smaller pool is made
        self.reset()

    def _mixed_inputs(self) -> dict[tuple[int, int], tuple]:
        """(decode rows, prompt-chunk rows) -> device inputs of a mixed step of that shape that holds nothing, per
        mixed program."""
        chunks = {rows: self.placement.put(pack(self._inputs([], rows, self.config.max_chunk)))
                  for rows in self.config.mixed_prefills}
        return {(rows, chunk_rows): (self.placement.put(pack(self._inputs([], rows, 1))), chunk)
                for rows in self.config.mixed_buckets for chunk_rows, chunk in chunks.items()}

    def _run_once(self) -> None:
        """Runs every step program once on rows that hold nothing (they change no state), so that the first run
        of a program on a GPU (loading its kernels) does not land in a request's time to first token."""
        for (rows, chunk, _), program in self._steps.items():
            inputs = self.placement.put(pack(self._inputs([], rows, chunk)))
            if chunk > 1:
                self.cache, self.row_state, *_ = program(self.params, self.cache, self.row_state, inputs)
            else:
                self.run_decode(program, rows, inputs, 1)
        mixed_inputs = self._mixed_inputs() if self._mixed else {}
        for (rows, chunk_rows, _), program in self._mixed.items():
            self.cache, self.row_state, *_ = program(self.params, self.cache, self.row_state,
                                                     *mixed_inputs[rows, chunk_rows])
        if self._scoring is not None:
            rows, chunk = self.config.prompt_logprobs_rows, self.config.max_chunk
            self.cache, self.row_state, *_ = self._scoring(self.params, self.cache, self.row_state,
                                                           *self.placement.put((pack(self._inputs([], rows, chunk)),
                                                                                np.full((rows, chunk), -1, np.int32))))
        jax.block_until_ready(self.cache)


def _timed_compile(lowered, options):
    """(the compiled program, seconds its compilation took)."""
    start = time.perf_counter()
    return lowered.compile(options), time.perf_counter() - start
