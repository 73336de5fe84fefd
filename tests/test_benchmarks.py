"""The benchmarks start as users start them (`python -m benchmarks.<name> --help`, run here as `python -m`
runs a module, in this process), and the timing module they share measures what it says on CPU: the calls it
times, the ceilings, the stamp, the guard that keeps a failed measurement from stopping a run."""

import json
import math
import runpy
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import invariant_matmul, kernel_lowering, moe_tiles, rl, timing, training
from benchmarks.profile import device_op_times, op_table
from benchmarks.speculative import plant_successor
from inkling_jax import preset
from serve.random_weights import random_model
from tests.greedy import greedy_tokens


# runpy warns when the module was imported before (timing is, by this file); it runs a fresh copy all the same.
@pytest.mark.filterwarnings("ignore:'benchmarks.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("name", ["model", "serving", "serving_sweep", "speculative", "training", "kernels", "moe",
                                  "conversion", "timing", "multi_lora", "rl", "moe_tiles", "moe_layouts",
                                  "invariant_matmul", "engine_host", "kernel_lowering"])
def test_every_benchmark_answers_help_as_python_m_runs_it(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"benchmarks.{name}", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks.{name}")


def test_median_seconds_times_warm_up_then_trials_of_back_to_back_calls():
    calls = []

    def fn(x):
        calls.append(x)
        return x + 1

    seconds = timing.median_seconds(fn, jnp.ones(4), trials=3, warmup=2, calls=4)
    assert len(calls) == 2 + 3 * 4
    assert 0 < seconds < 1


def test_chained_seconds_feeds_a_donated_state_back_and_warns_on_non_finite_values(capsys):
    state = {"x": jnp.ones(8), "n": jnp.zeros((), jnp.int32)}
    step = lambda carry, scale: {"x": carry["x"] * scale, "n": carry["n"] + 1}  # noqa: E731
    seconds = timing.chained_seconds(step, state, (jnp.float32(1.5),), reps=3, feed_back=True, calls=2, trials=2)
    assert 0 < seconds < 1
    assert "non-finite" not in capsys.readouterr().out
    # fed back through 1 + 2 x 2 calls of 3 steps each, 1.5**15 stays finite; 1e30 per step does not
    timing.chained_seconds(step, {"x": jnp.ones(8), "n": jnp.zeros((), jnp.int32)}, (jnp.float32(1e30),),
                           reps=3, feed_back=True, calls=2, trials=2)
    assert "non-finite" in capsys.readouterr().out


def test_ceilings_are_rates_measured_on_this_device():
    for rate in (timing.copy_bandwidth(1 << 12, data="ones", trials=2),
                 timing.read_bandwidth(1 << 12, data="normal", trials=2),
                 timing.matmul_flops(32, data="normal", trials=2)):
        assert math.isfinite(rate) and rate > 0
    assert float(timing.filled((4,), data="ones").sum()) == 4
    with pytest.raises(ValueError, match="data must be one of"):
        timing.filled((4,), data="zeros")


def test_the_stamp_names_date_device_and_versions():
    found = timing.stamp(torch=None, transformers="5.23.0")
    assert found["device"] and found["devices"] >= 1 and found["jax"] and found["flax"]
    assert "torch" not in found and found["transformers"] == "5.23.0"
    line = timing.stamp_line(found)
    assert line.startswith(f"{found['date']}, {found['devices']} x {found['device']}, jax {found['jax']}")
    assert timing.versions("jax", "no-such-package-here") == {"jax": found["jax"]}


def test_attempt_returns_the_result_or_records_the_failure_and_goes_on(capsys):
    errors = {}
    assert timing.attempt("works", lambda: 3, errors) == 3

    def fails():
        raise MemoryError("out of memory while trying to allocate 37.5GiB\nmore detail")

    assert timing.attempt("too big", fails, errors) is None
    assert errors == {"too big": "MemoryError: out of memory while trying to allocate 37.5GiB"}
    assert "too big FAILED MemoryError" in capsys.readouterr().out


def test_the_rl_benchmark_runs_every_mode_and_reports_each(tmp_path, capsys):
    """`python -m benchmarks.rl` at the tiny preset, one timed step per mode: rl.json holds every mode's steps and
    figures, and the table comes last. The fast modes only (CI time): the batch-invariant one is train.rl's
    `--batch-invariant`, whose exact zero tests/train/test_rl.py asserts."""
    modes = ("fast", "replay")
    rl.main(["--preset", "tiny", "--layers", "2", "--concurrency", "4", "--group-size", "2", "--prompt-tokens", "8",
             "--output-tokens", "4", "--steps", "1", "--backend", "reference,moe=dense", "--modes", ",".join(modes),
             "--out", str(tmp_path)])
    found = json.loads((tmp_path / "rl.json").read_text())
    assert list(found["modes"]) == list(modes)
    for mode, result in found["modes"].items():
        assert "error" not in result, result
        assert len(result["steps"]) == 2 and all(s["generated_tokens"] > 0 for s in result["steps"])
        for key in ("rollout_tokens_per_s", "serving_tokens_per_s", "train_tokens_per_s", "weight_sync_s"):
            assert math.isfinite(result[key]) and result[key] > 0, (mode, key)
    assert found["memory_plan"]["parameters"]["frozen"] > 0  # the embedding and the head, by default
    lines = capsys.readouterr().out.strip().splitlines()
    header, rows = lines[-2 - len(modes)], lines[-len(modes):]
    assert header.startswith("| mode |") and [row.split(" | ")[0] for row in rows] == [f"| {m}" for m in modes]


def test_the_invariant_matmul_benchmark_times_both_tiles_and_checks_the_bits_across_them(tmp_path, capsys):
    invariant_matmul.main(["--preset", "tiny", "--weights", "head,dense MLP down", "--rows", "5,70", "--trials", "1",
                           "--sweep", "0", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "invariant_matmul.json").read_text())
    # a sweep without budget times the current tiles alone, which are then its best
    assert [(r["best"], r["best_same_bits"]) for r in found["sweep"].values()] == \
        [(r["current"], True) for r in found["sweep"].values()]
    assert "compute_wgs=1" in found["sweep"]["5"]["current"] and "compute_wgs=2" in found["sweep"]["70"]["current"]
    assert not found["errors"] and set(found["results"]) == {"(64, 384, True)", "(128, 64, False)"}
    for result in found["results"].values():
        assert result["same_bits"] is True
        assert [(r["tiles"], r["unit"]) for r in result["rows"].values()] == \
            [("decode", "GB/s"), ("default", "TFLOP/s")]
        assert all(s > 0 for r in result["rows"].values() for s in r["seconds"].values())
    assert "| LM head | 64 -> 384 (as it lies) | 5 | decode |" in capsys.readouterr().out


def test_the_tile_sweep_times_the_current_tiles_even_without_budget_and_reports_them(tmp_path, capsys):
    """`python -m benchmarks.moe_tiles --dry-run` (portable kernels, tiny shapes) with no time left: each role
    times only its current tiles (the baseline), which are then its best, and says so in moe_tiles.json and the
    table."""
    moe_tiles.main(["--dry-run", "--roles", "gmm", "--seconds", "0", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "moe_tiles.json").read_text())["roles"]
    assert list(found) == ["gmm"]
    role = found["gmm"]
    assert role["errors"] == {} and list(role["candidates"]) == [role["default"]] == [role["best"]]
    assert role["default_ms"] == role["best_ms"] > 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| gmm | ") and " | 1.000 | " in row


def test_the_training_benchmark_keeps_the_dense_and_full_attention_layers_it_is_told():
    """bench's first two layers are dense, so by default `--layers 2` has no MoE layer; `--dense-layers 0` makes
    every kept layer an MoE one; the last `--full-attention-layers` of them leave the sliding window."""
    def kept(*argv):
        return training.bench_config(training.parse_args(list(argv))).text

    default = kept("--layers", "3")
    assert (default.num_layers, default.dense_layer_ids, default.local_layer_ids) == (3, (0, 1), (0, 1))
    moe_only = kept("--layers", "1", "--dense-layers", "0")
    assert (moe_only.num_layers, moe_only.dense_layer_ids, moe_only.local_layer_ids) == (1, (), ())
    sliding = kept("--layers", "2", "--dense-layers", "1", "--full-attention-layers", "0")
    assert (sliding.dense_layer_ids, sliding.local_layer_ids) == ((0,), (0, 1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_speculative_benchmarks_model_continues_each_token_with_the_next(dtype):
    config = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
    model = plant_successor(random_model(config, dtype=dtype))
    vocab = config.text.unpadded_vocab_size
    prompt = [5, vocab - 3, 77, vocab - 2]  # the rule wraps around the unpadded vocabulary
    assert greedy_tokens(model, prompt, 6) == [(vocab - 2 + i) % vocab for i in range(1, 7)]


def test_device_op_times_sum_a_traced_programs_operations():
    product = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((128, 128))
    times = device_op_times(lambda: product(x), calls=2)
    assert times and max(sum(ops.values()) for ops in times.values()) > 0
    assert "us per call" in op_table(times, top=3)


def test_the_serving_sweep_serves_loads_and_times_the_same_engine(tmp_path):
    """`benchmarks.serving_sweep` on the tiny preset: the server it hosts answers the load generator's subprocess
    at each level, nothing compiles after warm-up, and its engine's programs are timed after the load. Row buckets
    as a GPU's (not the CPU's one bucket) give it mixed programs of one and of two chunks, timed too."""
    from benchmarks import serving_sweep

    serving_sweep.main(["--preset", "tiny", "--levels", "1,2", "--input-len", "24", "--output-len", "4",
                        "--prompts-per-level", "1", "--port", "8377", "--out", str(tmp_path),
                        "--server-args", "--max-num-seqs 3 --row-buckets 1,2,4"])
    found = json.loads((tmp_path / "sweep.json").read_text())
    assert [int(level) for level in found["levels"]] == [1, 2]
    for level in found["levels"].values():
        assert level["failed"] == 0 and level["compilations_after_warmup"] == 0 and level["output_throughput"] > 0
        # (steps queued behind the one in flight leave few waits, if any: each one counted took time)
        assert level["device_waits"] >= 0 and (level["device_waits"] == 0) == (level["device_wait_s"] == 0)
    assert set(found["decode_ms_per_token"]) == {"1", "2"} and found["prefill_ms"] > 0
    assert found["largest_prefill_us_per_token"] > 0
    assert set(found["mixed_ms"]) == {"1", "2"} and found["widest_mixed"]["chunk_rows"] == 2
    assert set(found["widest_mixed"]["ms"]) == {"1", "2"} and found["widest_mixed"]["prefill_ms"] > 0


def test_the_engine_host_benchmark_times_each_level_and_the_program(tmp_path):
    """`benchmarks.engine_host` on the tiny preset: every level decodes its rows for the steps asked, with the
    engine thread's time in parts and the decode program timed at those rows."""
    from benchmarks import engine_host

    engine_host.main(["--preset", "tiny", "--rows", "1,3", "--steps", "3", "--prompt-len", "8",
                      "--out", str(tmp_path)])
    found = json.loads((tmp_path / "engine_host.json").read_text())
    assert [level["rows"] for level in found["levels"]] == [1, 3]
    for level in found["levels"]:
        host = level["host_ms_per_step"]
        assert level["steps"] == 3 and 2 <= level["step_calls"] <= 4  # calls and tokens line up to within one
        assert level["decode_program_ms"] > 0 and host["dispatch"] > 0 and host["collect"] > 0
        assert host["total"] <= level["wall_ms_per_step"] * 1.5  # one thread's CPU time within the wall time


def test_the_engine_host_clock_counts_a_nested_part_once():
    """dispatch calls report (as the engine's does while the device runs): report's time is its own, not also
    dispatch's, and the step's own is what is left."""
    import time as clock_time

    from benchmarks.engine_host import ThreadClock

    def spin(seconds):
        end = clock_time.thread_time() + seconds
        while clock_time.thread_time() < end:
            pass

    class Part:
        pass

    engine, runner = Part(), Part()
    engine.scheduler, engine.runner = Part(), runner
    engine.scheduler.schedule = lambda: spin(0.01)
    runner.dispatch = lambda: spin(0.02) or engine._report()
    runner.collect = engine._apply = engine._apply_ahead = engine._fill = engine._update_gauges = lambda: None
    engine._report = lambda: spin(0.03)
    engine.step = lambda: spin(0.01) or engine.scheduler.schedule() or engine.runner.dispatch()
    clock = ThreadClock(engine)
    engine.step()
    assert clock.seconds["_report"] == pytest.approx(0.03, abs=0.005)
    assert clock.seconds["dispatch"] == pytest.approx(0.02, abs=0.005)
    assert clock.seconds["step"] == pytest.approx(0.01, abs=0.005)
    assert sum(clock.seconds.values()) == pytest.approx(0.07, abs=0.01)


def test_the_sweeps_ceiling_decodes_at_full_rows_and_prefills_at_the_cheapest_measured_cost():
    from benchmarks.serving_sweep import schedule_ceiling, table

    results = {"args": {"input_len": 1024, "output_len": 256}, "engine": {"max_chunk": 256, "max_num_seqs": 128},
               "decode_ms_per_token": {128: 10.0}, "mixed_ms": {128: 17.0}, "largest_prefill_us_per_token": 30.0,
               "levels": {128: {"completed": 512, "failed": 0, "output_throughput": 4000.0, "median_ttft_ms": 900.0,
                                "median_tpot_ms": 20.0, "p99_itl_ms": 90.0}}}
    # 256 outputs at 10 ms a step of 128 rows, 1024 prompt tokens riding mixed steps at (17 - 10) / 256 ms each
    assert schedule_ceiling(results, 128) == pytest.approx(1e3 * 256 / (256 * 10 / 128 + 1024 * 7 / 256))
    results["largest_prefill_us_per_token"] = 20.0  # now the cheaper way to prefill
    assert schedule_ceiling(results, 128) == pytest.approx(1e3 * 256 / (256 * 10 / 128 + 1024 * 0.02))
    assert schedule_ceiling(results, 32) is None  # not timed at 32 rows
    assert "the timed programs' ceiling is 0.49 of it" in table(results)
    results["widest_mixed"] = {"chunk_rows": 8, "prefill_ms": 30.0, "ms": {128: 45.96}}  # 8 chunks riding along
    assert schedule_ceiling(results, 128) == pytest.approx(1e3 * 256 / (256 * 10 / 128 + 1024 * 35.96 / 2048))
    del results["widest_mixed"]
    results["engine"]["max_num_seqs"] = 64  # 128 requests on 64 slots: the programs of 64 rows ran, 10 ms a step
    assert schedule_ceiling(results, 128) == pytest.approx(1e3 * 256 / (256 * 10 / 64 + 1024 * 0.02))
    assert "| 128 | 512 | 4000 | 6400 | 0.62 |" in table(results)



def test_the_kernel_lowering_benchmark_lowers_each_way_and_reads_the_exports_back(tmp_path, monkeypatch, capsys):
    """Two-layer NVFP4 model (the lowering tests' widths), decode steps of 2 and 4 rows (the same kernels; no
    prefill chunk fits a budget of one token): the per-program pass exports each program's kernels anew, the next
    pass each kernel once, and the last reads every export back from the cache folder."""
    from jax import export
    from tests.test_gpu_lowering import _config
    monkeypatch.setattr(kernel_lowering, "preset", lambda name: _config())
    passes, exports = [], []
    lower_pass, export_fn = kernel_lowering.lower_pass, export.export

    def counted_pass(*args, **kwargs):
        passes.append(kwargs)
        return lower_pass(*args, **kwargs)

    def counted_export(*args, **kwargs):
        exports.append(len(passes))
        return export_fn(*args, **kwargs)
    monkeypatch.setattr(kernel_lowering, "lower_pass", counted_pass)
    monkeypatch.setattr(export, "export", counted_export)
    kernel_lowering.main(["--expert-precision", "nvfp4", "--dense-precision", "nvfp4", "--decode-rows", "2,4",
                          "--max-num-batched-tokens", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kernel_lowering.json").read_text())
    assert list(result["seconds"]) == ["per program", "once per process", "from disk"]
    assert result["programs"] == [[2, 1], [4, 1]]
    per_pass = [exports.count(i) for i in (1, 2, 3)]
    assert per_pass[0] == 2 * per_pass[1] > 0 and per_pass[2] == 0
    assert "| from disk |" in capsys.readouterr().out
