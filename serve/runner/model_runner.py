"""Runs scheduled chunks on the device: the cache, the compiled steps (`serve.runner.steps`, one per shape bucket),
the sampler state (penalty counts) and the snapshot pool.

Every bucket is compiled ahead of time by `warm_up` (serve/runner/warm_up.py), and a call outside the buckets is
an error, never a silent compilation. A decode group runs as max(`steps`) dispatches of its `decode` program back
to back, each feeding the next its samples on device (each chunk takes its own `steps` of them); a prefill group
as one `prefill` program, or where a chunk computes prompt logprobs, as the one prefill program that does (at
`EngineConfig.prompt_logprobs_rows` rows of the largest chunk). A step of one-token decodes and one prompt chunk
runs both groups in one mixed program instead (`serve.runner.mixed_steps`).
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.generate import flat_params
from inkling_jax.nn.model import InklingModel
from serve.engine import memory_plan
from serve.engine.config import EngineConfig
from serve.engine.outputs import Sample
from serve.engine.scheduler import Chunk
from serve.lora.adapters import Adapter
from serve.lora.slots import AdapterSlots, UnknownAdapter
from serve.lora.view import lora_view
from serve.runner import cache_rows
from serve.runner.drafters import OracleDrafter, read_rounds, round_inputs
from serve.runner.mixed_steps import MixedSteps
from serve.runner.placement import Placement
from serve.runner.prompt_logprobs import prompt_targets, read_prompt_logprobs
from serve.runner.routing_record import RoutingRecord
from serve.runner.sampler import read_samples, unpack_samples
from serve.runner.speculative import (SpeculativePrograms, cache_layout, check_speculative, drafter_layers,
                                     init_serving_cache, no_previous_round)
from serve.runner.steps import RowState, StepInputs, StepPrograms, pack, step_inputs
from serve.runner.warm_up import StepCompilation

log = logging.getLogger(__name__)

class ModelRunner(StepCompilation, MixedSteps):
    def __init__(self, model: InklingModel, config: EngineConfig, placement: Placement | None = None,
                 oracle: OracleDrafter | None = None, on_round: Callable[[int, int], None] = lambda *_: None,
                 draft_model: InklingModel | None = None,
                 on_lora_load: Callable[[str, float, str | None], None] = lambda *_: None):
        """oracle: the drafter of `SpeculativeConfig` method "oracle"; with "mtp", its proposals replace the head's
        drafts while the head's state is kept as usual (tests of that state under chosen acceptance).
        on_round(verified, accepted): called for every row of every speculative round collected. draft_model: the
        drafter of method "draft" (the runner builds its view as it does the model's). on_lora_load(adapter, seconds,
        evicted adapter or None): called for every LoRA adapter put in a device slot (`serve.lora.slots`)."""
        self.config = config
        self.placement = placement or Placement()
        self.placement.check(model.config.text, lora_experts=config.lora_experts)
        spec, draft_config = config.speculative, None if draft_model is None else draft_model.config
        check_speculative(model.config, spec, draft_config, oracle is not None)
        self.oracle, self.on_round = oracle, on_round
        if draft_model is not None:
            self.placement.check(draft_model.config.text, name="the draft model")
        self.drafter = drafter_layers(model.config, spec, draft_config)
        # The configs of the cache's layers (the model's, the drafter's), and one that says which are local.
        self.cache_texts = memory_plan.cache_layers(model.config.text, self.drafter)
        self.text = cache_layout(model.config.text, self.drafter)
        self.vocab = self.text.unpadded_vocab_size
        fused = config.fuse_projections and self.placement.fuses_projections
        if model.backend.batch_invariant and (fused or config.lora is not None or self.placement.mesh is not None):
            raise ValueError("a batch-invariant model (Backend.batch_invariant) is served on one device, with its own "
                             "projections (EngineConfig(fuse_projections=False)) and without LoRA adapters")
        log.info("projections: %s", "fused (attention q|k|v|r, MLP gate|up, shared experts as one MLP)" if fused
                 else "separate matmuls (fuse_projections off, or a tensor-parallel mesh)")
        self.model = self.placement.model_view(model, config)  # `model` stays as it is
        self.draft = None if draft_model is None else self.placement.model_view(draft_model, config)
        if config.lora is not None:  # LoRA adapters in device slots of the view (`serve.lora`), on its devices
            self.model = lora_view(self.model, config.lora.max_loras + 1, config.lora.max_rank, config.lora.experts,
                                   self.placement.mesh)
        self.lora = None if config.lora is None else AdapterSlots(self.model, config.lora, on_lora_load)
        self.params, self._merge = flat_params(self.model if self.draft is None else nnx.List([self.model, self.draft]))
        self.multimodal = model.vision is not None or model.audio is not None
        self.num_pages = config.num_pages or memory_plan.pages_for_memory(
            model.config.text, config, model.dtype, self.placement.kv_shards(self.text), self.placement.device_list,
            self.drafter)
        if self.num_pages < config.pages_per_row:
            raise ValueError(f"{self.num_pages} pages cannot hold one sequence of {config.max_model_len} tokens (what "
                             f"the {config.max_num_seqs} slots' own state, their snapshots and the step buffers leave "
                             "of the memory: lower --max-num-seqs, --num-snapshots or --max-model-len)")
        self.reset()
        shared = (self._merge, self.text, config.max_logprobs, config.sampling_filters, config.pages_per_row,
                  self._constrain_cache, self._whole)
        self.programs = StepPrograms(*shared, routing_page_size=config.page_size if config.record_experts else None) \
            if spec is None else SpeculativePrograms(*shared, config=model.config, speculative=spec)
        # The step indices of the decode runs and the carry of a run of speculative rounds that continues none, on
        # device once.
        self._step_index = [self.placement.put(np.int32(k)) for k in range(config.decode_steps + 1)]
        self._no_round = {} if spec is None else {
            rows: self.placement.put(no_previous_round(rows, spec.num_draft_tokens)) for rows in config.rows}
        self._steps: dict[tuple[int, int, bool], object] = {}  # (rows, tokens, full sampler) -> program
        self._mixed: dict[tuple[int, int, bool], object] = {}  # (decode rows, chunk rows, full sampler) -> program
        self._save = self._restore = self._init_penalties = self._scoring = None
        log.info("KV pool: %d pages of %d tokens (%.1f MiB); %d slots (+1 scratch) of ring and conv state "
                 "(%.1f MiB each); %d prefix snapshots; on %s", self.num_pages, config.page_size,
                 memory_plan.page_bytes(model.config.text, config, model.dtype, drafter=self.drafter)
                 * self.num_pages / 2**20,
                 config.max_num_seqs, cache_rows.bytes_per_row(self.text, self.cache) / 2**20, config.snapshots,
                 self.placement.devices)

    def reset(self) -> None:
        """Fresh device state (also after a failed step, whose donated buffers may be gone)."""
        cfg = self.config
        self.cache = self.snapshots = None  # the old ones go first

        def cache():
            return init_serving_cache(self.model.config.text, self.drafter, cfg.num_rows, cfg.max_model_len +
                                      cfg.lookahead, self.model.dtype, page_size=cfg.page_size,
                                      num_pages=self.num_pages, ring_slack=cfg.ring_slack)

        def snapshots():
            return cache_rows.empty_snapshots(self.text, shapes, cfg.snapshots)

        shapes = jax.eval_shape(cache)
        self.cache_shardings = self.placement.cache_shardings(self.cache_texts, shapes)
        self.snapshot_shardings = None if self.cache_shardings is None else cache_rows.row_state(
            self.text, self.cache_shardings)
        if memory_plan.grows_on_demand(self.placement.device_list):
            self.placement.reserve(memory_plan.bytes_per_device(shapes, self.cache_shardings)
                                   + memory_plan.bytes_per_device(jax.eval_shape(snapshots), self.snapshot_shardings))
        try:  # an allocation that fails shows once the arrays are waited for
            self.cache, self.snapshots = jax.block_until_ready((
                self.placement.create(cache, self.cache_shardings),
                self.placement.create(snapshots, self.snapshot_shardings)))
        except jax.errors.JaxRuntimeError as err:
            if not memory_plan.is_out_of_memory(str(err)):
                raise
            # No smaller pool is tried: the arrays of a failed allocation may stay allocated (seen on GPUs).
            gib = self.num_pages * self.page_bytes_per_device() / 2**30
            raise MemoryError(f"the KV pool of {self.num_pages} pages ({gib:.1f} GiB per device) could not be "
                              f"allocated: pass fewer with --num-pages, or a smaller --memory-fraction "
                              f"({str(err).splitlines()[0]})") from None
        self.row_state = self.placement.put(RowState(jnp.zeros((cfg.num_rows, self.vocab), jnp.int32),
                                                     jnp.zeros((cfg.num_rows, self.vocab), bool),
                                                     jnp.zeros((cfg.num_rows,), jnp.int32)))
        self.routing = RoutingRecord(self.num_pages, cfg.page_size, self.model.config.text) if cfg.record_experts \
            else None

    def free_cache(self) -> None:
        """Drop the device state (`reset` makes it): its memory goes back once nothing else holds it, and the next
        `dispatch` allocates it afresh."""
        self.cache = self.snapshots = self.row_state = self.routing = None

    def check_params(self, leaves: list) -> None:
        """Raises unless `leaves` can replace `params` without a recompilation: as many arrays, each of the same
        shape, dtype and sharding."""
        if len(leaves) != len(self.params):
            raise ValueError(f"{len(leaves)} parameter arrays for a view of {len(self.params)}")
        for i, (new, old) in enumerate(zip(leaves, self.params)):
            if (new.shape, new.dtype) != (old.shape, old.dtype) or not new.sharding.is_equivalent_to(
                    old.sharding, old.ndim):
                raise ValueError(f"parameter {i}: {new.shape} {new.dtype} on {new.sharding} does not replace "
                                 f"{old.shape} {old.dtype} on {old.sharding}")

    def swap_params(self, leaves: list) -> None:
        """Run with `leaves` (`check_params`) from the next step on; the view is rebuilt around them, so the old
        arrays are freed once nothing else holds them."""
        merged = self._merge(list(leaves))
        self.model, self.draft = (merged, None) if self.draft is None else tuple(merged)
        self.params = list(leaves)

    def _constrain_cache(self, cache):
        if self.cache_shardings is None:
            return cache
        return jax.lax.with_sharding_constraint(cache, self.cache_shardings)

    def _whole(self, logits):
        replicated = self.placement.replicated()
        return logits if replicated is None else jax.lax.with_sharding_constraint(logits, replicated)

    # ------------------------------------------------------------------------------------------------------
    # Execution

    def dispatch(self, chunks: list[Chunk], on_queued: Callable[[], None] = lambda: None, previous=None) -> list:
        """Start one scheduled step on the device and return at once (JAX dispatches asynchronously); `collect`
        waits for its samples. `on_queued` runs as soon as the step's first program is queued: host work put
        there overlaps the device without waiting for the rest of a decode run to be dispatched. `previous`: the
        `last_tokens` of a run of speculative rounds in flight that continuation chunks (`Chunk.ahead`) follow."""
        if self.cache is None:  # freed while idle (`free_cache`)
            self.reset()
        put = self.placement.put
        for chunk in chunks:
            seq = chunk.seq
            if chunk.restore is not None:
                self.cache = self._restore(self.cache, self.snapshots, put(np.int32(seq.slot)),
                                           put(np.int32(chunk.restore)))
            if chunk.admitted and seq.params.uses_penalties:
                tokens = np.full((self.config.max_model_len,), -1, np.int32)
                tokens[:len(seq)] = seq.token_ids
                self.row_state = self._init_penalties(self.row_state, *put((np.int32(seq.slot), tokens,
                                                                            np.int32(seq.num_prompt))))
        groups = self._groups(chunks)
        if self.runs_mixed(groups):
            return self.dispatch_mixed(*groups, on_queued)
        return [(group, *self._dispatch(group, on_queued if i == 0 else lambda: None, previous))
                for i, group in enumerate(groups)]

    @staticmethod
    def last_tokens(dispatched: list):
        """What a continuation of a dispatched run of speculative rounds starts from: the run's carry, and the
        sequences' output counts where that carry starts (None for plain decode steps)."""
        return dispatched[0][2]

    def collect(self, dispatched: list) -> dict[int, list[Sample]]:
        """Wait for a dispatched step; returns seq_id -> the chunk's `steps` Samples (with the request's
        `logprobs` most likely tokens) for every chunk that ends its running sequence's known tokens; a speculative
        round's, as many as the row emitted. Drafts go to their sequences (`Sequence.drafts`), and each round's
        acceptance to `Sequence.accepted` and `on_round`."""
        results = {}
        for group, outs, _, _, drafted in dispatched:
            packed = np.concatenate(jax.device_get(outs))
            if self.routing is not None:
                packed = self.routing.take(packed, 2 + 2 * self.config.max_logprobs)
            host = unpack_samples(packed)
            kept, drafts, verified = (None, None, None) if drafted is None else jax.device_get(drafted)
            for chunk, row in zip(group, self._row_index(group)):
                seq = chunk.seq
                if not chunk.samples or seq.finished:  # (an ended sequence has no row left)
                    continue
                if drafts is not None:
                    seq.drafts = drafts[row].tolist()
                if kept is None:  # the chunk's steps, in order
                    results[seq.seq_id] = read_samples(host, row, chunk.samples, seq.params.logprobs or 0)
                    continue
                index = read_rounds(seq, row, kept, verified, len(host.tokens) // len(kept), self.on_round)
                picked = jax.tree.map(lambda x: x[np.asarray(index, int)], host)
                results[seq.seq_id] = read_samples(picked, row, len(index), seq.params.logprobs or 0)
        return results

    def routed_experts(self, seq) -> np.ndarray | None:
        """Where routing is recorded, the experts chosen at the positions `seq` has computed in steps read, up to
        its last token read (`RoutingRecord.read`); read before its pages go back."""
        computed = min(seq.num_cached - seq.num_unread, len(seq) - seq.num_pending - 1)
        return None if self.routing is None else self.routing.read(seq.block_ids, computed)

    def collect_prompt_logprobs(self, dispatched: list) -> dict[int, list[Sample]]:
        """seq_id -> the Samples of the prompt tokens each scoring chunk of a dispatched step predicts (with the
        request's `prompt_logprobs` most likely tokens), in order."""
        results = {}
        for group, _, _, scored, _ in dispatched:
            if scored is not None:
                host = np.asarray(jax.device_get(scored))
                for chunk, row in zip(group, self._row_index(group)):
                    if chunk.scores and not chunk.seq.finished:
                        results[chunk.seq.seq_id] = read_prompt_logprobs(host, row, chunk.seq.params.prompt_logprobs)
        return results

    def save_snapshots(self, saves: list[tuple[int, int]]) -> None:
        """Save the state of each (slot, snapshot id) pair's slot as that snapshot: one program for as many chunks as
        a step of the largest chunks holds (`snapshot_batch`)."""
        for pairs in cache_rows.snapshot_batches(saves, self.snapshot_batch, self.config.snapshots):
            self.snapshots = self._save(self.cache, self.snapshots, self.placement.put(pairs))

    @property
    def snapshot_batch(self) -> int:
        return max(1, self.config.max_num_batched_tokens // self.config.max_chunk)

    @staticmethod
    def _groups(chunks: list[Chunk]) -> list[list[Chunk]]:
        """One step for the decodes (one token each), one for the prefill chunks."""
        decode = [c for c in chunks if not c.prefill]
        prefill = [c for c in chunks if c.prefill]
        return [group for group in (decode, prefill) if group]

    def _shape(self, group: list[Chunk]) -> tuple[int, int]:
        """(rows, tokens) of the program a group runs in."""
        if any(c.scores for c in group):
            return self.config.prompt_logprobs_rows, self.config.max_chunk
        return self.config.row_bucket(len(group)), self.config.chunk_bucket(max(c.num_tokens for c in group))

    def _row_index(self, group: list[Chunk]) -> list[int]:
        rows = self._shape(group)[0]
        return [c.seq.slot for c in group] if rows == self.config.num_rows else list(range(len(group)))

    def _dispatch(self, group: list[Chunk], on_queued: Callable[[], None], previous) -> tuple:
        """Dispatches a group's program(s), calling `on_queued` after the first; returns their samples (each
        [1, rows, 2 + 2K], `sampler.pack_samples`; a round's [K + 1, rows, ...]), a decode run's last tokens, the
        prompt logprobs of a scoring prefill (`prompt_logprobs.score_positions`; else None), and where the program
        drafts, (per round: tokens each row emitted (None: a prefill), the last drafts, per round: drafts each row
        verified) (else None)."""
        rows, chunk = self._shape(group)
        self._assign_adapters(group)
        start = None  # seq_id -> its output count where the carry of a run of rounds starts
        if self.speculative and chunk == 1:  # (a continued run's carry: where the run it continues started)
            start = {c.seq.seq_id: c.seq.num_output for c in group} if previous is None else previous[1]
        inputs = self.placement.put(pack(self._inputs(group, rows, chunk, start)))
        if any(c.scores for c in group):
            targets = self.placement.put(prompt_targets(group, self._row_index(group), rows, chunk))
            self.cache, self.row_state, out, scored, *drafts = self._scoring(self.params, self.cache, self.row_state,
                                                                             inputs, targets)
            on_queued()
            return [out], None, scored, (None, drafts[0], None) if drafts else None
        program = self._steps[rows, chunk, self._full(group, chunk)]
        if chunk > 1:
            self.cache, self.row_state, out, *drafts = program(self.params, self.cache, self.row_state, inputs)
            on_queued()
            return [out], None, None, (None, drafts[0], None) if drafts else None
        if self.speculative:  # a run of rounds; one continuing a run in flight starts at round 1 from its carry
            outs, carry = self.run_decode(program, rows, inputs, max(c.steps for c in group), on_queued,
                                          None if previous is None else previous[0], first=int(previous is not None))
            return [o[0] for o in outs], (carry, start), None, ([o[1] for o in outs], carry[1], [o[2] for o in outs])
        return *self.run_decode(program, rows, inputs, max(c.steps for c in group), on_queued), None, None

    def _assign_adapters(self, chunks: list[Chunk]) -> None:
        """Puts the chunks' LoRA adapters in device slots and gives their sequences the slots (`AdapterSlots.assign`);
        `params` then holds the slots' new factors."""
        if self.lora is not None and self.lora.assign(self.model, [c.seq for c in chunks]):
            self.params = flat_params(self.model)[0]

    def _full(self, chunks: list[Chunk], tokens: int) -> bool:
        """Whether a step of these chunks, `tokens` per row, samples with the full sampler (`EngineConfig.
        full_sampler`)."""
        return self.config.full_sampler(tokens, any(c.seq.params.needs_full_sampler for c in chunks))

    def run_decode(self, program, rows: int, inputs, num_steps: int, on_queued: Callable[[], None] = lambda: None,
                   previous=None, first: int = 0):
        """`num_steps` dispatches of a compiled decode program over the same (device) inputs, steps `first`,
        `first` + 1, .., each feeding the next its samples (`RowState.last_token`; speculative rounds: their carry,
        starting from `previous`); calls `on_queued` after the first. Returns the samples of every step and the
        last round's carry (None without speculative decoding)."""
        outs = []
        if self.speculative:
            previous = self._no_round[rows] if previous is None else previous
        for k in range(num_steps):
            args = (self.params, self.cache, self.row_state, inputs, self._step_index[first + k])
            if self.speculative:
                self.cache, self.row_state, out, previous = program(*args, previous)
            else:
                self.cache, self.row_state, out = program(*args)
            outs.append(out)
            if k == 0:
                on_queued()
        return outs, previous

    def _inputs(self, group: list[Chunk], rows: int, chunk: int, start: dict[int, int] | None = None) -> StepInputs:
        """A step's host inputs; a run of speculative rounds' (decode chunks) by `drafters.round_inputs`, `start`
        saying where its carry starts."""
        media = (self.text.hidden_size, self.model.dtype) if self.multimodal and chunk > 1 else None
        index = self._row_index(group) if group else []
        if not self.speculative or chunk > 1:
            return step_inputs(self.config, group, index, rows, chunk, media)
        return round_inputs(self.config, group, index, rows, self.oracle, start)

    def lora_adapter(self, name: str | None) -> Adapter | None:
        """The LoRA adapter served as `name` (None: the base); `UnknownAdapter` for any other."""
        if name is not None and self.lora is None:
            raise UnknownAdapter(name)
        return None if name is None else self.lora.get(name)

    @property
    def speculative(self) -> bool:
        return self.config.speculative is not None
