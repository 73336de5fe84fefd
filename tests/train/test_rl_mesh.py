"""`python -m train.rl --mesh` on 8 simulated CPU devices: the trainer on fsdp=2, tensor=2, expert=2 and the
rollout engine on the same devices (data=2, tensor=2, expert=2: `train.rl.colocation`), its cache freed while the
trainer runs. Its metrics equal those of the one-device run of test_rl.py's setup; freeing the cache drops its
arrays, and the next rollout allocates them again and samples what it sampled before. The same command as a job
of two processes with 4 devices each (an engine per process, rolling out half the prompts) logs the same metrics
as the one process."""

import weakref

import jax
import pytest

from inkling_jax.parallel.mesh import MeshError
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from tests.train.test_multiprocess import finish, log_of, rows, spawn
from tests.train.test_rl import TIMING, arguments, prompts, run  # noqa: F401 (the prompts fixture)
from train.rl import command
from train.rl.rollout import EnginePool

pytestmark = pytest.mark.heavy  # see conftest.py

MESH = "fsdp=2,tensor=2,expert=2"
EIGHT = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def same_metrics(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key in set(g) - TIMING:
            # The same tokens sampled (rewards, lengths, clipping exact); the rest to float32 rounding of sums
            # taken in another order. The logprob differences are that rounding itself: below 1e-5 on both.
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-5), key


@pytest.fixture(scope="module")
def pool():
    with EnginePool() as engines:
        yield engines


@pytest.fixture(scope="module")
def sharded(prompts, pool, tmp_path_factory):  # noqa: F811
    """The --mesh run's metrics (its engine stays in `pool`)."""
    return run(prompts, tmp_path_factory.mktemp("mesh"), "--steps", "2", "--mesh", MESH, "--free-engine-cache",
               engines=pool)


@EIGHT
def test_a_colocated_mesh_run_equals_one_device_and_frees_the_engine_cache(prompts, pool, sharded,  # noqa: F811
                                                                            tmp_path):
    engine = next(iter(pool))
    assert dict(engine.runner.placement.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 2}
    assert len(engine.runner.params[0].sharding.device_set) == 8
    assert any(not x.sharding.is_fully_replicated for x in engine.runner.params)
    assert engine.runner.cache is None  # freed after the last rollouts

    params = SamplingParams(max_tokens=4, temperature=0, logprobs=0)
    first = generate(engine, [[5, 6, 7]], params)[0]  # allocates the cache again
    arrays = [weakref.ref(x) for x in jax.tree.leaves((engine.runner.cache, engine.runner.snapshots))]
    assert arrays and all(r() is not None for r in arrays)
    engine.free_cache()
    assert all(r() is None for r in arrays)  # nothing holds them: their device memory is back
    again = generate(engine, [[5, 6, 7]], params)[0]
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs
    same_metrics(sharded, run(prompts, tmp_path, "--steps", "2"))


@EIGHT
def test_a_two_process_job_equals_one_process(prompts, sharded, tmp_path):  # noqa: F811
    out = tmp_path / "job"
    procs = spawn("train.rl", out, arguments(prompts, out, "--steps", "2", "--mesh", MESH, "--free-engine-cache",
                                             "--no-tensorboard"))
    assert finish(procs, timeout=200) == [0, 0], log_of(out, 0)[-3000:] + log_of(out, 1)[-3000:]
    same_metrics(rows(out), sharded)  # written once, by process 0


def test_help_and_bad_flags(prompts, tmp_path, capsys):  # noqa: F811
    with pytest.raises(SystemExit):
        command.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--mesh", "--free-engine-cache", "--coordinator", "--num-processes", "--process-id"):
        assert flag in text
    base = arguments(prompts, tmp_path, "--steps", "1")
    with pytest.raises(SystemExit):
        command.parse_args(base + ["--coordinator", "127.0.0.1:1234"])
    assert "go together" in capsys.readouterr().err
    with pytest.raises(MeshError, match="needs"):
        command.main(base + ["--mesh", f"tensor={jax.device_count() + 1}"])
