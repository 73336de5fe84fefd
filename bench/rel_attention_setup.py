"""What the relative-attention benchmarks share: Inkling's two layer shapes, inputs, timing, measured ceilings.

Layers: batch 1, 8192 tokens, 64 query heads, head_dim 128, d_rel 16, bf16; full (8 KV heads, E 1024, causal) and
sliding (16 KV heads, window 512 = E). FLOPs: 4 * B * Hq * D per visible (query, key) pair (causal / windowed
pairs only; bias FLOPs not counted). Functions take a `Layer`, so that tiny layers work on CPU too.
"""

import dataclasses
import gc
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # the rest is torch's, for FlexAttention

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.ceilings import copy_bandwidth, matmul_flops  # noqa: E402
from pallas_kernels.rel_attention import kernel  # noqa: E402


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

    @property
    def groups(self):
        return self.heads // self.kv_heads

    def flops(self):
        """4 * B * Hq * D per visible (query, key) pair, bias not counted."""
        t, w = self.tokens, self.window
        pairs = t * (t + 1) / 2 if w is None else t * w - w * (w - 1) / 2
        return 4 * self.batch * self.heads * pairs * self.dim


LAYERS = {"full": Layer(kv_heads=8, extent=1024, window=None), "sliding": Layer(kv_heads=16, extent=512, window=512)}
START = time.time()
RESULTS = {"jax": jax.__version__}
TIMING = {"reps": 5, "rounds": 3}  # bench/kernels.py --smoke lowers these


def log(*a):
    print(f"[{time.time() - START:6.1f}s]", *a)
    sys.stdout.flush()


def guarded(label, fn):
    """fn(), or a logged failure: one failure must not cost the rest of the run."""
    try:
        fn()
    except Exception as e:  # report and go on
        log(f"{label} FAILED {type(e).__name__}: {str(e)[:600]}")
    gc.collect()


def save(name="rel_attention.json"):
    """RESULTS as JSON into $OUT, when it is set."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def time_ms(fn, *args):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(TIMING["rounds"]):
        t = time.perf_counter()
        for _ in range(TIMING["reps"]):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / TIMING["reps"])
    return 1e3 * float(np.median(times))


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


def prepared(layer, blocks=None, interpret=None, seed=0):
    """Geometries (one per Blocks; by default the tiles `rel_flash_attention` picks: the Mosaic GPU forward's
    where it applies), padded kernel operands and the cotangent of one layer's call."""
    (q, k, v, r, p), tau, ct = inputs(layer, seed)
    kwargs = dict(q_offset=0, window=layer.window, tau=tau, segment_ids=None, scale=None, interpret=interpret)
    if blocks is None:
        geos, args = kernel.plan(q, k, v, r, p, **kwargs)
    else:
        geos, args = kernel.prepare(q, k, v, r, p, blocks=blocks, **kwargs)
    return geos, args, ct


def rooflines(matmul_n=8192, copy_elems=512 * 1024 * 1024):
    """Measured XLA bf16 matmul TFLOP/s and y = 2x GB/s (bench/ceilings.py, random inputs), stored in RESULTS."""
    RESULTS["matmul_tflops"] = matmul_flops(matmul_n, data="normal", trials=3) / 1e12
    RESULTS["copy_gbs"] = copy_bandwidth(copy_elems, data="normal", trials=3) / 1e9
    log(f"XLA bf16 matmul {matmul_n}^3: {RESULTS['matmul_tflops']:.0f} TFLOP/s; "
        f"y=2x copy: {RESULTS['copy_gbs']:.0f} GB/s")
