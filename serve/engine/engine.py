"""The engine: a background thread that admits requests, runs scheduled steps, turns sampled tokens into text
and hands each request's outputs to its listener.

Other threads only `submit`, `abort`, `drain` and `shutdown`; everything else (scheduler, pages, device state)
belongs to the engine thread, so it needs no locks. A request is one or more sequences (n choices per prompt).

Host work overlaps device work: a step's samples are applied to their sequences first (tokens appended; EOS, stop
ids and length limits end them and free their slots), as the next schedule needs; the text work (detokenizing,
stop strings, handing outputs to listeners) runs once the next step is dispatched, while the device computes it,
and a stop string found then drops what that step brings back for its sequence. The device waits for no host work
between steps where the next can be queued before the one in flight is read (`serve.engine.steps_ahead`: every
step but those with prompt logprobs or speculative rounds); `Metrics.device_wait` times the waits between the
others. A request arriving meanwhile joins the next step queued, and no decode run is made multi-step while a
request waits for admission.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Callable

from inkling_jax.nn.model import InklingModel
from serve.engine.block_manager import BlockManager
from serve.engine.config import EngineConfig
from serve.engine.metrics import Metrics
from serve.engine.outputs import Output, Sample
from serve.engine.idle_mailbox import IdleMailbox
from serve.engine.request import EngineStopped, OutputParser, QueueFull, Request
from serve.engine.sampling_params import SamplingParams
from serve.engine.scheduler import Chunk, Scheduler
from serve.engine.sequence import Sequence
from serve.engine.steps_ahead import StepsAhead
from serve.runner.compilation import compilation_count
from serve.runner.drafters import OracleDrafter
from serve.runner.model_runner import ModelRunner
from serve.runner.placement import Placement

log = logging.getLogger(__name__)


class Engine(StepsAhead):
    def __init__(self, model: InklingModel, config: EngineConfig, *, eos_token_id: int,
                 metrics: Metrics | None = None, placement: Placement | None = None,
                 oracle: OracleDrafter | None = None, draft_model: InklingModel | None = None):
        """oracle, draft_model: the drafters of speculative methods "oracle" (`serve.runner.drafters`; tests,
        benchmarks) and "draft"."""
        self.config = config
        self.eos_token_id = eos_token_id
        self.metrics = metrics or Metrics()
        self.runner = ModelRunner(model, config, placement, oracle, on_round=self.metrics.record_round,
                                  draft_model=draft_model, on_lora_load=self.metrics.record_lora_load)
        self._new_state()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._requests: dict[str, Request] = {}
        self._owner: dict[int, Request] = {}  # seq_id -> its request
        self._unreported: list[tuple[Sequence, Sample]] = []  # applied tokens whose text is not yet out
        self._read_at = 0.0  # when the host read the unreported tokens
        self._inflight = None  # (chunks, dispatched, applied ahead): a step queued before the last one was read
        self._queued = 0  # sequences not yet in a slot, as last seen by the engine thread
        self.max_queued = config.max_queued  # adjustable while serving
        self.decode_steps = config.decode_steps  # adjustable while serving, up to the compiled decode_steps
        self._accepting = True
        self._refusal = "the server is shutting down"  # what a request hears once no more are taken
        self._cancel_all = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle_work = IdleMailbox()  # done once idle

    def _new_state(self) -> None:
        self.blocks = BlockManager(self.runner.num_pages, self.config.page_size, self.config.snapshots)
        self.scheduler = Scheduler(self.config, self.blocks, self.runner.lora)

    # ------------------------------------------------------------------------------------------------------
    # Called from other threads

    def start(self) -> None:
        """Compile every step (see `warm_up_seconds`), then start the engine thread. The objects alive by then
        (the model, its programs, jax's caches: hundreds of thousands) are frozen out of Python's garbage collector
        (`gc.freeze`): a full collection walks every tracked object, a pause of the engine thread wherever one
        falls. `shutdown` unfreezes them."""
        self.warm_up_seconds = self.runner.warm_up()
        compilation_count()  # listening from now on, before the engine thread runs anything
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._loop, name="inkling-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams, n: int,
               make_parser: Callable[[], OutputParser], sink: Callable[[Output], None], media=None,
               adapter: str | None = None) -> Request:
        """Queue n choices for each prompt; choice i * n + j is prompt i's j-th. `media`: a `serve.http.media.Media`
        of the (single) prompt's placeholders; `adapter`: the LoRA adapter they run with (None: the base). Raises
        QueueFull, EngineStopped, `serve.lora.slots.UnknownAdapter` or InvalidParams (`EngineConfig.check_request`)."""
        self.config.check_request(params)
        request = Request.of_prompts(request_id, prompts, params, n, make_parser, sink, media,
                                     self.runner.lora_adapter(adapter))
        with self._lock:
            if not self._accepting:
                raise EngineStopped(self._refusal)
            queued = self._queued + sum(len(r.seqs) for r in self._inbox)
            if queued + len(request.seqs) > self.max_queued:
                self.metrics.rejected.inc()
                raise QueueFull(f"{queued} sequences are already waiting (limit {self.max_queued})")
            self._inbox.append(request)
        self._wake.set()
        return request

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    @property
    def alive(self) -> bool:
        """Taking requests, with a running engine thread."""
        return self._accepting and self._thread is not None and self._thread.is_alive()

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._requests) + len(self._inbox)

    def drain(self, seconds: float) -> None:
        """Stop taking requests, let in-flight ones finish for up to `seconds`, then end the rest ("abort"
        outputs); the engine thread keeps running until `shutdown`."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + seconds
        while self.num_requests and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            self._cancel_all = True
        self._wake.set()

    def update_params(self, leaves: list, timeout: float = 600.0) -> None:
        """New arrays for the serving view's parameters (`runner.params`: the same shapes, dtypes and shardings, so
        nothing recompiles), swapped in by the engine thread once no sequence runs (RL weight sync,
        `train.rl.rollout`). The prefix cache starts empty: its pages hold the old weights' keys and values."""
        self.runner.check_params(leaves)
        self._idle_work.send(lambda: self.runner.swap_params(leaves), "swap in the new parameters", self._wake.set,
                             timeout)

    def free_cache(self, timeout: float = 600.0) -> None:
        """Free the device state (KV pool, snapshots, sampler state) once no sequence runs, so that another
        program has the memory (RL's trainer step); the next step allocates it afresh, with an empty prefix cache."""
        self._idle_work.send(self.runner.free_cache, "free its cache", self._wake.set, timeout)

    def shutdown(self, drain_seconds: float = 10.0) -> None:
        """`drain`, then stop the engine thread."""
        self.drain(drain_seconds)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        gc.unfreeze()

    # ------------------------------------------------------------------------------------------------------
    # The engine thread

    def _loop(self) -> None:
        self.metrics.count_builds_from(compilation_count(threading.get_ident()))
        while True:
            self._take_mail()
            if self._stop.is_set():
                return
            if self.scheduler.idle:
                self._inflight = None  # every sequence of a run still in flight has ended
                self.metrics.device_wait.read(None)
                if self._idle_work.deliver():  # new parameters or a freed cache: the prefix cache is stale
                    self._new_state()
                self._report()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # a failed step must not take the server down: fail its requests, start clean
                log.exception("engine step failed; failing every request in flight")
                self._fail_requests()
                try:
                    self.runner.reset()
                except Exception:  # no clean start (say the failed step's memory did not come back): stop
                    log.exception("the engine could not start clean after a failed step; it takes no more requests")
                    with self._lock:
                        self._accepting = False
                        self._refusal = "the engine stopped after a failed step (the server log says why)"
                    self._take_mail()  # requests that came meanwhile fail too
                    self._fail_requests()
                    return
                self._new_state()
            self._update_gauges()

    def _fail_requests(self) -> None:
        self._unreported, self._inflight = [], None
        for request_id in list(self._requests):
            self._end_request(request_id, "error")

    def _take_mail(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            cancel_all = self._cancel_all
        for request in inbox:
            self._requests[request.request_id] = request
            for seq in request.seqs:
                self._owner[seq.seq_id] = request
                self.metrics.prompt_tokens.inc(seq.num_prompt)
                if seq.params.max_tokens == 0 and seq.params.prompt_logprobs is None:  # nothing to compute
                    self._finish(seq, "length", [])
                else:
                    self.scheduler.add(seq)
        for request_id in list(self._requests) if cancel_all else aborts:
            self._end_request(request_id, "abort")
        self._update_gauges()  # aborts free their slots and pages now, not at the next step

    def step(self) -> None:
        if self._inflight is not None:  # queued by the last step: read it now
            (chunks, dispatched, applied_ahead), self._inflight = self._inflight, None
        else:
            chunks = self._next_step()
            if not chunks:
                self._report()
                return
            # The previous step's text is reported while the device runs this one.
            dispatched = self.runner.dispatch(chunks, on_queued=self._step_queued)
            applied_ahead = self._apply_ahead(chunks)
        self._queue_next(chunks, dispatched, applied_ahead)
        self._report()  # (a no-op where a dispatch above has reported)
        samples = self.runner.collect(dispatched)
        self._read_at = time.monotonic()
        self.metrics.device_wait.read(self._read_at if self._inflight is None else None)
        self._unreported = self._fill(chunks, samples) if applied_ahead else self._apply(
            chunks, samples, self.runner.collect_prompt_logprobs(dispatched))

    def _next_step(self, ahead: bool = False) -> list[Chunk]:
        """The scheduled chunks of the next step (`Scheduler.schedule`), each with its decode steps."""
        preempted = self.scheduler.num_preemptions
        chunks = self.scheduler.schedule(ahead)
        for seq in self.scheduler.take_unservable():  # its adapter's files are gone or changed
            self._finish(seq, "error", [])
        self.metrics.preemptions.inc(self.scheduler.num_preemptions - preempted)
        for chunk in chunks:
            if chunk.admitted:
                self.metrics.record_admission(len(chunk.seq), chunk.seq.prefix_hit)
        for chunk, steps in zip(chunks, self._decode_plan(chunks, [0] * len(chunks)) or ()):
            chunk.steps = steps
        return chunks

    def _step_queued(self) -> None:
        """The device has a step again: the previous step's text goes out while it computes."""
        self.metrics.device_wait.queued()
        self._report()

    def _apply(self, chunks: list[Chunk], samples: dict[int, list[Sample]],
               prompt_logprobs: dict[int, list[Sample]]) -> list[tuple[Sequence, Sample]]:
        """Put a step's samples and prompt logprobs into their sequences; end those at EOS, a stop id or a length
        limit (`finish_reason`) and those done with a prompt they only score (max_tokens 0); save the step's prefix
        snapshots. Returns the applied samples with their sequences, for `_report`."""
        applied, saves = [], []
        for chunk in chunks:
            seq = chunk.seq
            if seq.finished:  # a stop string ended it after this step was dispatched
                continue
            if chunk.scores:
                if seq.num_cached == 0:  # (re)computed from the start, after a preemption say
                    seq.prompt_logprobs = []
                seq.prompt_logprobs += prompt_logprobs[seq.seq_id]
            self._advance(seq, chunk.num_tokens, saves)
            if seq.params.max_tokens == 0 and seq.seq_id in samples:  # the prompt is done; its next token unwanted
                self._finish(seq, "length", [])
                continue
            for k, sample in enumerate(samples.get(seq.seq_id, ())):
                if k:
                    self._advance(seq, 1, saves)  # the token fed back on device is in the cache
                seq.append(sample.token_id)
                sample.finish_reason = seq.end_reason(sample.token_id, self.eos_token_id, self.config.max_model_len)
                applied.append((seq, sample))
                if sample.finish_reason:  # the device's later tokens of this row are discarded
                    self._release(seq)
                    break
        if saves:
            self.runner.save_snapshots(saves)
        return applied

    def _report(self) -> None:
        """Text and outputs of the applied tokens not yet reported."""
        applied, self._unreported = self._unreported, []
        for seq, sample in applied:
            if seq.seq_id in self._owner:  # not ended by an earlier stop string or an abort
                self._on_token(seq, sample, self._read_at)

    def _advance(self, seq: Sequence, num_tokens: int, saves: list[tuple[int, int]]) -> None:
        """`num_tokens` more tokens are cached: publish full pages; a prefill chunk's end wanting a snapshot joins
        `saves` as (slot, snapshot id)."""
        seq.num_cached += num_tokens
        if self.config.prefix_caching:
            self.blocks.register(seq)
            snapshot = self.blocks.snapshot_slot(seq) if num_tokens > 1 else None
            if snapshot is not None:
                saves.append((seq.slot, snapshot))

    def _on_token(self, seq: Sequence, sample: Sample, now: float) -> None:
        request = self._owner[seq.seq_id]
        self.metrics.record_token(now, request.arrival, request.last_token.get(seq.seq_id), seq.adapter_name)
        request.last_token[seq.seq_id] = now
        deltas, reason = request.parse(seq, sample)
        if reason is not None:
            self._finish(seq, reason, deltas)
        else:  # every token, with text or not yet (a held-back stop string, part of a character): clients time it
            self._emit(request, Output(seq.index, deltas, None, seq.num_output))

    def _finish(self, seq: Sequence, reason: str, deltas: list) -> None:
        request = self._owner.pop(seq.seq_id)
        self._release(seq)
        self.metrics.requests.labels(reason).inc()
        request.remaining -= 1
        if request.remaining == 0:
            self._requests.pop(request.request_id, None)
            self.metrics.record_request(time.monotonic() - request.arrival, seq.adapter_name)
        scored = seq.params.prompt_logprobs is not None and not seq.scores_prompt
        self._emit(request, Output(seq.index, deltas, reason, seq.num_output, seq.prompt_logprobs if scored else None,
                                   seq.routed_experts))

    def _release(self, seq: Sequence) -> None:
        """Take a sequence out of the scheduler (its slot and pages back), its recorded routing read first."""
        if seq.block_ids:
            seq.routed_experts = self.runner.routed_experts(seq)
        self.scheduler.finish(seq)

    def _end_request(self, request_id: str, reason: str) -> None:
        request = self._requests.get(request_id)
        for seq in request.seqs if request else []:
            if seq.seq_id in self._owner:
                self._finish(seq, reason, [])

    def _emit(self, request: Request, output: Output) -> None:
        try:
            request.sink(output)
        except Exception:  # the listener is gone (its event loop closed): nobody wants the rest
            log.warning("request %s lost its listener; aborting it", request.request_id)
            with self._lock:
                self._aborts.append(request.request_id)

    def _update_gauges(self) -> None:
        self.metrics.record_state(len(self.scheduler.waiting), len(self.scheduler.running),
                                  1.0 - self.blocks.num_free / self.blocks.num_blocks,
                                  compilation_count(threading.get_ident()), self.runner.mixed_runs)
        with self._lock:
            self._queued = len(self.scheduler.waiting)
