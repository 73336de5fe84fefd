"""The device ceilings the benchmarks divide by, measured in the same run, and the one timer they share.

- `median_seconds`: seconds per call of a (jitted) function, the median over trials after warm-up;
- `copy_bandwidth`: bytes/s of a jitted `y = 2x` over bf16, counting the bytes read and the bytes written;
- `read_bandwidth`: bytes/s of a jitted fp32-accumulated sum over bf16, counting the bytes read;
- `matmul_flops`: FLOP/s of a jitted bf16 n x n x n matmul;
- `decode_step_bytes`: the bytes a decode step of the model must read, the numerator of its achieved bytes/s.

The input data is an explicit argument, `data="ones"` or `data="normal"`, because it changes the result: the
H200's matmuls are power-limited, and constant inputs toggle fewer bits than random ones, so the same matmul
runs at a higher clock on ones. Each benchmark passes the kind its published numbers were measured with, so
that they keep their meaning. Every ceiling times `CALLS` back-to-back calls per trial, so that the host's
dispatch and wait are not charged to the device.

Run as a script, prints the three ceilings: `PYTHONPATH=. python bench/ceilings.py [--data ones|normal]`.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.nn.moe import MoE

DATA = ("ones", "normal")
CALLS = 5


def median_seconds(fn, *args, trials=10, warmup=1, calls=1):
    """Seconds per call of fn(*args): `warmup` calls first (the first compiles), then `trials` trials of `calls`
    back-to-back calls each, waiting for the device once at a trial's end; the median over trials of a trial's
    time / calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def filled(shape, *, data, seed=0):
    """A bf16 array of `shape`: all ones, or standard normal values."""
    if data == "ones":
        return jnp.ones(shape, jnp.bfloat16)
    if data == "normal":
        return jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    raise ValueError(f"data must be one of {DATA}, not {data!r}")


def copy_bandwidth(elements=1 << 30, *, data, trials=10):
    """Bytes read + written per second by a jitted y = 2x over `elements` bf16 values (default 2 GiB)."""
    x = filled((elements,), data=data)
    return 2 * x.nbytes / median_seconds(jax.jit(lambda a: a * 2), x, trials=trials, calls=CALLS)


def read_bandwidth(elements=1 << 30, *, data, trials=10):
    """Bytes read per second by a jitted sum (fp32 accumulation) over `elements` bf16 values (default 2 GiB)."""
    x = filled((elements,), data=data)
    seconds = median_seconds(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x, trials=trials, calls=CALLS)
    return x.nbytes / seconds


def matmul_flops(n=8192, *, data, trials=10):
    """FLOP/s (2 n^3 per call) of a jitted bf16 [n, n] @ [n, n] of two independent inputs."""
    a, b = filled((n, n), data=data, seed=1), filled((n, n), data=data, seed=2)
    return 2 * n ** 3 / median_seconds(jax.jit(lambda p, q: p @ q), a, b, trials=trials, calls=CALLS)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="normal", choices=DATA)
    parser.add_argument("--elements", type=int, default=1 << 30, help="bf16 values of the bandwidth ceilings")
    parser.add_argument("--n", type=int, default=8192, help="size of the square matmul")
    args = parser.parse_args()
    print(jax.devices()[0].device_kind, "jax", jax.__version__, "data", args.data)
    print(f"y = 2x (read + write): {copy_bandwidth(args.elements, data=args.data) / 1e9:.0f} GB/s")
    print(f"sum(x) (read):         {read_bandwidth(args.elements, data=args.data) / 1e9:.0f} GB/s")
    print(f"bf16 matmul {args.n}^3:   {matmul_flops(args.n, data=args.data) / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    main()


def decode_step_bytes(model, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` rows at `context` tokens must read at least: every text weight but
    the untouched experts' (the expected count of distinct experts hit by batch x top-k uniform picks) and the
    embedding table (one row per token), plus each row's K/V in use (sliding layers: at most the window)."""
    text = model.config.text
    item = model.dtype.itemsize
    total = 0
    params = {path: var for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}
    for path, var in params.items():
        if path[0] in ("vision", "audio", "mtp") or _is_twin(path, params):
            continue
        size = var.get_value().nbytes
        if path[-1] == "embed":
            size = batch * text.hidden_size * item
        elif path[-1] in ("w_gate", "w_up", "w_down", *MoE.ROUTED_FP8, *MoE.ROUTED_NVFP4) and (
                var.get_value().ndim >= 3):  # routed experts (the dense MLP's matrices share names, at rank 2)
            touched = text.num_experts * (1 - (1 - text.num_experts_per_tok / text.num_experts) ** batch)
            size = size * touched / text.num_experts
        total += size
    kv = 0
    for i in range(text.num_layers):
        shape = text.attention(text.is_local(i))
        tokens = min(context, shape.window) if shape.window else context
        kv += 2 * tokens * shape.num_kv_heads * shape.head_dim * item
    return int(total + batch * kv)


def _is_twin(path, params) -> bool:
    """An fp8 twin of NVFP4 weights (`InklingModel.add_fp8_twins`): only wide steps read it, never a decode step."""
    return path[-1] in ("twin_fp8", "twin_out_scale") or (
        path[-1] in MoE.ROUTED_FP8 and path[:-1] + (MoE.ROUTED_NVFP4[0],) in params)
