"""Relative flash attention at a layer's shape: ours (`pallas_kernels/rel_attention`), cuDNN plain attention
through `jax.nn.dot_product_attention` (no bias, the same mask) and torch FlexAttention with the same bias as a
score_mod. Each returns forward and forward+backward milliseconds.

Inkling's layers: batch 1, 8192 tokens, 64 query heads, head_dim 128, d_rel 16, bf16; full (8 KV heads, E 1024,
causal, log-scaling) and sliding (16 KV heads, window 512 = E). FLOPs: 4 * B * Hq * D per visible (query, key)
pair, the bias not counted. Functions take a `Layer`, so that tiny layers run on CPU too.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_seconds
from pallas_kernels.rel_attention import kernel


@dataclasses.dataclass(frozen=True)
class Layer:
    kv_heads: int
    extent: int
    window: int | None  # None: full causal attention
    batch: int = 1
    tokens: int = 8192
    heads: int = 64
    dim: int = 128
    d_rel: int = 16

    def flops(self):
        """4 * B * Hq * D per visible (query, key) pair, bias not counted."""
        t, w = self.tokens, self.window
        pairs = t * (t + 1) / 2 if w is None else t * w - w * (w - 1) / 2
        return 4 * self.batch * self.heads * pairs * self.dim


LAYERS = {"full": Layer(kv_heads=8, extent=1024, window=None), "sliding": Layer(kv_heads=16, extent=512, window=512)}


@dataclasses.dataclass(frozen=True)
class Timing:
    """How each attention call is timed: `trials` trials of `calls` back-to-back calls, after one warm-up."""
    trials: int = 3
    calls: int = 5

    def ms(self, fn, *args):
        return 1e3 * median_seconds(fn, *args, trials=self.trials, calls=self.calls)


def inputs(layer, seed=0):
    """(q, k, v, r, P), tau (None on sliding layers) and an output cotangent, bf16."""
    b, t, h, d = layer.batch, layer.tokens, layer.heads, layer.dim
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, layer.kv_heads, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, layer.kv_heads, d), jnp.bfloat16)
    r = (0.5 * jax.random.normal(keys[3], (b, t, h, layer.d_rel))).astype(jnp.bfloat16)
    p = jax.random.normal(keys[4], (layer.d_rel, layer.extent), jnp.bfloat16)
    pos = jnp.arange(t, dtype=jnp.float32)
    tau = jnp.broadcast_to(1.0 + 0.1 * jnp.log(jnp.maximum(1.0, (pos + 1) / 128000.0)), (b, t))
    tau = tau if layer.window is None else None
    return (q, k, v, r, p), tau, jax.random.normal(keys[5], (b, t, h, d), jnp.bfloat16)


def ours(layer, timing, interpret=None):
    """Our kernels' forward and forward+backward times (ms), with the tiles `rel_flash_attention` picks."""
    (q, k, v, r, p), tau, ct = inputs(layer)
    geos, args = kernel.plan(q, k, v, r, p, q_offset=0, window=layer.window, tau=tau, segment_ids=None,
                             scale=None, interpret=interpret)
    fwd = jax.jit(lambda *a: kernel.padded_attention(geos, *a))
    fwd_bwd = jax.jit(lambda *a: jax.vjp(lambda *x: kernel.padded_attention(geos, *x, *a[5:]), *a[:5])[1](ct))
    return {"fwd_ms": timing.ms(fwd, *args), "fwd_bwd_ms": timing.ms(fwd_bwd, *args),
            "blocks": [str(g.blocks) for g in geos if g is not None]}


def cudnn(layer, timing, implementation="cudnn"):
    """jax.nn.dot_product_attention without the bias, same causal / window mask (implementation None: XLA's):
    forward and forward+backward ms."""
    (q, k, v, _, _), _, ct = inputs(layer)
    window = None if layer.window is None else (layer.window - 1, 0)

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=1.0 / layer.dim, is_causal=True,
                                            local_window_size=window, implementation=implementation)
    fwd_bwd = jax.jit(lambda q, k, v: jax.vjp(attn, q, k, v)[1](ct))
    return {"fwd_ms": timing.ms(jax.jit(attn), q, k, v), "fwd_bwd_ms": timing.ms(fwd_bwd, q, k, v)}


def torch_ms(fn, trials):
    """Median ms of fn(): triton's do_bench on CUDA, a plain loop of `trials` calls after one on CPU."""
    import torch
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def flex(layer, timing):
    """torch FlexAttention with the same bias as a score_mod: forward and forward+backward ms. Compiled on CUDA;
    eager and forward only on CPU (Flex has no CPU backward). Needs no JAX, so it runs in a child process."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    cuda = torch.cuda.is_available()
    run_flex = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
    dev, bf = ("cuda" if cuda else "cpu"), torch.bfloat16
    b, t, h, d = layer.batch, layer.tokens, layer.heads, layer.dim
    hkv, extent, window = layer.kv_heads, layer.extent, layer.window
    q = torch.randn(b, h, t, d, device=dev, dtype=bf, requires_grad=cuda)
    k = torch.randn(b, hkv, t, d, device=dev, dtype=bf, requires_grad=cuda)
    v = torch.randn(b, hkv, t, d, device=dev, dtype=bf, requires_grad=cuda)
    r = torch.randn(b, t, h, layer.d_rel, device=dev, dtype=bf)
    p = torch.randn(layer.d_rel, extent, device=dev, dtype=bf)
    rel = torch.einsum("bthd,de->bhte", r, p)

    def mask(b, h, qi, ki):
        return (qi >= ki) if window is None else ((qi >= ki) & (qi - ki < window))

    def score(s, b, h, qi, ki):
        d = qi - ki
        return s + torch.where(d < extent, rel[b, h, qi, torch.clamp(d, 0, extent - 1)].float(), 0.0)

    block = 128 if t % 128 == 0 else t  # create_block_mask's default block is 128
    block_mask = create_block_mask(mask, None, None, t, t, device=dev, BLOCK_SIZE=block)

    def run():
        return run_flex(q, k, v, score_mod=score, block_mask=block_mask, scale=1.0 / d, enable_gqa=True)

    with torch.no_grad():
        fwd = torch_ms(run, timing.trials)
    if not cuda:
        return {"fwd_ms": fwd, "fwd_bwd_ms": None}
    grad = torch.randn(b, h, t, d, device=dev, dtype=bf)
    fwd_bwd = torch_ms(lambda: torch.autograd.grad(run(), (q, k, v), grad), timing.trials)
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}
