"""The cache contract: prefill and one-token decode steps reproduce the full forward, across the window and
rel_extent boundaries, with rows of different lengths; greedy decoding equals transformers' `generate`."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from inkling_jax import load_pretrained
from inkling_jax.generate import StepFunctions, greedy_generate
from inkling_jax.nn.cache import cache_bytes
from tests.hf_oracle import relative_error

TOL = 1e-5
MAX_LEN = 40  # one cache shape for every test, so the jitted steps compile once per chunk width


@pytest.fixture(scope="module", params=["base", "long_extent"])
def loaded(request, checkpoints):
    path, ref = checkpoints(request.param)
    model = load_pretrained(path, progress=False)
    return model, ref, StepFunctions(model)


def test_prefill_then_decode_matches_full_forward(loaded):
    model, _, steps = loaded
    seq, prompt = 34, 5  # crosses the window (8 / 16) and the extent (12) several times
    ids = np.random.default_rng(0).integers(0, 120, (2, seq)).astype(np.int32)
    full = np.asarray(steps.forward(ids))
    cache = model.init_cache(2, MAX_LEN)
    logits, cache = steps.extend(ids[:, :prompt], cache)
    outs = [np.asarray(logits)]
    for t in range(prompt, seq):
        logits, cache = steps.extend(ids[:, t:t + 1], cache)
        outs.append(np.asarray(logits))
    assert relative_error(np.concatenate(outs, axis=1), full) < TOL
    assert np.asarray(cache.lengths).tolist() == [seq, seq]


def test_chunked_prefill_with_ragged_rows(loaded):
    """Rows advance by different amounts per step (right padding); each row still sees its own sequence."""
    model, _, steps = loaded
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 120, 23).astype(np.int32), rng.integers(0, 120, 17).astype(np.int32)]
    schedule = [(6, 3), (2, 6), (6, 6), (6, 0), (3, 2)]  # real tokens per row per step, chunk width 6
    cache = model.init_cache(2, MAX_LEN)
    got = [[], []]
    done = [0, 0]
    for n0, n1 in schedule:
        chunk = np.zeros((2, 6), np.int32)
        for row, n in enumerate((n0, n1)):
            chunk[row, :n] = seqs[row][done[row]:done[row] + n]
        logits, cache = steps.extend(chunk, cache, np.array([n0, n1]))
        for row, n in enumerate((n0, n1)):
            got[row].append(np.asarray(logits[row, :n]))
            done[row] += n
    assert done == [23, 17]
    for row in range(2):
        full = np.asarray(steps.forward(seqs[row][None]))[0]
        assert relative_error(np.concatenate(got[row]), full) < TOL


def test_sliding_layers_keep_only_a_window(loaded):
    model, _, _ = loaded
    text = model.config.text
    cache = model.init_cache(1, 1000, page_size=8)
    for i, layer in enumerate(cache.layers):
        rows = layer.k.shape[1] if text.is_local(i) else layer.k.shape[0] * layer.k.shape[1]
        assert rows == (text.sliding_window if text.is_local(i) else 1000)
    # Growing max_len grows only the full layers.
    n_full = text.num_layers - len(text.local_layer_ids)
    kv_full = 2 * text.num_kv_heads * text.head_dim * 4
    grown = cache_bytes(text, 1, 2000, jnp.float32, page_size=8) - cache_bytes(text, 1, 1000, jnp.float32, page_size=8)
    assert grown == 1000 * n_full * kv_full + 125 * 4  # the KV rows plus 125 more page-table entries


def test_shared_page_pool_in_any_order(loaded):
    """Rows whose pages come from a shared pool, scattered and interleaved, give the same logits."""
    model, _, steps = loaded
    ids = np.random.default_rng(3).integers(0, 120, (2, 20)).astype(np.int32)
    full = np.asarray(steps.forward(ids))
    cache = model.init_cache(2, 24, page_size=4, num_pages=13)
    cache = cache.replace(page_table=jnp.array([[7, 0, 12, 3, 9, 5], [1, 11, 2, 8, 4, 10]], jnp.int32))
    logits, cache = steps.extend(ids[:, :9], cache)
    outs = [np.asarray(logits)]
    for t in range(9, 20):
        logits, cache = steps.extend(ids[:, t:t + 1], cache)
        outs.append(np.asarray(logits))
    assert relative_error(np.concatenate(outs, axis=1), full) < TOL


def test_greedy_matches_transformers_generate(loaded):
    model, ref, steps = loaded
    prompt = np.random.default_rng(2).integers(0, 120, (2, 7)).astype(np.int32)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = ref.generate(input_ids=torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=20,
                                do_sample=False, pad_token_id=0)[:, 7:].numpy()
    got = greedy_generate(model, prompt, 20, steps=steps, max_len=MAX_LEN)
    np.testing.assert_array_equal(got, expected)
