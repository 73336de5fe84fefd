"""The command line: defaults that suit the backend, and a mesh that cannot serve the model stopping the server
before any weight loads."""

import dataclasses

import jax
import pytest

import serve.app
from inkling_jax import preset
from serve.app import engine_config, main, parse_args
from serve.lora.config import LoRAConfig
from serve.engine.block_manager import BlockManager
from serve.engine.scheduler import Scheduler
from serve.runner.placement import MeshError, Placement
from tests.serve.engine.sequences import seq_of


def test_command_line_defaults_suit_the_backend():
    config = engine_config(parse_args(["--max-num-seqs", "4", "--no-prefix-caching"]))
    assert config.buckets == [(5, 1), (5, 16)] and not config.prefix_caching  # CPU: two compilations
    assert not config.mixed_buckets  # its one row bucket is every row: no mixed steps
    assert engine_config(parse_args([])).buckets == [(9, 1), (9, 16)]
    with pytest.raises(ValueError):
        engine_config(parse_args(["--chunk-buckets", "16,64"]))  # decode needs the 1-token bucket
    with pytest.raises(ValueError):  # 9 rows x 32 tokens: no prefill step would fit the budget of 256
        engine_config(parse_args(["--chunk-buckets", "1,32", "--max-num-batched-tokens", "256"]))


def test_gpu_defaults_decode_every_slot_and_prefill_several_prompts_per_step(monkeypatch):
    """On a GPU the defaults serve 128 sequences: a decode bucket for each power of two of them, and a token
    budget of a decode token per slot plus 8 of the largest prefill chunks, so that a burst of prompts is
    prefilled 8 at a time, not one per step."""
    monkeypatch.setattr(serve.app.jax, "default_backend", lambda: "gpu")
    config = engine_config(parse_args([]))
    assert config.max_num_seqs == 128 and config.max_num_batched_tokens == 128 + 8 * 256
    assert config.rows == (1, 2, 4, 8, 16, 32, 64, 129)
    assert {r for r, t in config.buckets if t == 1} == set(config.rows)
    assert max(r for r, t in config.buckets if t == 256) == 8 and (129, 16) in config.buckets
    assert config.fits(8, 256) and not config.fits(9, 256)
    # a step of decodes and one prompt chunk (one row of 256 tokens), or up to 8 (a burst), runs as one program, for
    # every decode bucket
    assert config.mixed_buckets == config.rows and config.mixed_prefills == (1, 8) and config.max_chunk == 256
    assert [config.mixed_prefill_bucket(n) for n in (1, 2, 8, 9)] == [1, 8, 8, None]
    assert not engine_config(parse_args(["--no-mixed-steps"])).mixed_buckets
    wider = engine_config(parse_args(["--mixed-prefill-rows", "1,2,8"]))  # up to 8 chunks ride along, padded
    assert [wider.mixed_prefill_bucket(n) for n in (1, 2, 3, 8, 9)] == [1, 2, 8, 8, None]
    for bad in ("3", "2,1", "16", "129"):  # not a row bucket, not increasing, no prefill program, every row
        with pytest.raises(ValueError, match="mixed_prefill_rows"):
            engine_config(parse_args(["--mixed-prefill-rows", bad]))
    scheduler = Scheduler(config, BlockManager(20_000, config.page_size, config.snapshots))
    for _ in range(128):  # a burst of long prompts
        scheduler.add(seq_of(1000))
    assert [c.num_tokens for c in scheduler.schedule()] == [256] * 8
    smaller = engine_config(parse_args(["--max-num-seqs", "32", "--chunk-buckets", "1,64"]))
    assert smaller.max_num_batched_tokens == 32 + 8 * 64 and smaller.rows == (1, 2, 4, 8, 16, 33)
    assert engine_config(parse_args(["--max-num-seqs", "4", "--chunk-buckets", "1,16"])).max_num_batched_tokens \
        == 256  # never below the least budget
    given = engine_config(parse_args(["--max-num-batched-tokens", "4096"]))
    assert given.max_num_batched_tokens == 4096 and max(r for r, t in given.buckets if t == 256) == 16


@pytest.mark.skipif(jax.device_count() < 3, reason="needs 3 (simulated) devices")
def test_a_mesh_that_cannot_serve_the_model_fails_before_loading(caplog):
    """A mesh that cannot split the experts (the model's, or a draft model's, named) or serve adapters on them
    stops the server with one line, before any weight loads; one that splits less than asked says what stays
    whole."""
    with pytest.raises(SystemExit, match="--mesh expert=3: the model's 8 routed experts do not split over expert=3"):
        main(["--mesh", "expert=3"])
    with pytest.raises(SystemExit, match="needs 64 devices"):
        main(["--mesh", "tensor=64"])
    with pytest.raises(SystemExit, match="--mesh expert=2: --lora-experts is not served on a mesh with an expert"):
        main(["--mesh", "expert=2", "--lora-modules", "a=/nowhere", "--lora-experts"])
    with pytest.raises(MeshError, match="bad mesh axis"):
        Placement.from_spec("pipeline=2")
    text = preset("tiny").text
    with pytest.raises(MeshError, match="the draft model: the model's 3 routed experts do not split over expert=2"):
        Placement.from_spec("expert=2").check(dataclasses.replace(text, num_experts=3), name="the draft model")
    with caplog.at_level("WARNING", logger="inkling_jax.parallel.rules"):
        Placement.from_spec("tensor=3").check(text)
    assert "full-attention layers' 4 query / 1 KV heads" in caplog.text
    assert "does not divide the expert width 32" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="inkling_jax.parallel.rules"):
        Placement.from_spec("tensor=2").check(text)  # the full layer's single KV head stays whole
    assert "full-attention" in caplog.text and "sliding" not in caplog.text and "expert width" not in caplog.text


@pytest.mark.parametrize("argv,message", [
    (["--port", "99999"], "--port: must be in [1, 65535]"),
    (["--port", "0"], "--port: must be in [1, 65535]"),
    (["--max-n", "0"], "--max-n: must be >= 1"),
    (["--max-tokens", "-5"], "--max-tokens: must be >= 1"),
    (["--max-queued", "-1"], "--max-queued: must be >= 1"),
    (["--max-num-seqs", "two"], "--max-num-seqs: 'two' is not a number"),
    (["--drain-seconds", "nan"], "--drain-seconds: must be >= 0.0"),
    (["--memory-fraction", "1.5"], "--memory-fraction: must be in [0.01, 1.0]"),
    (["--max-body-mb", "0"], "--max-body-mb: must be >= 0.001"),
    (["--max-prompt-tokens", "1024"], "--max-prompt-tokens must be below --max-model-len (1024)"),
    (["--max-model-len", "64", "--max-tokens", "64"], "--max-tokens must be below --max-model-len (64)"),
    (["--api-key", "a", "--api-key-file", "/dev/null"], "not allowed with argument"),
    (["--api-key-file", "/no/such/file"], "--api-key-file: can't open"),
    (["--api-key-file", "/dev/null"], "holds no key"),
    (["--preset", "bench"], "--preset needs --random-weights"),
    (["--random-weights", "--preset", "huge"], "--preset: unknown preset 'huge'"),
    (["--speculative-num-draft-tokens", "9"], "--speculative-num-draft-tokens: must be in [1, 8]"),
    (["--speculative-algorithm", "eagle"], "--speculative-algorithm: invalid choice"),
    (["--speculative-num-draft-tokens", "2"], "--speculative-num-draft-tokens needs --speculative-algorithm"),
    (["--speculative-algorithm", "draft"], "--speculative-algorithm draft and --speculative-draft-model go together"),
    (["--speculative-draft-model", "/x"], "--speculative-algorithm draft and --speculative-draft-model go together"),
    (["--lora-modules", "a"], "--lora-modules takes NAME=PATH, got 'a'"),
    (["--lora-modules", "a=/x", "--speculative-algorithm", "mtp"],
     "--lora-modules and --lora-root are not served with --speculative-algorithm yet"),
    (["--max-loras", "0"], "--max-loras: must be >= 1"),
    (["--max-loras", "3", "--max-cpu-loras", "2"], "--max-cpu-loras must be at least --max-loras (3)"),
])
def test_bad_flags_stop_the_server_at_start_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_speculative_flags_make_the_engine_config_and_a_model_that_cannot_fails_before_loading():
    config = engine_config(parse_args(["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "4"]))
    assert (config.speculative.method, config.speculative.num_draft_tokens) == ("mtp", 4)
    assert engine_config(parse_args([])).speculative is None
    with pytest.raises(SystemExit, match="--speculative-algorithm mtp: 8 draft tokens: a verify of 9 tokens must fit "
                                         "the sliding window"):
        main(["--random-weights", "--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "8"])


def test_lora_flags_make_the_engine_config():
    config = engine_config(parse_args(["--lora-modules", "a=/x/a", "b=/y", "--max-loras", "2", "--max-lora-rank", "8"]))
    assert (config.lora.modules, config.lora.max_loras, config.lora.max_rank) == ((("a", "/x/a"), ("b", "/y")), 2, 8)
    assert config.lora.max_cpu_loras == 2  # vLLM's default: --max-loras
    config = engine_config(parse_args(["--lora-modules", "a=/x/a", "--max-cpu-loras", "5"]))
    assert (config.lora.max_loras, config.lora.max_cpu_loras) == (1, 5)
    assert engine_config(parse_args([])).lora is None
    assert engine_config(parse_args(["--lora-root", "/r"])).lora == LoRAConfig((), 1, 16, "/r")


def test_the_api_key_can_come_from_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("INKLING_API_KEY", raising=False)
    path = tmp_path / "key"
    path.write_text("s3cret\nignored\n")
    assert parse_args(["--api-key-file", str(path)]).api_key == "s3cret"
    assert parse_args([]).api_key is None
