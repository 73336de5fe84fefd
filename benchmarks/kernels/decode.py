"""Decode attention at a cache's shape: the paged kernel (full layers) and the ring kernel (sliding layers) of
`pallas_kernels/decode_attention`, their inputs, and cuDNN's plain decode attention (no bias) as the peer.

Inkling's shapes: Hq 64, D 128, d_rel 16, bf16; paged: context 8192 (every sequence full), pages of 128, Hkv 8,
E 1024, the page table shuffled; ring: window 512 = E, Hkv 16, sequences 7893..8192 tokens long (rings wrapped).
KV bytes are the K + V bytes of every visible key.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from benchmarks.timing import median_seconds
from pallas_kernels.decode_attention import contiguous_as_pages, paged_decode_attention, ring_decode_attention

L2_DEFEAT_BYTES = 256 << 20  # rotate input copies until this many bytes: an H200's L2 is 60 MB


@dataclasses.dataclass(frozen=True)
class CacheShape:
    kv_heads: int
    context: int  # keys per sequence: the full context (paged) or the window (ring)
    extent: int
    heads: int = 64
    dim: int = 128
    d_rel: int = 16
    page: int = 128
    sequence: int = 8192  # the ring's sequences are about this long

    def kv_bytes(self, batch):
        """K + V bytes (bf16) of every visible key."""
        return 2 * batch * self.context * self.kv_heads * self.dim * 2


PAGED = CacheShape(kv_heads=8, context=8192, extent=1024)
RING = CacheShape(kv_heads=16, context=512, extent=512)


def copies_for(nbytes):
    """Input copies to rotate through so that each call reads its cache from memory, not from L2."""
    return max(1, min(64, math.ceil(L2_DEFEAT_BYTES / nbytes)))


def _normal(key, shape):
    return jax.random.normal(key, shape, jnp.bfloat16)


def paged_inputs(key, batch, copies, shape=PAGED):
    """`copies` independent caches [B*L/page, page, Hkv, D] with shuffled page tables, every sequence full."""
    sets = []
    dense = (batch, shape.context, shape.kv_heads, shape.dim)
    for c in range(copies):
        ks = jax.random.split(jax.random.fold_in(key, c), 6)
        k_pages, table = contiguous_as_pages(_normal(ks[0], dense), shape.page)
        v_pages, _ = contiguous_as_pages(_normal(ks[1], dense), shape.page)
        table = jax.random.permutation(ks[2], table.size).reshape(table.shape).astype(jnp.int32)
        lengths = jnp.full((batch,), shape.context, jnp.int32)
        tau = 1.0 + 0.1 * jnp.log(jnp.maximum(1.0, lengths / 128000.0))
        sets.append((_normal(ks[3], (batch, shape.heads, shape.dim)), k_pages, v_pages, table, lengths,
                     _normal(ks[4], (batch, shape.heads, shape.d_rel)), _normal(ks[5], (shape.d_rel, shape.extent)),
                     tau))
    return sets


def ring_inputs(batch, copies, shape=RING):
    """`copies` independent rings [B, window, Hkv, D], each sequence up to 300 tokens short of `shape.sequence`."""
    sets = []
    ring = (batch, shape.context, shape.kv_heads, shape.dim)
    for c in range(copies):
        ks = jax.random.split(jax.random.fold_in(jax.random.key(100 + batch), c), 6)
        sets.append((_normal(ks[0], (batch, shape.heads, shape.dim)), _normal(ks[1], ring), _normal(ks[2], ring),
                     shape.sequence - jax.random.randint(ks[3], (batch,), 0, 300, jnp.int32),
                     _normal(ks[4], (batch, shape.heads, shape.d_rel)), _normal(ks[5], (shape.d_rel, shape.extent))))
    return sets


def ring_fn(shape=RING):
    """jit of the ring kernel over the positional tuples of `ring_inputs` (the window is the ring's length)."""
    return jax.jit(functools.partial(ring_decode_attention, window=shape.context))


def paged_fn():
    """jit of the paged kernel over the positional tuples of `paged_inputs` (tau is keyword-only)."""
    def run(q, k, v, table, lengths, r, p, tau):
        return paged_decode_attention(q, k, v, table, lengths, r, p, tau=tau)
    return jax.jit(run)


def timed_ms(fn, arg_sets, trials=5):
    """Median over trials of the time per call of fn. One jitted step runs fn on every input set in turn, so host
    dispatch is amortised over len(arg_sets) calls, as inside a model's decode step (warm-up first)."""
    step = jax.jit(lambda sets: [fn(*args) for args in sets])
    calls = max(5, math.ceil(20 / len(arg_sets)))
    return median_seconds(step, arg_sets, trials=trials, calls=calls) / len(arg_sets) * 1e3


def cudnn_decode_ms(q, k, v, implementation="cudnn"):
    """jax.nn.dot_product_attention of one query per sequence over dense k, v [B, S, Hkv, D], no bias
    (implementation None: XLA's)."""
    return timed_ms(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q[:, None], k, v, implementation=implementation)), [(q, k, v)])
