"""Prometheus metrics of one engine (its own registry, so several servers can live in one process)."""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256)
# LoRA adapters (which a server may load without end) that get series of their own, the first seen; the rest
# share the label OTHER_ADAPTERS, so the metrics stay bounded
ADAPTER_LABELS = 64
OTHER_ADAPTERS = "_other"


class Metrics:
    def __init__(self, adapter_labels: int = ADAPTER_LABELS):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("inkling_time_to_first_token_seconds", "Arrival to first output token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("inkling_inter_token_latency_seconds", "Time between output tokens of a sequence",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("inkling_request_latency_seconds", "Arrival to last output token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.queued = Gauge("inkling_queued_sequences", "Sequences waiting for a slot", registry=r)
        self.running = Gauge("inkling_running_sequences", "Sequences holding a slot", registry=r)
        self.cache_usage = Gauge("inkling_kv_cache_usage_ratio", "Fraction of KV pages held by sequences",
                                 registry=r)
        self.prefix_queried = Counter("inkling_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                                      "prefix cache", registry=r)
        self.prefix_hits = Counter("inkling_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.prefix_hit_rate = Gauge("inkling_prefix_cache_hit_rate", "Hit tokens / queried tokens so far",
                                     registry=r)
        self.prompt_tokens = Counter("inkling_prompt_tokens", "Prompt tokens computed or reused", registry=r)
        self.generation_tokens = Counter("inkling_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("inkling_preemptions", "Sequences preempted for recompute", registry=r)
        self.requests = Counter("inkling_requests", "Finished sequences by reason", ["finish_reason"], registry=r)
        self.compilations = Counter("inkling_compilations_after_warmup", "Programs the engine thread built while "
                                    "serving (compiled or loaded from the compilation cache): 0 unless a step fell "
                                    "outside the shapes compiled at warm-up", registry=r)
        self.mixed_steps = Counter("inkling_mixed_steps", "Steps whose decodes and prompt chunks ran as one program "
                                   "(EngineConfig.mixed_steps)", registry=r)
        self.device_wait = DeviceWait(Histogram(
            "inkling_device_wait_seconds", "Host time from reading a step's results to queueing the next step, while "
            "the device had nothing queued and sequences ran (applying samples, scheduling, building inputs); a "
            "step queued before the one in flight was read waits for none", registry=r, buckets=WAIT_BUCKETS))
        self.rejected = Counter("inkling_rejected_requests", "Requests refused with 429 (queue full)", registry=r)
        spec = lambda kind, name, text, *labels: kind(f"inkling_spec_{name}", f"Speculative decoding: {text}",  # noqa: E731
                                                      list(labels), registry=r)
        self.draft_tokens = spec(Counter, "draft_tokens", "drafted tokens verified")
        self.accepted_tokens = spec(Counter, "accepted_tokens", "drafted tokens accepted")
        self.rounds = spec(Counter, "rounds", "rounds (one per row and verify)")
        self.position_drafts = spec(Counter, "position_draft_tokens", "rounds that verified a draft at this position "
                                    "(1 = the first draft)", "position")
        self.position_accepted = spec(Counter, "position_accepted_tokens", "rounds that accepted the draft at this "
                                      "position", "position")
        self.acceptance_length = spec(Gauge, "mean_acceptance_length", "tokens emitted per round (accepted drafts "
                                      "+ 1), mean so far")
        self.position_rate = spec(Gauge, "position_acceptance_rate", "accepted / verified drafts at this position "
                                  "so far", "position")
        self.lora_loads = Counter("inkling_lora_loads", "LoRA adapters put in a device slot", ["adapter"], registry=r)
        self.lora_evictions = Counter("inkling_lora_evictions", "LoRA adapters taken out of their device slot to "
                                      "make room for another", ["adapter"], registry=r)
        self.lora_load_seconds = Histogram("inkling_lora_load_seconds", "Host time to write a LoRA adapter into its "
                                           "device slot (queued copies, not waited for)", registry=r,
                                           buckets=LATENCY_BUCKETS)
        adapters = lambda name, text: Counter(f"inkling_lora_{name}", text, ["adapter"], registry=r)  # noqa: E731
        self.lora_requests = adapters("requests", "Finished requests per LoRA adapter")
        self.lora_generation_tokens = adapters("generation_tokens", "Tokens generated per LoRA adapter")
        self._adapter_labels, self._labelled = adapter_labels, set()
        self._queried = self._hits = 0
        self._built = 0  # programs built on the engine thread, as last counted
        self._mixed = 0  # mixed steps run, as last counted
        self._rounds = self._emitted = 0
        self._verified, self._accepted = collections.Counter(), collections.Counter()  # position -> rounds

    def record_admission(self, prompt_len: int, hit: int) -> None:
        self.prefix_queried.inc(prompt_len)
        self.prefix_hits.inc(hit)
        self._queried += prompt_len
        self._hits += hit
        self.prefix_hit_rate.set(self._hits / self._queried)

    def record_token(self, now: float, arrival: float, last: float | None, adapter: str | None = None) -> None:
        """An output token handed out at `now`; `last`: when its sequence's previous one was (None: the first);
        `adapter`: the LoRA adapter it was generated with (None: the base)."""
        self.generation_tokens.inc()
        if adapter is not None:
            self.lora_generation_tokens.labels(self._adapter(adapter)).inc()
        if last is None:
            self.ttft.observe(now - arrival)
        else:
            self.itl.observe(now - last)

    def record_state(self, queued: int, running: int, cache_usage: float, built: int, mixed: int = 0) -> None:
        """The gauges, `built`: the programs the engine thread has built so far (compilation_count), and `mixed`:
        the mixed steps it has run so far."""
        self.queued.set(queued)
        self.running.set(running)
        self.cache_usage.set(cache_usage)
        self.compilations.inc(built - self._built)
        self.mixed_steps.inc(mixed - self._mixed)
        self._built, self._mixed = built, mixed

    def count_builds_from(self, built: int) -> None:
        """The engine thread's compilation_count when it starts: what it builds from then on counts."""
        self._built = built

    def record_round(self, verified: int, accepted: int) -> None:
        """One row's speculative round: `verified` drafts checked, the first `accepted` of them kept."""
        self.rounds.inc()
        self.draft_tokens.inc(verified)
        self.accepted_tokens.inc(accepted)
        self._rounds += 1
        self._emitted += accepted + 1
        self.acceptance_length.set(self._emitted / self._rounds)
        for position in range(1, verified + 1):
            label = str(position)
            self.position_drafts.labels(label).inc()
            self._verified[position] += 1
            if position <= accepted:
                self.position_accepted.labels(label).inc()
                self._accepted[position] += 1
            self.position_rate.labels(label).set(self._accepted[position] / self._verified[position])

    def record_request(self, seconds: float, adapter: str | None) -> None:
        """A request that ended `seconds` after its arrival, run with `adapter` (None: the base)."""
        self.e2e.observe(seconds)
        if adapter is not None:
            self.lora_requests.labels(self._adapter(adapter)).inc()

    def record_lora_load(self, adapter: str, seconds: float, evicted: str | None) -> None:
        """`adapter` put in a slot in `seconds`, taking it from `evicted` (None: a free slot)."""
        self.lora_loads.labels(self._adapter(adapter)).inc()
        self.lora_load_seconds.observe(seconds)
        if evicted is not None:
            self.lora_evictions.labels(self._adapter(evicted)).inc()

    def _adapter(self, name: str) -> str:
        """The label of adapter `name`: its name while fewer than `adapter_labels` have one, else OTHER_ADAPTERS."""
        if name not in self._labelled and len(self._labelled) < self._adapter_labels:
            self._labelled.add(name)
        return name if name in self._labelled else OTHER_ADAPTERS

    def render(self) -> bytes:
        return generate_latest(self.registry)


class DeviceWait:
    """The device's waits for the host between steps, into its histogram: from `read(at)` (a step's results read
    at `at` with nothing queued after them; None: something is queued, or nothing runs) to `queued`."""

    def __init__(self, histogram: Histogram):
        self.histogram, self._since = histogram, None

    def read(self, at: float | None) -> None:
        self._since = at

    def queued(self) -> None:
        if self._since is not None:
            self.histogram.observe(time.monotonic() - self._since)
            self._since = None
