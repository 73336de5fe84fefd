"""Rollouts by the serving engine in the same process, and the weight sync that keeps it on the current policy.

The engine runs its own serving view of the model (`Placement.model_view`: fused projections), built from the
trainer's parameters; the trainer's arrays and model objects are never changed by it. After each update
`sync` rebuilds the view's parameter arrays from the new state in one jitted program (the same shapes, dtypes and
shardings, so the engine's compiled steps are reused) and hands them to `Engine.update_params`: no disk, no
host copy. With LoRA only the adapters changed: the program merges them into the base weights it reads.

Each prompt's G completions are one engine request with its own seed (from the run's seed, the step and the
prompt's place), so a rerun samples the same tokens; the P requests reach the engine as one burst
(`serve.offline.generate_each`) and run concurrently under continuous batching.
Every sampled token's logprob is recorded, the EOS that ends a completion included; with routing replay the
engine also records each MoE layer's experts at every position (`EngineConfig.record_experts`). A prompt's images
go to the engine as the current vision tower's rows (`train.rl.media`).

On a mesh the engine runs on the trainer's devices (`train.rl.colocation`): the view's program puts its arrays
on the engine's shardings, and across processes each process's engine takes its own shards of them and rolls out
its share of the prompts, the completions then gathered in every process. With `free_cache` the engine's cache is
freed after each step's rollouts (while the trainer runs) and allocated again by the next.

Engines live in an `EnginePool`: the command makes one per run and closes it at the end; a caller running several
runs in a process (tests, a notebook) passes its own, to reuse a compiled engine, and closes it when done.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from inkling_jax.generate import flat_params
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.outputs import Sample
from serve.engine.sampling_params import SamplingParams
from serve.offline import Generated, TokenRecorder, generate_each
from serve.runner.placement import Placement
from train.distributed import gather_objects, host_copy
from train.rl.colocation import global_sharding, local_arrays, local_mesh
from train.rl.media import engine_media, tower_outputs
from train.state import Flat, TrainState
from train.step import Trainer

PAGE_SIZE = 16
CHUNKS = (16, 64, 256)  # prefill chunk sizes the rollout engine may compile
MAX_CONCURRENCY = 64


class EnginePool:
    """Started rollout engines by their setup (model, dtype, kernels, `EngineConfig`). `close`, or the end of a
    `with` block, shuts them down (threads stopped, references dropped: their device memory goes back once no run
    holds them)."""

    def __init__(self):
        self._engines: dict = {}

    def engine(self, key, build: Callable[[], Engine]) -> Engine:
        """The started engine of setup `key`, built and started (compiled) on first use."""
        if key not in self._engines:
            engine = build()
            engine.start()
            self._engines[key] = engine
        return self._engines[key]

    def __iter__(self):
        return iter(list(self._engines.values()))

    def close(self) -> None:
        engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            engine.shutdown(drain_seconds=0)

    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RolloutRecorder(TokenRecorder):
    """Keeps the EOS (or stop id) that ends a completion, with its logprob: the policy chose it too."""

    def finish(self, stop: Sample | None = None) -> list:
        if stop is not None:
            self.result.token_ids.append(stop.token_id)
            self.result.logprobs.append(stop.logprob)
        return []


def engine_config(sequences: int, max_prompt: int, max_new_tokens: int, record_experts: bool = False,
                  batch_invariant: bool = False) -> EngineConfig:
    """Room for every sequence of a step at once (up to MAX_CONCURRENCY running, the rest queued), one row bucket
    (all rows: the sequences of a step start together), prefill chunks up to the longest prompt; `record_experts`:
    routing replay's record. A batch-invariant model's engine runs the trainer's own (unfused) projections. Its
    requests ask for the sampled tokens' logprobs alone: every step runs the sampler that computes them, with no
    top tokens (no top-k over the vocabulary per step), no filters (rollouts draw at a temperature only) and no
    prompt scoring."""
    seqs = min(sequences, MAX_CONCURRENCY)
    max_len = -(-(max_prompt + max_new_tokens + 1) // PAGE_SIZE) * PAGE_SIZE
    top = next((c for c in CHUNKS if c >= max_prompt), CHUNKS[-1])  # longer prompts prefill in several chunks
    chunks = (1,) + tuple(c for c in CHUNKS if c <= top)
    return EngineConfig(max_num_seqs=seqs, max_model_len=max_len, page_size=PAGE_SIZE, chunk_buckets=chunks,
                        row_buckets=(seqs + 1,), max_num_batched_tokens=(seqs + 1) * chunks[-1],
                        num_pages=seqs * (max_len // PAGE_SIZE) + 1, max_queued=max(sequences, 256),
                        record_experts=record_experts, fuse_projections=not batch_invariant,
                        full_sampler_only=True, sampling_filters=False, score_prompts=False, max_logprobs=0)


class Rollouts:
    def __init__(self, trainer: Trainer, state: TrainState, frozen: Flat, config: EngineConfig, pool: EnginePool,
                 mesh: Mesh | None = None, free_cache: bool = False):
        """`mesh`: the engine's mesh over the whole job (`colocation.engine_mesh`; None: one device), of which this
        process's engine runs on its own part; `free_cache`: free the engine's cache after each `generate` (the
        next allocates it again), leaving its memory to the trainer."""
        self.trainer, self.free_cache, self.local = trainer, free_cache, local_mesh(mesh)
        self.engine = pool.engine((trainer.config, trainer.cfg.compute_dtype, trainer.cfg.backend, config, self.local),
                                  lambda: Engine(trainer.parts.merge(self._initial_params(state, frozen)), config,
                                                 eos_token_id=trainer.config.eos_token_id,
                                                 placement=Placement(self.local)))
        placement = Placement(mesh)
        # The view comes out laid out as the engine's arrays are (on the whole job's engine mesh: each process's
        # shards on its own devices), so that the engine takes them as they are.
        self._view = jax.jit(lambda s, f: flat_params(placement.model_view(
            trainer.parts.merge(trainer.model_params(s, f)), config))[0],
            out_shardings=[global_sharding(x.sharding, mesh) for x in self.engine.runner.params])
        self._towers = jax.jit(lambda s, f, pixels: tower_outputs(trainer.parts.merge(trainer.model_params(s, f)),
                                                                   pixels), out_shardings=trainer.shardings.replicated)
        # The engine's weights always come from this program: an engine of an earlier run gets this run's, and a
        # new one replaces its eager view's (LoRA's merge may round differently there), so that a resumed run
        # samples exactly what an uninterrupted one did.
        self.sync(state, frozen)

    def sync(self, state: TrainState, frozen: Flat) -> float:
        """Give the engine the weights of `state`; returns the seconds it took (the view's arrays computed and
        swapped in)."""
        began = time.perf_counter()
        leaves = local_arrays(jax.block_until_ready(self._view(state, frozen)), self.local)
        self.engine.update_params(leaves)
        return time.perf_counter() - began

    def _initial_params(self, state: TrainState, frozen: Flat) -> Flat:
        """The trainer's complete parameters, where this process's engine can place them to start from: as they
        are in one process; across processes whole on every process's host."""
        params = self.trainer.model_params(state, frozen)
        return params if jax.process_count() == 1 else host_copy(params)

    def media(self, state: TrainState, frozen: Flat, pixels: np.ndarray, media_positions: np.ndarray) -> list:
        """Per prompt, its images as the engine takes them (`train.rl.media.engine_media`), from the vision tower
        of `state`."""
        return engine_media(np.asarray(self._towers(state, frozen, pixels)), pixels, media_positions)

    def generate(self, prompts: list[tuple[int, ...]], seeds: list[int], group: int, max_new_tokens: int,
                 temperature: float, media: list | None = None) -> list[list[Generated]]:
        """For each prompt (with its `media`, where given), `group` completions with their logprobs. Across
        processes each process's engine generates its share of the prompts (as many as the others; the same
        seeds, so the same tokens as one process would sample), and every process gets them all."""
        count, media = jax.process_count(), media or [None] * len(prompts)
        if len(prompts) % count:
            raise ValueError(f"{len(prompts)} prompts do not split evenly over {count} processes")
        share = slice(jax.process_index() * len(prompts) // count, (jax.process_index() + 1) * len(prompts) // count)
        requests = [([list(prompt)], SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                                    logprobs=0), images)
                    for prompt, seed, images in zip(prompts[share], seeds[share], media[share])]
        groups = generate_each(self.engine, requests, n=group, recorder=RolloutRecorder)
        if self.free_cache:
            self.engine.free_cache()
        return groups if count == 1 else [g for part in gather_objects(groups) for g in part]


