"""The tensor-core work the Mosaic GPU forward (pallas_kernels/rel_attention/mgpu_forward.py) executes at Inkling's
two layer shapes, counted from the kernel's own tile ranges, against the useful FLOPs that the TFLOP/s
targets count (bench/rel_attention_setup.Layer.flops). No timing: with the forward's measured times (ms) given,
it prints the executed and useful TFLOP/s, and what the issue's targets would need executed.

    PYTHONPATH=. python bench/rel_attention_work.py [--full-ms MS --sliding-ms MS] [--flex-full-ms ...
        --flex-sliding-ms ... --cudnn-full-ms ... --cudnn-sliding-ms ...]

A compute warpgroup owns 64 rows (the GQA group's heads x n_tok tokens) and, per 64-key block it visits, issues
q @ K^T (K = head_dim) and P @ V (N = head_dim). On blocks within the relative extent it also issues A @ Tz,
whose K is n_tok * d_rel (toeplitz.py: A is block-diagonal, one d_rel block per token). Runs on CPU.
"""

import argparse

from bench.rel_attention_setup import LAYERS, Layer
from pallas_kernels.rel_attention import mgpu_window, tiles, toeplitz, tuning
from pallas_kernels.rel_attention.tiles import Geometry

ROWS, KEYS = 64, tuning.MOSAIC_FORWARD_KEYS


def geometry(layer: Layer) -> Geometry:
    """The forward's geometry at this layer (no padding: Inkling's 8192 tokens divide every block)."""
    return Geometry(groups=layer.groups, head_dim=layer.dim, d_rel=layer.d_rel, extent=layer.extent,
                    window=layer.window, q_offset=0, segmented=False, scale=1.0 / layer.dim, seq_q=layer.tokens,
                    seq_k=layer.tokens, rel_left=0, interpret=False, blocks=tuning.mosaic_forward(layer.groups))


def warpgroup_steps(layer: Layer) -> tuple[int, int]:
    """(key blocks without bias, key blocks with bias) summed over every compute warpgroup of the launch."""
    geo, n_tok = geometry(layer), toeplitz.tokens_per_tile(layer.groups)
    plain = biased = 0
    for cta in range(layer.tokens // (2 * n_tok)):
        if mgpu_window.applies(geo):  # both warpgroups take `steps` biased blocks (mgpu_window.kernel)
            per_chunk = KEYS // n_tok
            t0 = (cta // per_chunk) * 2 * KEYS + (cta % per_chunk) * n_tok
            biased += 2 * int(mgpu_window.key_stream(geo, t0, n_tok)[1])
        else:  # both warpgroups walk the CTA's blocks (mgpu_forward._kernel)
            lo, near, _, end = (int(x) for x in tiles.key_block_ranges(geo, cta * 2 * n_tok))
            plain, biased = plain + 2 * (near - lo), biased + 2 * (end - near)
    return plain * layer.kv_heads * layer.batch, biased * layer.kv_heads * layer.batch


def bias_k(layer: Layer) -> int:
    """K of the A @ Tz product: A is block-diagonal, one d_rel block per token of the warpgroup's tile."""
    return toeplitz.tokens_per_tile(layer.groups) * layer.d_rel


def executed_flops(layer: Layer) -> float:
    plain, biased = warpgroup_steps(layer)
    per_key = 2 * ROWS * KEYS  # FLOPs per unit of K (or N) in a 64 x 64 product
    return per_key * (plain * 2 * layer.dim + biased * (2 * layer.dim + bias_k(layer)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in LAYERS:
        for who in ("", "flex-", "cudnn-"):
            p.add_argument(f"--{who}{name}-ms", type=float, help=f"measured forward time of {who or 'ours, '}{name}")
    args = vars(p.parse_args())
    for name, layer in LAYERS.items():
        plain, biased = warpgroup_steps(layer)
        executed, useful = executed_flops(layer), layer.flops()
        print(f"{name}: {plain} plain and {biased} biased warpgroup steps (bias product K = {bias_k(layer)}, head_dim "
              f"{layer.dim}); executed {executed / 1e12:.3f} TFLOP, {executed / useful:.2f}x the useful "
              f"{useful / 1e12:.3f}")
        ms = args[f"{name}_ms"]
        if ms:
            print(f"  at {ms} ms: {executed / ms / 1e9:.0f} TFLOP/s executed, {useful / ms / 1e9:.0f} useful")
        for who, factor, target in (("flex", 1 / 5, "5x Flex"), ("cudnn", 1 / 0.75, "0.75 of cuDNN")):
            peer = args[f"{who}_{name}_ms"]
            if peer:
                need = peer * factor
                print(f"  {target} needs {need:.3f} ms: {executed / need / 1e9:.0f} TFLOP/s executed")


if __name__ == "__main__":
    main()
