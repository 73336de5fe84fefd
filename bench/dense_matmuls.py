"""The decode step's dense (XLA) matmuls at the `bench` preset's widths, alone: [rows, in] @ [in, out] in bf16
for every weight a layer multiplies outside the MoE kernels, with XLA's own choice of gemm kernel and with
cuBLAS only (`xla_gpu_enable_triton_gemm` off), against the read bandwidth measured in the same run. A decode
step is bound by reading these weights, so bytes/s of the weight is the figure of merit.

With --fp8, also e4m3 weights with one fp32 scale per output column: "fp8 w-only" multiplies x by the weight
converted to bf16 (XLA may fuse the convert into its gemm, so that only fp8 bytes are read), "fp8 w8a8" first
quantises x per row and runs an fp8 x fp8 dot (the weight stored [out, in], as fp8 tensor cores read it).

With --nvfp4, also NVFP4 weights through the W4A16 kernel, as the model multiplies them
(inkling_jax/quant/dense_nvfp4.py). The LM head is not run in NVFP4 (the model keeps it in fp8).

Each case multiplies enough copies of its weight (> 4x the 50 MB L2) in one jitted program that every product
reads its weight from HBM, as the decode step does, with no host dispatch between them.

    PYTHONPATH=. python bench/dense_matmuls.py [--rows 1 8 32 128] [--fp8] [--nvfp4] [--out DIR]
"""

import argparse
import os

import jax
import jax.numpy as jnp

from bench.ceilings import median_seconds, read_bandwidth
from inkling_jax import preset
from inkling_jax.backend import Backend
from inkling_jax.quant import dense_fp8, dense_nvfp4


def _fp8(w):
    """w [in, out] -> (e4m3 [out, in], fp32 scale [out]), as the model holds fp8 dense weights."""
    return dense_fp8.quantize(w, transpose=True)


def _fp8_in_out(w):
    """The same values stored [in, out], as a bf16 weight is."""
    values, scale = _fp8(w)
    return values.T, scale


def _weight_only(x, wq):
    """x @ the fp8 values converted to x's dtype in the program, then the column scales."""
    values, scale = wq
    return ((x @ values.astype(x.dtype)).astype(jnp.float32) * scale).astype(x.dtype)


# name: (compiler options, weight -> operand, product, bytes per weight element)
BF16 = {"xla": (None, None, jnp.matmul, 2), "cublas": ({"xla_gpu_enable_triton_gemm": False}, None, jnp.matmul, 2)}
FP8 = {"fp8 w-only": (None, _fp8_in_out, _weight_only, 1),
       "fp8 w8a8": (None, _fp8, lambda x, wq: dense_fp8.matmul(x, *wq), 1)}
NVFP4_BYTES = 0.5 + 2 / 16  # per value: the e2m1 code and its share of an f16 block scale
COPY_BYTES = 256 << 20


def _nvfp4_prepare(w):
    linear = dense_nvfp4.Nvfp4Linear.quantize(w)
    return linear.nvfp4_codes[...], linear.nvfp4_scales[...], linear.nvfp4_scale2[...]


NVFP4 = {"nvfp4": (None, _nvfp4_prepare, lambda x, w: dense_nvfp4.matmul(x, *w, backend=Backend(moe="pallas")),
                   NVFP4_BYTES)}


def weights(text) -> list[tuple[str, int, int, int]]:
    """(name, in, out, times per decode step) of the dense matmuls of the preset's layers as the server runs
    them (`InklingModel.fuse_projections`): one q|k|v|r map per attention, one gate|up matrix per dense MLP, the
    shared experts widened into one MLP of width S x I (`MoE.widen_shared_experts`)."""
    local = sum(text.is_local(i) for i in range(text.num_layers))
    full = text.num_layers - local
    dense = len(text.dense_layer_ids)
    moe = text.num_layers - dense
    h, q, r = text.hidden_size, text.num_heads * text.head_dim, text.num_heads * text.d_rel
    kv_local, kv_full = text.swa_num_kv_heads * text.swa_head_dim, text.num_kv_heads * text.head_dim
    shared = text.num_shared_experts * text.moe_intermediate_size
    rows = [("q|k|v|r (sliding)", h, q + 2 * kv_local + r, local), ("q|k|v|r (full)", h, q + 2 * kv_full + r, full),
            ("wo", q, h, text.num_layers), ("dense gate|up", h, 2 * text.dense_intermediate_size, dense),
            ("dense down", text.dense_intermediate_size, h, dense), ("shared gate|up", h, 2 * shared, moe),
            ("shared down", shared, h, moe), ("unembed (LM head)", h, text.vocab_size, 1)]
    return [w for w in rows if w[3]]


def seconds_per_product(variant, xs, ws):
    """One program of len(ws) products xs[i] @ ws[i] (distinct inputs, so XLA merges none of them)."""
    options, prepare, product, _ = variant
    if prepare is not None:
        ws = [prepare(w) for w in ws]
    fn = jax.jit(lambda a, b: [product(a[i], w) for i, w in enumerate(b)], compiler_options=options)
    seconds = median_seconds(fn, xs, ws, trials=5, calls=3) / len(ws)
    del ws
    return seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--fp8", action="store_true", help="also fp8 weights (one scale per output column)")
    parser.add_argument("--nvfp4", action="store_true", help="also NVFP4 weights (the W4A16 kernel)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="also write dense_matmuls.md here")
    args = parser.parse_args()
    variants = {**BF16, **(FP8 if args.fp8 else {})}
    if args.nvfp4:
        variants.update(NVFP4)
    text = preset("bench").text
    read = read_bandwidth(data="normal")
    lines = [f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; read bandwidth {read / 1e9:.0f} GB/s",
             "", "| weight | in x out | per step | rows | " + " | ".join(f"{v} us (of read)" for v in variants) + " |",
             "|---|---|---:|---:|" + "---:|" * len(variants)]
    step = {(rows, v): 0.0 for rows in args.rows for v in variants}
    key = jax.random.key(0)
    smallest = min(v[3] for v in variants.values())  # bytes per value of the smallest form: enough copies of it
    for name, n_in, n_out, count in weights(text):
        nbytes = 2 * n_in * n_out
        ws = [jax.random.normal(jax.random.fold_in(key, i), (n_in, n_out), jnp.bfloat16)
              for i in range(max(2, -(-COPY_BYTES // int(n_in * n_out * smallest))))]
        for rows in args.rows:
            xs = jax.random.normal(key, (len(ws), rows, n_in), jnp.bfloat16)
            cells = []
            for name_v, variant in variants.items():
                if name_v == "nvfp4" and name.startswith("unembed"):
                    cells.append("-")
                    continue
                seconds = seconds_per_product(variant, xs, ws)
                step[rows, name_v] += count * seconds
                cells.append(f"{seconds * 1e6:.1f} ({nbytes * variant[3] / 2 / seconds / read:.2f})")
            lines.append(f"| {name} | {n_in} x {n_out} | {count} | {rows} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        del ws
    lines.append("")
    for rows in args.rows:
        lines.append(f"rows {rows}: one decode step's dense matmuls " + ", ".join(
            f"{v} {step[rows, v] * 1e3:.3f} ms" + (" (without the LM head)" if v == "nvfp4" else "")
            for v in variants))
    print("\n".join(lines))
    if args.out:
        with open(os.path.join(args.out, "dense_matmuls.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
