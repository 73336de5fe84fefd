"""The engine serving LoRA adapters (on attention, the dense MLP, and the routed and shared experts): requests of the
base and of four adapters, more adapters than device slots and than host memory keeps, running together and one
after another over a shared prompt; each gets the greedy tokens of the model with its adapter merged in (the
base's: the plain model's), never another adapter's, also where the prefix cache holds the prompt's pages of the
others, and where its adapter was read again from disk; with the adapters' products by the jnp reference and by the
Pallas kernels. An adapter whose file changed meanwhile fails its request alone. An unknown adapter is refused;
over HTTP, a request's `model` names its adapter, `/v1/models` lists them, and an unknown one is a 404 in OpenAI's
error shape. The metrics count each adapter's requests and tokens."""

import concurrent.futures
import json
import os
import shutil
import threading
import urllib.request

import numpy as np
import pytest

from inkling_jax import Backend, with_backend
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.http.routes import Service
from serve.http.server import ServerThread, serving_app
from serve.http.tokenizer import ByteTokenizer
from serve.lora.config import LoRAConfig
from serve.lora.slots import UnknownAdapter
from serve.offline import TokenRecorder, generate
from tests.serve.http.client import KEY, MODEL, post
from tests.serve.lora.adapters import CONFIG, base_model, greedy, merged_model, random_adapters, save

ALPHA = 16.0
RANKS = {"a": 2, "b": 8, "c": 4, "d": 6}
SLOTS = 3  # device slots, and adapters whose weights host memory keeps
PROMPT = np.random.default_rng(5).integers(0, 256, 19).tolist()  # two full pages of 8: prefix-cached
TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = base_model()
    adapters = {name: random_adapters(model, rank, seed=rank) for name, rank in RANKS.items()}
    root = tmp_path_factory.mktemp("root")
    paths = {name: save(root / f"{name}.safetensors", a, ALPHA) for name, a in adapters.items()}
    expected = {None: greedy(model, PROMPT, TOKENS)}
    expected.update({name: greedy(merged_model(model, a, ALPHA), PROMPT, TOKENS) for name, a in adapters.items()})
    assert len({tuple(t) for t in expected.values()}) == len(expected)  # a row with another's adapter would show
    engine = lora_engine(model, paths, root)
    engine.start()
    engine.paths = paths
    yield engine, expected
    engine.shutdown(drain_seconds=0)


def lora_engine(model, paths: dict[str, str], root) -> Engine:
    """An engine serving the adapters at `paths` in SLOTS device slots, as many in host memory; prefill chunks of
    up to 16 tokens."""
    lora = LoRAConfig(modules=tuple(paths.items()), max_loras=SLOTS, max_rank=8, root=str(root), max_cpu_loras=SLOTS,
                      experts=True)
    return Engine(model, EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, page_size=8,
                                      chunk_buckets=(1, 16), row_buckets=(4, 5), num_pages=24, decode_steps=2,
                                      lora=lora), eos_token_id=CONFIG.eos_token_id)


def run(engine, adapter, recorder=TokenRecorder):
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return generate(engine, [PROMPT], params, adapter=adapter, recorder=recorder)[0].token_ids


def test_mixed_adapters_more_than_slots_match_merged_models(served):
    engine, expected = served
    sample = lambda name, adapter: engine.metrics.registry.get_sample_value(  # noqa: E731
        f"inkling_lora_{name}_total", {"adapter": adapter}) or 0
    counts = lambda: {a: (sample("requests", a), sample("generation_tokens", a)) for a in RANKS}  # noqa: E731
    before = counts()
    assert run(engine, None) == expected[None]  # the prompt's pages are now cached for the base
    order = [None, "a", "b", "c", "d", "a", "c", None, "b", "d"]
    with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
        results = list(pool.map(lambda adapter: run(engine, adapter), order))
    for adapter, tokens in zip(order, results):
        assert tokens == expected[adapter], adapter
    for adapter in ("c", "a", "b", "d"):  # one after another: each load evicts the least recently used
        assert run(engine, adapter) == expected[adapter], adapter
    # four adapters through three slots: some were evicted and loaded again, which the metrics count; host memory
    # kept three of them, so one was read again from disk
    loads = sum(sample("loads", name) for name in RANKS)
    evictions = sum(sample("evictions", name) for name in RANKS)
    assert loads == engine.runner.lora.loads > len(RANKS) - 1 and evictions == loads - SLOTS
    assert engine.metrics.registry.get_sample_value("inkling_lora_load_seconds_count") == loads
    assert engine.runner.lora.reads > 0
    runs = {a: order.count(a) + 1 for a in RANKS}
    assert {a: (r - before[a][0], t - before[a][1]) for a, (r, t) in counts().items()} == {
        a: (n, n * TOKENS) for a, n in runs.items()}


def test_unknown_adapter_is_refused(served):
    engine, _ = served
    with pytest.raises(UnknownAdapter):
        run(engine, "nope")


def test_the_lora_kernels_serve_each_adapters_tokens(served):
    """The adapters' products by the Pallas kernels (`lora=pallas`; interpreted here), where the engine above runs
    their jnp reference: prefill chunks of 16 tokens per row take the segmented form, decode steps the gathered
    one, with rows of the base and of two adapters together."""
    _, expected = served
    paths = served[0].paths
    engine = lora_engine(with_backend(base_model(), Backend.parse("reference,moe=dense,lora=pallas")), paths,
                         os.path.dirname(paths["a"]))
    engine.start()
    try:
        order = [None, "a", "b", "a"]
        with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
            results = list(pool.map(lambda adapter: run(engine, adapter), order))
    finally:
        engine.shutdown(drain_seconds=0)
    for adapter, tokens in zip(order, results):
        assert tokens == expected[adapter], adapter


def test_adapter_read_again_from_disk_is_the_one_loaded(served):
    """An adapter whose weights left host memory is read again from its path; one whose file changed since would be
    another adapter: its request fails alone."""
    engine, expected = served
    lora = engine.runner.lora
    path = os.path.join(os.path.dirname(engine.paths["b"]), "b3.safetensors")
    shutil.copyfile(engine.paths["b"], path)
    lora.register("b3", path)
    try:
        for adapter in ("a", "c", "d"):  # three others through host memory: b3's weights leave it
            run(engine, adapter)
        assert lora.get("b3").weights is None
        reads = lora.reads
        assert run(engine, "b3") == expected["b"] and lora.reads == reads + 1
        for adapter in ("a", "c", "d"):
            run(engine, adapter)
        shutil.copyfile(engine.paths["a"], path)  # another adapter at its path
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        assert generate(engine, [PROMPT], params, adapter="b3")[0].finish_reason == "error"
        assert run(engine, "c") == expected["c"]  # the engine serves on
    finally:
        lora.unregister("b3")


@pytest.fixture(scope="module")
def server(served):
    """The engine behind HTTP (its shutdown drains the engine: the module's last use of it)."""
    engine, _ = served
    service = Service(engine, ByteTokenizer(), MODEL, "test model", CONFIG.text.unpadded_vocab_size,
                      max_prompt_tokens=40, max_tokens=TOKENS, api_key=KEY, lora=engine.runner.lora)
    with ServerThread(serving_app(service), drain_seconds=5) as thread:
        yield thread


def test_http_names_adapters_by_model(served, server):
    engine, expected = served
    tokenizer, thread = ByteTokenizer(), server
    request = urllib.request.Request(thread.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        models = json.loads(r.read())["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [(MODEL, None)] + [(n, MODEL) for n in RANKS]
    for name in (MODEL, "b"):
        status, reply = post(thread.url, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": TOKENS,
                                                             "temperature": 0, "ignore_eos": True})
        assert status == 200 and reply["model"] == name, reply
        want = expected[None if name == MODEL else name]
        assert reply["choices"][0]["text"] == tokenizer.decode(want)
    status, reply = post(thread.url, "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and reply["error"]["code"] == "model_not_found" and reply["error"]["param"] == "model"
    assert set(reply["error"]) == {"message", "type", "param", "code"}


def test_adapters_load_from_under_the_root_and_unload_while_requests_run(served, server, tmp_path):
    engine, expected = served
    thread = server
    outside = tmp_path / "b.safetensors"
    outside.write_bytes(open(engine.paths["b"], "rb").read())
    root = os.path.dirname(engine.paths["b"])
    os.symlink(outside, os.path.join(root, "link.safetensors"))
    for path in (str(outside), f"{root}/../{tmp_path.name}/b.safetensors", f"{root}/link.safetensors", root):
        status, reply = post(thread.url, "/v1/load_lora_adapter", {"lora_name": "b2", "lora_path": path})
        assert status == 400 and "not under the server's LoRA root" in reply["error"]["message"], path
    status, _ = post(thread.url, "/v1/load_lora_adapter", {"lora_name": "b2", "lora_path": engine.paths["b"]})
    assert status == 200
    status, reply = post(thread.url, "/v1/load_lora_adapter", {"lora_name": "b2", "lora_path": engine.paths["b"]})
    assert status == 400 and "already served" in reply["error"]["message"]
    assert run(engine, "b2") == expected["b"]  # its own load of b's file, in a slot of its own

    # unloaded while its requests run: they finish with it; new ones are refused
    submitted = threading.Semaphore(0)

    class Signalling(TokenRecorder):  # made by `Engine.submit` once it has taken the request's adapter
        def __init__(self):
            super().__init__()
            submitted.release()

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(run, engine, "b2", Signalling) for _ in range(3)]
        assert all(submitted.acquire(timeout=60) for _ in running)
        status, _ = post(thread.url, "/v1/unload_lora_adapter", {"lora_name": "b2"})
        assert status == 200
        assert [r.result() for r in running] == [expected["b"]] * 3
    status, reply = post(thread.url, "/v1/completions", {"model": "b2", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    status, reply = post(thread.url, "/v1/unload_lora_adapter", {"lora_name": "b2"})
    assert status == 404
