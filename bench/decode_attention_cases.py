"""Decode attention cases at Inkling's shapes: cache shapes, random inputs, the jitted kernel and reference
calls and their timer. bench/decode_attention.py and bench/kernels.py measure these (also tiny, on CPU)."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from bench.ceilings import median_seconds
from pallas_kernels.decode_attention import contiguous_as_pages, paged_decode_attention, ring_decode_attention

HEADS, DIM, D_REL, EXTENT_FULL, WINDOW = 64, 128, 16, 1024, 512
KV_FULL, KV_RING, CONTEXT, PAGE = 8, 16, 8192, 128


@dataclasses.dataclass(frozen=True)
class CacheShape:
    kv_heads: int
    context: int  # keys per sequence: the full context (paged) or the window (ring)
    extent: int
    heads: int = HEADS
    dim: int = DIM
    d_rel: int = D_REL
    page: int = PAGE

    def kv_bytes(self, batch):
        """K + V bytes (bf16) of every visible key."""
        return 2 * batch * self.context * self.kv_heads * self.dim * 2


PAGED = CacheShape(kv_heads=KV_FULL, context=CONTEXT, extent=EXTENT_FULL)
RING = CacheShape(kv_heads=KV_RING, context=WINDOW, extent=WINDOW)
L2_DEFEAT_BYTES = 256 << 20  # rotate input copies until this many bytes: the H200's L2 is 60 MB


def copies_for(nbytes):
    return max(1, min(64, math.ceil(L2_DEFEAT_BYTES / nbytes)))


def normal(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(key, shape, dtype)


def paged_inputs(key, batch, shuffle, copies, shape=PAGED):
    """`copies` independent caches [B*L/page, page, Hkv, D] (contiguous layout, identity or shuffled table),
    every sequence full."""
    sets = []
    dense = (batch, shape.context, shape.kv_heads, shape.dim)
    for c in range(copies):
        ks = jax.random.split(jax.random.fold_in(key, c), 6)
        k_pages, table = contiguous_as_pages(normal(ks[0], dense), shape.page)
        v_pages, _ = contiguous_as_pages(normal(ks[1], dense), shape.page)
        if shuffle:
            table = jax.random.permutation(ks[2], table.size).reshape(table.shape).astype(jnp.int32)
        lengths = jnp.full((batch,), shape.context, jnp.int32)
        tau = 1.0 + 0.1 * jnp.log(jnp.maximum(1.0, lengths / 128000.0))
        sets.append((normal(ks[3], (batch, shape.heads, shape.dim)), k_pages, v_pages, table, lengths,
                     normal(ks[4], (batch, shape.heads, shape.d_rel)), normal(ks[5], (shape.d_rel, shape.extent)),
                     tau))
    return sets


def ring_inputs(batch, copies, shape=RING):
    """`copies` independent rings [B, window, Hkv, D], each sequence 7893..8192 tokens long (rings wrapped)."""
    sets = []
    ring = (batch, shape.context, shape.kv_heads, shape.dim)
    for c in range(copies):
        ks = jax.random.split(jax.random.fold_in(jax.random.key(100 + batch), c), 6)
        sets.append((normal(ks[0], (batch, shape.heads, shape.dim)), normal(ks[1], ring), normal(ks[2], ring),
                     CONTEXT - jax.random.randint(ks[3], (batch,), 0, 300, jnp.int32),
                     normal(ks[4], (batch, shape.heads, shape.d_rel)), normal(ks[5], (shape.d_rel, shape.extent))))
    return sets


def ring_fn(impl=ring_decode_attention, shape=RING, **launch):
    """jit of impl over the positional tuples of `ring_inputs` (the window is the ring's length)."""
    return jax.jit(functools.partial(impl, window=shape.context, **launch))


def cudnn_decode_ms(q, k, v, implementation="cudnn"):
    """jax.nn.dot_product_attention of one query per sequence over dense k, v [B, S, Hkv, D], no bias."""
    return timed_ms(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q[:, None], k, v, implementation=implementation)), [(q, k, v)])


def paged_fn(impl=paged_decode_attention, **launch):
    """jit of impl over the positional tuples of `paged_inputs` (tau is keyword-only)."""
    def run(q, k, v, table, lengths, r, p, tau):
        return impl(q, k, v, table, lengths, r, p, tau=tau, **launch)
    return jax.jit(run)


def timed_ms(fn, arg_sets, reps=5):
    """Median over reps of the time per call of fn. One jitted step runs fn on every input set in turn, so host
    dispatch is amortised over len(arg_sets) calls, as inside a model's decode step (warm-up first)."""
    step = jax.jit(lambda sets: [fn(*args) for args in sets])
    calls = max(5, math.ceil(20 / len(arg_sets)))
    return median_seconds(step, arg_sets, trials=reps, calls=calls) / len(arg_sets) * 1e3
