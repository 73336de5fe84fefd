"""ShortConv's prefill kernel and the fused decode-attention prologue (`pallas_kernels/shortconv`,
`pallas_kernels/attn_prologue`): their inputs and how a call is timed.

Each time is `timing.chained_seconds`: a jitted chain of dependent calls (no host launch between them, no fusion
across them); pools and caches are donated, so they update in place. Bytes count each input read once and each
output written once.
"""

import jax
import jax.numpy as jnp

from benchmarks.timing import chained_seconds

WIDTH = 4  # ShortConv taps
POOL_SLOTS, CACHE_SLOTS = 512, 16384  # the prologue's state pool and KV cache slots


def _normal(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def prefill_inputs(shape):
    """x [B, T, C] bf16 and w [C, 4] fp32 for the prefill, and the bytes a call moves."""
    batch, _, channels = shape
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = _normal(kx, shape), 0.1 * _normal(kw, (channels, WIDTH), jnp.float32)
    return x, w, 2 * x.size * 2 + w.size * 4 + batch * (WIDTH - 1) * channels * 2


def prefill_seconds(fn, x, w, reps):
    """Seconds per prefill call fn(x, w) -> (y, state), y feeding the next call's x (the state is carried
    along, so that it stays an output)."""
    state = jnp.zeros((x.shape[0], WIDTH - 1, x.shape[2]), x.dtype)
    return chained_seconds(lambda carry, w: fn(carry[0], w), (x, state), (w,), reps=reps, feed_back=False)


def scale_seconds(x, reps):
    """Seconds per jitted y = 2x over x: the copy roofline of the same bytes."""
    return chained_seconds(lambda x: x * 2, x, (), reps=reps, feed_back=False)


def prologue_inputs(tokens, heads, kv_heads, with_tau, head_dim, pool_slots=POOL_SLOTS, cache_slots=CACHE_SLOTS):
    """(constant arguments, state carried from call to call) of the prologue."""
    keys = iter(jax.random.split(jax.random.key(2), 16))
    kv = kv_heads * head_dim
    consts = dict(
        k_conv_w=0.01 * _normal(next(keys), (kv, WIDTH), jnp.float32),
        v_conv_w=0.01 * _normal(next(keys), (kv, WIDTH), jnp.float32), q_norm_w=_normal(next(keys), (head_dim,)),
        k_norm_w=_normal(next(keys), (head_dim,)),
        slots=jax.random.permutation(next(keys), pool_slots)[:tokens],
        write_idx=jax.random.permutation(next(keys), cache_slots)[:tokens],
        tau=1.0 + jax.random.uniform(next(keys), (tokens,)) if with_tau else None)
    state = dict(q=_normal(next(keys), (tokens, heads * head_dim)), k=_normal(next(keys), (tokens, kv)),
                 v=_normal(next(keys), (tokens, kv)), k_pool=_normal(next(keys), (pool_slots, WIDTH - 1, kv)),
                 v_pool=_normal(next(keys), (pool_slots, WIDTH - 1, kv)),
                 k_cache=_normal(next(keys), (cache_slots, kv_heads, head_dim)),
                 v_cache=_normal(next(keys), (cache_slots, kv_heads, head_dim)))
    return consts, state


def prologue_seconds(fn, consts, state, tokens, reps):
    """Seconds per prologue call: q, k, v out feed the next call's q, k, v; the pools and caches stay in place."""
    names = ("q", "k", "v", "k_pool", "v_pool", "k_cache", "v_cache")

    def step(carry, consts):
        out = fn(**consts, **carry)
        return {name: a.reshape(tokens, -1) if i < 3 else a for i, (name, a) in enumerate(zip(names, out))}
    return chained_seconds(step, jax.tree.map(jnp.copy, state), (consts,), reps=reps, feed_back=True)
