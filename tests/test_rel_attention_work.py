"""bench/rel_attention_work.py counts the key blocks the Mosaic forward visits; on a full layer they are exactly the
blocks that hold a visible key, and the biased ones exactly those that hold a key within the relative extent."""

from bench.rel_attention_setup import Layer
from bench.rel_attention_work import executed_flops, warpgroup_steps
from pallas_kernels.rel_attention import toeplitz, tuning


def test_full_layer_steps_are_the_visible_key_blocks():
    layer = Layer(kv_heads=8, extent=200, window=None, tokens=512)
    n_tok, keys = toeplitz.tokens_per_tile(layer.groups), tuning.MOSAIC_FORWARD_KEYS
    plain = biased = 0
    for first in range(0, layer.tokens, 2 * n_tok):  # one CTA: 2 warpgroups over the same key blocks
        queries = range(first, first + 2 * n_tok)
        for block in range(layer.tokens // keys):
            pairs = [(q, k) for q in queries for k in range(block * keys, (block + 1) * keys) if k <= q]
            if any(q - k < layer.extent for q, k in pairs):
                biased += 2
            elif pairs:
                plain += 2
    assert warpgroup_steps(layer) == (plain * layer.kv_heads, biased * layer.kv_heads)
    # every visited block costs q @ K^T and P @ V; the biased ones A @ Tz too (K = n_tok * d_rel)
    per_key = 2 * 64 * keys
    assert executed_flops(layer) == per_key * layer.kv_heads * (
        plain * 2 * layer.dim + biased * (2 * layer.dim + n_tok * layer.d_rel))
