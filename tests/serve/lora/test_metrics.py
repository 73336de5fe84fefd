"""Per-adapter metrics keep a bounded set of labels: the first adapters seen get their own series, the rest share
one, and every count lands in some series."""

from serve.engine.metrics import OTHER_ADAPTERS, Metrics


def test_adapter_labels_are_bounded():
    metrics = Metrics(adapter_labels=2)
    for name in ("a", "b", "c", "d", "a"):
        metrics.record_request(0.1, name)
        metrics.record_token(1.0, 0.0, None, name)
    metrics.record_request(0.1, None)  # the base: no adapter series
    metrics.record_lora_load("c", 0.01, evicted="a")
    sample = metrics.registry.get_sample_value
    requests = {label: sample("inkling_lora_requests_total", {"adapter": label}) for label in ("a", "b", OTHER_ADAPTERS)}
    assert requests == {"a": 2, "b": 1, OTHER_ADAPTERS: 2}
    assert sample("inkling_lora_generation_tokens_total", {"adapter": OTHER_ADAPTERS}) == 2
    assert sample("inkling_lora_requests_total", {"adapter": "c"}) is None
    assert sample("inkling_lora_loads_total", {"adapter": OTHER_ADAPTERS}) == 1
    assert sample("inkling_lora_evictions_total", {"adapter": "a"}) == 1
    assert sample("inkling_request_latency_seconds_count") == 6
    assert b'inkling_lora_requests_total{adapter="a"} 2.0' in metrics.render()
