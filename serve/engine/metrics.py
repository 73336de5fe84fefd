"""Prometheus metrics of one engine (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)


class Metrics:
    def __init__(self):
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
        self.rejected = Counter("inkling_rejected_requests", "Requests refused with 429 (queue full)", registry=r)
        self._queried = self._hits = 0

    def record_admission(self, prompt_len: int, hit: int) -> None:
        self.prefix_queried.inc(prompt_len)
        self.prefix_hits.inc(hit)
        self._queried += prompt_len
        self._hits += hit
        self.prefix_hit_rate.set(self._hits / self._queried)

    def render(self) -> bytes:
        return generate_latest(self.registry)
