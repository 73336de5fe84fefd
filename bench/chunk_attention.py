"""Prefill chunks over a KV cache (`pallas_kernels/rel_attention/chunk.py`, what the serving engine's prefill runs)
on one GPU, at Inkling's attention shapes (64 query heads, head_dim 128, d_rel 16; full layer: 8 KV heads, E
1024, log-scaling; sliding layer: 16 KV heads, window 512), against the dense jnp reference that the engine ran
before (`reference.chunk_attention`: [B, H, T, S] logits) and the bf16 matmul rate measured in the same run.

    PYTHONPATH=. python bench/chunk_attention.py [--out DIR] [--sweep]

--sweep times other tiles (rows, keys, warps, stages) of the kernel at the first two cases instead.

Cases are (rows, chunk tokens, tokens already cached): the serve bench's prefill (32 prompts of 128 tokens), then
chunks of 256 tokens continuing caches of 4k, 32k and 128k tokens (16-token pages, shuffled). TFLOP/s count
4 * head_dim * query heads per visible (query, key) pair (the bias not counted). "err" is the kernel's largest
difference from the fp32 reference relative to the reference's largest value, where the reference ran.
"""

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.ceilings import matmul_flops, median_seconds  # noqa: E402
from pallas_kernels.rel_attention import chunk_attention, rel_chunk_attention, tuning  # noqa: E402

HEADS, DIM, D_REL, PAGE = 64, 128, 16, 16
LAYERS = {"full": dict(kv_heads=8, extent=1024, window=None), "sliding": dict(kv_heads=16, extent=512, window=512)}
CASES = [(32, 128, 0), (8, 256, 4096), (1, 256, 32768), (4, 256, 131072)]
SWEEP = [(128, 64, 8, 3), (64, 64, 4, 2), (128, 128, 8, 2), (128, 64, 4, 2), (64, 128, 4, 2), (256, 64, 8, 2),
         (128, 32, 4, 3), (64, 32, 4, 3)]


def inputs(layer, rows, seq, cached, seed=0):
    """(q, k_pages, v_pages, table, r, P) and the bounds of a case, in the engine's layout for the layer kind."""
    kv_heads, extent, window = LAYERS[layer]["kv_heads"], LAYERS[layer]["extent"], LAYERS[layer]["window"]
    keys = jax.random.split(jax.random.key(seed), 5)
    normal = lambda key, scale, *shape: (scale * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
    if window is None:  # the paged cache: every row's pages, shuffled
        per_row = -(-(cached + seq) // PAGE)
        table = jax.random.permutation(keys[0], rows * per_row).reshape(rows, per_row).astype(jnp.int32)
        shape = (rows * per_row, PAGE, kv_heads, DIM)
        bounds = (jnp.full((rows,), cached), jnp.zeros((rows,)), jnp.full((rows,), cached + seq))
    else:  # [ring | chunk], one page per row
        table = jnp.arange(rows, dtype=jnp.int32)[:, None]
        shape = (rows, window + seq, kv_heads, DIM)
        bounds = (jnp.full((rows,), window), jnp.full((rows,), window - min(cached, window)),
                  jnp.full((rows,), window + seq))
    operands = (normal(keys[1], 1.0, rows, seq, HEADS, DIM), normal(keys[2], 1.0, *shape),
                normal(keys[3], 1.0, *shape), table, normal(keys[4], 0.5, rows, seq, HEADS, D_REL),
                normal(keys[0], 1.0, D_REL, extent))
    # log-scaling on full layers: a factor just above 1 at long positions
    tau = jnp.full((rows, seq), 1.05, jnp.float32) if window is None else None
    kwargs = dict(q_start=bounds[0].astype(jnp.int32), key_start=bounds[1].astype(jnp.int32),
                  key_end=bounds[2].astype(jnp.int32), window=window, tau=tau)
    return operands, kwargs


def visible_pairs(layer, rows, seq, cached):
    t = np.arange(seq)
    seen = cached + t + 1
    window = LAYERS[layer]["window"]
    return rows * int(np.minimum(seen, window).sum() if window else seen.sum())


def sweep(peak):
    """Other tiles at the first two cases."""
    lines = [f"{'layer':8} {'rows x chunk after cached':>26} {'rows/keys/warps/stages':>22} {'ms':>8} {'of mm':>6}"]
    for layer in LAYERS:
        groups = HEADS // LAYERS[layer]["kv_heads"]
        for rows, seq, cached in CASES[:2]:
            operands, kwargs = inputs(layer, rows, seq, cached)
            for shape in SWEEP:
                blocks = tuning.as_blocks(shape, groups)
                seconds = median_seconds(jax.jit(lambda *x, kw=kwargs, b=blocks: rel_chunk_attention(
                    *x, blocks=b, **kw)), *operands, trials=5, calls=5)
                flops = 4 * DIM * HEADS * visible_pairs(layer, rows, seq, cached) / seconds
                lines.append(f"{layer:8} {f'{rows} x {seq} after {cached}':>26} {'/'.join(map(str, shape)):>22} "
                             f"{seconds * 1e3:8.3f} {flops / peak:6.2f}")
                print(lines[-1], flush=True)
    return lines


def table(peak):
    """The cases against the dense reference."""
    lines = [f"{'layer':8} {'rows x chunk after cached':>26} {'kernel ms':>10} {'TFLOP/s':>8} {'of mm':>6} "
             f"{'dense jnp ms':>13} {'jnp / kernel':>12} {'err':>8}"]
    for layer in LAYERS:
        for rows, seq, cached in CASES:
            operands, kwargs = inputs(layer, rows, seq, cached)
            kernel = jax.jit(lambda *x, kw=kwargs: rel_chunk_attention(*x, **kw))
            seconds = median_seconds(kernel, *operands, trials=5, calls=5)
            flops = 4 * DIM * HEADS * visible_pairs(layer, rows, seq, cached) / seconds
            try:
                dense = jax.jit(lambda *x, kw=kwargs: chunk_attention(*x, **kw))
                dense_ms = f"{median_seconds(dense, *operands, trials=3, calls=2) * 1e3:13.3f}"
                ratio = f"{float(dense_ms) / (seconds * 1e3):12.1f}"
                with jax.default_matmul_precision("highest"):
                    want = jax.jit(lambda *x, kw=kwargs: chunk_attention(
                        *[y.astype(jnp.float32) if y.dtype == jnp.bfloat16 else y for y in x], **kw))(*operands)
                got = kernel(*operands).astype(jnp.float32)
                err = f"{float(jnp.abs(got - want).max() / jnp.abs(want).max()):8.1e}"
                del want, got
            except Exception as exc:  # noqa: BLE001 - the dense path runs out of memory at long caches
                if "RESOURCE_EXHAUSTED" not in str(exc) and "out of memory" not in str(exc).lower():
                    raise
                dense_ms, ratio, err = f"{'out of memory':>13}", f"{'':12}", f"{'':8}"
            lines.append(f"{layer:8} {f'{rows} x {seq} after {cached}':>26} {seconds * 1e3:10.3f} "
                         f"{flops / 1e12:8.1f} {flops / peak:6.2f} {dense_ms} {ratio} {err}")
            print(lines[-1], flush=True)
            del operands
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="directory for chunk_attention.txt (chunk_attention_sweep.txt with --sweep)")
    parser.add_argument("--sweep", action="store_true", help="time other tiles instead")
    args = parser.parse_args()
    peak = matmul_flops(data="ones")
    lines = [f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; bf16 matmul {peak / 1e12:.0f} TFLOP/s"]
    lines += sweep(peak) if args.sweep else table(peak)
    print("\n".join(lines))
    if args.out:
        with open(os.path.join(args.out, "chunk_attention_sweep.txt" if args.sweep else "chunk_attention.txt"),
                  "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
