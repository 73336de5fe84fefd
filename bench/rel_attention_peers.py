"""The relative-attention benchmarks' peers: cuDNN plain attention through jax.nn.dot_product_attention (no bias,
same mask) and torch FlexAttention with the same bias as a score_mod (as in shared/peers/inkling_peers.py)."""

import time

import jax
import numpy as np

from bench.rel_attention_setup import RESULTS, TIMING, inputs, time_ms


def cudnn(layer, implementation="cudnn", backward=True):
    """jax.nn.dot_product_attention without the bias, same causal / window mask (implementation=None: XLA): fwd
    and fwd+bwd ms (None when not `backward`)."""
    (q, k, v, _, _), _, ct = inputs(layer)
    window = None if layer.window is None else (layer.window - 1, 0)

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=1.0 / layer.dim, is_causal=True,
                                            local_window_size=window, implementation=implementation)
    fwd_bwd = jax.jit(lambda q, k, v: jax.vjp(attn, q, k, v)[1](ct))
    return {"fwd_ms": time_ms(jax.jit(attn), q, k, v),
            "fwd_bwd_ms": time_ms(fwd_bwd, q, k, v) if backward else None}


def torch_ms(fn):
    """Median ms of fn(): triton's do_bench on CUDA, a plain loop on CPU (smoke runs)."""
    import torch
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(TIMING["rounds"]):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def flex(layer, backward=True):
    """torch FlexAttention with the same bias as a score_mod (as in shared/peers/inkling_peers.py): fwd and
    fwd+bwd ms (None when not `backward`). Compiled on CUDA; eager and forward only on CPU (smoke runs: Flex has
    no CPU backward). Needs no JAX, so it can run in a child process."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    RESULTS["torch"] = torch.__version__
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
    run = lambda: run_flex(q, k, v, score_mod=score, block_mask=block_mask, scale=1.0 / d, enable_gqa=True)
    with torch.no_grad():
        fwd = torch_ms(run)
    if not (cuda and backward):
        return {"fwd_ms": fwd, "fwd_bwd_ms": None}
    grad = torch.randn(b, h, t, d, device=dev, dtype=bf)
    fwd_bwd = torch_ms(lambda: torch.autograd.grad(run(), (q, k, v), grad))
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}
