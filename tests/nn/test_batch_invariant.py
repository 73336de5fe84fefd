"""`Backend(batch_invariant=True)` on CPU: a row's logits and logprobs are the same bits whatever the other rows,
the chunking and the program (a training forward, prefill chunks and decode steps over the paged cache, the
serving engine at any concurrency). A 2-layer `tiny` model (a sliding layer with the dense MLP, a full-attention
layer with the MoE) in float32, its weights perturbed away from the initial ones (norm weights and scales of 1
hide rounding).
XLA:CPU runs without fused multiply-adds (the root conftest.py, as `--batch-invariant` commands start it)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, InklingModel, preset
from inkling_jax.nn import invariant, invariant_attention, kernels
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import device_random_model
from train.run import first_layers
from train.state import ModelParts, model_params

pytestmark = pytest.mark.heavy  # see conftest.py

INVARIANT = dataclasses.replace(Backend.parse("reference"), batch_invariant=True)
CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
VOCAB = CONFIG.text.unpadded_vocab_size


def perturbed(model):
    """The model with every float parameter moved by ~30% (a copy)."""
    graph, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    leaves = [x * (1 + 0.3 * jax.random.normal(k, x.shape, x.dtype)) if jnp.issubdtype(x.dtype, jnp.floating)
              else x for k, x in zip(keys, leaves)]
    return nnx.merge(graph, jax.tree.unflatten(tree, leaves))


@pytest.fixture(scope="module")
def model():
    return perturbed(InklingModel(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0), backend=INVARIANT))


@pytest.fixture(scope="module")
def forward(model):
    """The training forward, jitted once for the module (each shape compiles once)."""
    return jax.jit(lambda ids: model(ids))


def test_fixed_order_pieces_agree_with_xla_and_do_not_depend_on_the_rows():
    x = jax.random.normal(jax.random.key(0), (40, 300), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (300, 72), jnp.float32)
    assert np.allclose(invariant.tree_sum(x), x.sum(-1), atol=1e-4)
    assert np.allclose(invariant.log_softmax(x), jax.nn.log_softmax(x), atol=1e-5)
    product = jax.jit(lambda x: invariant.matmul(x, w, interpret=True))
    assert np.allclose(product(x), x @ w, atol=1e-3)
    for transposed in (False, True):  # the gradient is the dot's, whichever way the weight lies
        weight = w.T if transposed else w
        def loss(x, weight, transposed=transposed):
            return (invariant.matmul(x, weight, interpret=True, transposed=transposed) ** 2).sum()
        want = jax.grad(lambda x, w: ((x @ w) ** 2).sum(), argnums=(0, 1))(x, w)
        got = jax.grad(loss, argnums=(0, 1))(x, weight)
        assert np.allclose(got[0], want[0], rtol=1e-4, atol=1e-2)
        assert np.allclose(got[1].T if transposed else got[1], want[1], rtol=1e-4, atol=1e-2)
    for rows in (1, 7, 40):  # row 0 of X[:M] @ W, whatever M
        np.testing.assert_array_equal(product(x[:rows])[0], product(x[:1])[0])
    # bf16 on both sides of DECODE_ROWS, where the tiles change
    xb = jax.random.normal(jax.random.key(2), (2 * invariant.DECODE_ROWS + 3, 300)).astype(jnp.bfloat16)
    bf16_product = jax.jit(lambda x: invariant.matmul(x, w.astype(jnp.bfloat16), interpret=True))
    whole = bf16_product(xb)
    for rows in (1, invariant.DECODE_ROWS, invariant.DECODE_ROWS + 1):
        np.testing.assert_array_equal(bf16_product(xb[:rows]), whole[:rows])
    sums = jax.jit(invariant.tree_sum)
    np.testing.assert_array_equal(sums(x)[:3], sums(x[:3]))


def test_a_row_gets_the_same_logits_from_forwards_of_any_batch(forward):
    ids = np.random.default_rng(0).integers(0, VOCAB, (5, 20)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(forward(ids[:2]))[0], np.asarray(forward(ids))[0])


def assert_chunks_and_decode_steps_give_the_forwards_logits(model, forward, extend, length: int, chunks: tuple,
                                                           rows: int):
    """Row 0 of a training forward of 5 rows of `length` tokens, against row 0 prefilled in `chunks` and then
    decoded one token at a time beside `rows - 1` other rows (the sliding layers' ring and the paged cache).
    forward(ids) and extend(ids, cache, n_new) are the model's, jitted."""
    vocab = model.config.text.unpadded_vocab_size
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (5, length)).astype(np.int32)
    want = np.asarray(forward(ids))[0]
    cache, got, start = model.init_cache(rows, length + 12), [], 0
    for size in chunks + (1,) * (length - sum(chunks)):
        step = rng.integers(0, vocab, (rows, size)).astype(np.int32)
        step[0] = ids[0, start:start + size]
        logits, cache = extend(step, cache, jnp.full((rows,), size, jnp.int32))
        got.append(np.asarray(logits)[0])
        start += size
    got = np.concatenate(got)
    differing = [t for t in range(length) if not np.array_equal(got[t], want[t])]
    assert not differing, f"positions {differing} differ, by up to {np.abs(got - want).max()}"


def test_a_row_gets_the_same_logits_from_a_forward_and_from_chunks_and_decode_steps_among_other_rows(model, forward):
    """Chunks of 3 and 13 tokens, then 4 decode steps, past the attention temperature's start at 16."""
    extend = jax.jit(lambda ids, cache, n_new: model.extend(ids, cache, n_new))
    assert_chunks_and_decode_steps_give_the_forwards_logits(model, forward, extend, 20, (3, 13), 3)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernels in bfloat16: a GPU")
@pytest.mark.parametrize("layers", [2, 3])
def test_on_a_gpu_at_the_bench_widths_the_forward_chunks_and_decode_steps_agree(layers):
    """The `bench` preset's first layers in bfloat16 (3: two dense, one MoE), weights perturbed: prefill chunks
    and decode steps among other rows give row 0 the forward's logits, and so does the trainer's program, which
    casts fp32 masters (not all of them bf16 values) to the compute dtype and computes the gradient (the
    backward's residuals live in it). Run on the GPU: `python -m pytest -q tests/nn/test_batch_invariant.py -k gpu`."""
    config = first_layers(preset("bench"), layers)
    backend = Backend(batch_invariant=True)
    parts = ModelParts(config, jnp.bfloat16, backend)
    frozen = model_params(perturbed(device_random_model(config, jnp.bfloat16, 0, backend)))
    # The layers' bf16 weights as fp32 masters off the bf16 grid; the embedding and head stay frozen in bf16 (as
    # `benchmarks.rl` keeps them: fp32 copies and gradients of their 2.5B weights would not fit beside the rest).
    trained = [name for name, x in frozen.items() if name.startswith("layers.") and x.dtype == jnp.bfloat16]
    masters = {}
    for i, name in enumerate(trained):  # (the bf16 originals freed one by one)
        x = frozen.pop(name)
        masters[name] = x.astype(jnp.float32) * (1 + 1e-3 * jax.random.normal(jax.random.key(i), x.shape))
    merge = jax.jit(lambda frozen, masters: parts.merge({**frozen, **masters}))
    model = merge(frozen, masters)  # the weights the engine would hold: the masters rounded
    graph, state = nnx.split(model)  # the weights as arguments of the programs, not as their constants
    run = jax.jit(lambda state, ids: nnx.merge(graph, state)(ids))

    @jax.jit
    def trainer_like(frozen, masters, ids):  # (logits, gradient): the gradient keeps the backward in the program
        def loss(masters):
            logits = parts.merge({**frozen, **masters})(ids)
            return jax.nn.logsumexp(logits.astype(jnp.float32), -1).sum(), logits
        grads, logits = jax.grad(loss, has_aux=True)(masters)
        return logits, grads

    step = jax.jit(lambda state, ids, cache, n_new: nnx.merge(graph, state).extend(ids, cache, n_new))
    # 5 rows, as the forward the chunks are checked against: one program fewer to compile
    ids = np.random.default_rng(1).integers(0, config.text.unpadded_vocab_size, (5, 48)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(trainer_like(frozen, masters, ids)[0]), np.asarray(run(state, ids)))
    np.testing.assert_array_equal(np.asarray(run(state, ids[:1]))[0], np.asarray(run(state, ids))[0])
    assert_chunks_and_decode_steps_give_the_forwards_logits(
        model, lambda ids: run(state, ids), lambda *args: step(state, *args), 48, (16, 24), 33)


@pytest.mark.parametrize("ring, tokens", [(8, 1), (11, 1), (11, 4)])
def test_attention_over_the_cache_as_it_lies_matches_the_training_attention_bit_for_bit(ring, tokens):
    """Decode steps and chunks of 4 at positions past several laps of a sliding layer's ring (of the window's length,
    or longer as speculative decoding sizes it) and past multiples of the tile's key block, with stale entries in
    the ring; decode steps over a full layer's shuffled pages: each query's output is that of its position in the
    training forward."""
    window, seq, heads, kv_heads, dim, d_rel = 8, 150, 4, 2, 16, 4
    keys = iter(jax.random.split(jax.random.key(0), 8))
    q, r = (jax.random.normal(next(keys), (1, seq, heads, d), jnp.float32) for d in (dim, d_rel))
    k, v = (jax.random.normal(next(keys), (1, seq, kv_heads, dim), jnp.float32) for _ in range(2))
    rel_proj = jax.random.normal(next(keys), (d_rel, window), jnp.float32)
    tau = 1 + jax.random.uniform(next(keys), (1, seq), jnp.float32)
    starts = np.array([0, 5, 63, 64, 70, 124, 146])  # each row's first query
    rows, span = len(starts), starts[:, None] + np.arange(tokens)[None, :]
    query = lambda x: x[0, span]  # noqa: E731

    want = invariant_attention.self_attention(q, k, v, r, rel_proj, window=window, tau=None, interpret=True)[0]
    ring_rows = np.arange(rows, 0, -1)  # pool row of each batch row (row 0 of the pool is nobody's)
    pools = [np.array(jax.random.normal(next(keys), (rows + 1, ring, kv_heads, dim), jnp.float32)) for _ in "kv"]
    for b, last in enumerate(span[:, -1]):
        for pos in range(max(0, last + 1 - ring), last + 1):
            for pool, x in zip(pools, (k, v)):
                pool[ring_rows[b], pos % ring] = x[0, pos]
    if tokens == 1:
        got = kernels.decode_attention(query(q)[:, 0], *pools, query(r)[:, 0], rel_proj, jnp.asarray(starts + 1),
                                       backend=INVARIANT, ring_rows=jnp.asarray(ring_rows), window=window)[:, None]
    else:
        got = kernels.ring_chunk_attention(query(q), *pools, jnp.asarray(ring_rows), query(r), rel_proj,
                                           backend=INVARIANT, cached=jnp.asarray(starts),
                                           n_new=jnp.full((rows,), tokens), window=window)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[span])
    if tokens > 1:
        return

    want = invariant_attention.self_attention(q, k, v, r, rel_proj, window=None, tau=tau, interpret=True)[0]
    page_size, per_row = 16, -(-seq // 16)
    table = np.random.default_rng(0).permutation(rows * per_row).reshape(rows, per_row)
    pools = [np.zeros((rows * per_row, page_size, kv_heads, dim), np.float32) for _ in range(2)]
    for b, p in enumerate(starts):
        for pos in range(p + 1):
            for pool, x in zip(pools, (k, v)):
                pool[table[b, pos // page_size], pos % page_size] = x[0, pos]
    got = kernels.decode_attention(q[0, starts], *pools, r[0, starts], rel_proj, jnp.asarray(starts + 1),
                                   backend=INVARIANT, page_table=jnp.asarray(table), tau=tau[0, starts])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[starts])


def test_the_engine_gives_a_request_the_same_tokens_and_logprobs_alone_and_among_others(model):
    """Greedy and seeded requests, alone and among 32 others of 2 to 16 tokens (8 slots: queued, batched and
    chunked differently; a 40-token prompt takes three chunks). No prompt-scoring program: neither asks for
    prompt logprobs."""
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=64, page_size=16, chunk_buckets=(1, 16),
                                        row_buckets=(9,), max_num_batched_tokens=160, fuse_projections=False,
                                        prefix_caching=False, full_sampler_only=True,  # both ask for logprobs
                                        score_prompts=False),
                    eos_token_id=CONFIG.eos_token_id)
    engine.start()
    try:
        rng = np.random.default_rng(1)
        prompt = rng.integers(0, VOCAB, 40).tolist()
        others = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(2, 17, 32)]
        for params in (SamplingParams(max_tokens=6, temperature=0.0, logprobs=0),
                       SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=3, logprobs=0)):
            alone = generate(engine, [prompt], params)[0]
            crowd = generate(engine, others[:13] + [prompt] + others[13:], params)[13]
            assert crowd.token_ids == alone.token_ids
            assert crowd.logprobs == alone.logprobs  # bit for bit
    finally:
        engine.shutdown()


def test_the_engine_refuses_fused_projections_for_a_batch_invariant_model(model):
    with pytest.raises(ValueError, match="fuse_projections=False"):
        Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32, chunk_buckets=(1, 16)), eos_token_id=0)


def test_backend_flags(monkeypatch):
    import argparse

    from inkling_jax.backend import NO_FMA_CPU_FLAG, add_backend_flag, add_batch_invariant_flag

    parser = argparse.ArgumentParser()
    add_backend_flag(parser)
    add_batch_invariant_flag(parser, "x")
    for argv in (["--batch-invariant", "--backend", "reference"], ["--backend", "reference", "--batch-invariant"]):
        assert parser.parse_args(argv).backend == dataclasses.replace(Backend.parse("reference"), batch_invariant=True)
    assert not parser.parse_args([]).backend.batch_invariant
    assert INVARIANT.resolve().moe == "pallas" and INVARIANT.resolve().batch_invariant
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        Backend(batch_invariant=1.5)
    for flags, want in (("--xla_dump_to=x", f"--xla_dump_to=x {NO_FMA_CPU_FLAG}"),
                        ("--xla_cpu_max_isa=SSE4_2", "--xla_cpu_max_isa=SSE4_2")):  # a chosen ISA stays
        monkeypatch.setenv("XLA_FLAGS", flags)
        parser.parse_args(["--batch-invariant"])
        assert os.environ["XLA_FLAGS"] == want
