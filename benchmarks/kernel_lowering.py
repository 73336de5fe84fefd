"""Start-up time of the Mosaic GPU kernels: a serving engine's step programs traced and lowered for CUDA (nothing
compiled, so it runs on a CPU too), three ways:

- per program: every kernel lowered again in each program that holds it (the launchers' exports and jax's traces
  dropped before each program, so that each exports its own; the export's serialisation adds a little to what a
  plain lowering costs);
- once per process: `pallas_kernels.lowered_once`, as the server runs;
- from disk: a second process with the exports in the compilation cache folder (here a fresh temporary one,
  written by the pass before and read back after everything in memory is dropped).

    python -m benchmarks.kernel_lowering --expert-precision nvfp4 --dense-precision nvfp4 --fp8-twins --out DIR

The programs are decode steps at the row buckets and prefill chunks at the chunk buckets of a server at its
defaults (`--decode-rows`, `--chunk-tokens`), with abstract weights (nothing is allocated). Printed: seconds per
pass and each pass over the per-program one.
"""

import argparse
import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.timing import save_json, stamp, stamp_line
from inkling_jax import Backend, InklingModel, preset
from inkling_jax.generate import flat_params
from inkling_jax.quant import QuantConfig, serving_view
from pallas_kernels.moe import kernel, kernel_w4, kernel_wgrad

LAUNCHERS = (kernel.gmm_kernel, kernel_w4.w4_gmm, kernel_wgrad.tgmm_kernel)


def step_shapes(decode_rows, chunk_tokens, max_tokens: int) -> list[tuple[int, int]]:
    """(rows, tokens per row) of the decode steps and of the prefill chunks of up to max_tokens tokens."""
    chunks = [(rows, tokens) for tokens in chunk_tokens for rows in decode_rows if rows * tokens <= max_tokens]
    return [(rows, 1) for rows in decode_rows] + chunks


def forget_exports() -> None:
    """The kernels' exports in memory dropped, and jax's traces of their entries, so that the launchers run again."""
    jax.clear_caches()
    for launcher in LAUNCHERS:
        launcher.exports.clear()


def lower_pass(model, shapes, per_program: bool) -> float:
    """Seconds to trace and lower every step program for CUDA."""
    leaves, merged = flat_params(model)
    total = 0.0
    for rows, tokens in shapes:
        if per_program:
            forget_exports()
        cache = jax.eval_shape(lambda: model.init_cache(rows, 1024))
        ids = jax.ShapeDtypeStruct((rows, tokens), jnp.int32)
        n_new = jax.ShapeDtypeStruct((rows,), jnp.int32)
        start = time.perf_counter()
        step = jax.jit(lambda p, i, c, n: merged(p).extend(i, c, n))
        step.trace(leaves, ids, cache, n_new).lower(lowering_platforms=("cuda",))
        total += time.perf_counter() - start
    return total


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_lowering", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench")
    p.add_argument("--expert-precision", default="bf16")
    p.add_argument("--dense-precision", default="bf16")
    p.add_argument("--fp8-twins", action="store_true")
    p.add_argument("--decode-rows", default="1,2,4,8,16,32,64,129", help="row buckets, comma-separated")
    p.add_argument("--chunk-tokens", default="16,64,256", help="prefill chunk buckets, comma-separated")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--out", help="directory for kernel_lowering.json")
    args = p.parse_args(argv)

    compiled = dataclasses.replace(Backend.parse("pallas"), interpret=False)
    quant = QuantConfig(args.expert_precision, args.dense_precision, fp8_twins=args.fp8_twins)
    model = nnx.eval_shape(lambda: serving_view(
        InklingModel(preset(args.preset), dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend=compiled), quant, fuse=True))
    shapes = step_shapes([int(r) for r in args.decode_rows.split(",")],
                         [int(t) for t in args.chunk_tokens.split(",")], args.max_num_batched_tokens)
    configured = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)  # no exports read from a cache folder set before
        seconds = {"per program": lower_pass(model, shapes, per_program=True)}
        with tempfile.TemporaryDirectory() as folder:
            jax.config.update("jax_compilation_cache_dir", folder)  # nothing is compiled: only the exports go there
            for name in ("once per process", "from disk"):
                forget_exports()
                seconds[name] = lower_pass(model, shapes, per_program=False)
    finally:
        jax.config.update("jax_compilation_cache_dir", configured)
    found = stamp()
    print(f"{stamp_line(found)}; {args.preset}, experts {args.expert_precision}, dense {args.dense_precision}"
          f"{' with fp8 twins' if args.fp8_twins else ''}; {len(shapes)} step programs traced and lowered for CUDA")
    print("| kernels lowered | seconds | / per program |\n| --- | ---: | ---: |")
    for name, value in seconds.items():
        print(f"| {name} | {value:.1f} | {value / seconds['per program']:.2f} |")
    if args.out:
        save_json(args.out, "kernel_lowering.json", {"stamp": found, "args": vars(args), "programs": shapes,
                                                     "seconds": seconds})


if __name__ == "__main__":
    main()
