"""The load generator's parts that need no server: arrival times, random lengths, the metrics' arithmetic and
the flags it refuses (the load itself runs in tests/serve/http/test_load_generator.py)."""

import math

import numpy as np
import pytest

from benchmarks.load import cli, report
from benchmarks.load.arrivals import send_offsets
from benchmarks.load.client import Result
from benchmarks.load.datasets import random_lengths


def test_all_at_once_or_gamma_gaps_of_the_asked_rate_and_spread():
    assert not send_offsets(5, math.inf, 1.0, np.random.default_rng(0)).any()
    for burstiness in (0.25, 1.0, 4.0):
        offsets = send_offsets(20000, 50.0, burstiness, np.random.default_rng(1))
        gaps = np.diff(offsets)
        assert offsets[0] == 0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
        # a gamma of shape k has a coefficient of variation 1 / sqrt(k): 1 is Poisson's exponential gaps
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    same = [send_offsets(10, 5.0, 1.0, np.random.default_rng(7)) for _ in range(2)]
    assert (same[0] == same[1]).all()


def test_random_lengths_span_the_range_ratio():
    assert set(random_lengths(100, 0.0, 50, np.random.default_rng(0))) == {100}
    lengths = random_lengths(100, 0.5, 5000, np.random.default_rng(0))
    assert lengths.min() == 50 and lengths.max() == 150
    assert random_lengths(1, 0.9, 100, np.random.default_rng(0)).min() >= 1
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        random_lengths(10, 1.0, 1, np.random.default_rng(0))


def test_metrics_of_known_timings():
    ok = [Result(10, output_len=3, ttft=0.1, itl=[0.2, 0.3], latency=0.6),
          Result(20, output_len=1, ttft=0.4, latency=0.4)]
    found = report.metrics(ok + [Result(5, error="HTTP 500")], duration=2.0, percentiles=(50, 99))
    assert (found["completed"], found["failed"], found["total_input_tokens"], found["total_output_tokens"]) == (
        2, 1, 30, 4)
    assert found["request_throughput"] == 1.0 and found["total_token_throughput"] == 17.0
    assert found["mean_ttft_ms"] == pytest.approx(250) and found["std_ttft_ms"] == pytest.approx(150)
    assert found["mean_tpot_ms"] == pytest.approx(250)  # (0.6 - 0.1) / 2; one-token requests have no TPOT
    assert found["median_itl_ms"] == found["p50_itl_ms"] == pytest.approx(250)
    assert found["p99_e2el_ms"] == pytest.approx(598)
    assert "p99 ITL (ms)" in report.summary(found, (50, 99))


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "0"], "--num-prompts must be > 0"),
    (["--random-range-ratio", "1"], "--random-range-ratio must be in"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--burstiness", "inf"], "--burstiness a finite number"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--endpoint", "/v1/chat/completions"], "only /v1/completions takes"),
    (["--random-token-range", "5"], "two integers"),
    (["--metric-percentiles", "0,99"], "percentiles must be in"),
])
def test_bad_flags_stop_before_any_request(flags, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(flags)
    assert message in capsys.readouterr().err


def test_the_console_script_answers_help(capsys):
    with pytest.raises(SystemExit) as done:
        cli.parse_args(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: inkling-bench-serving")
