"""The batch-invariant matmul (`inkling_jax.nn.invariant.matmul`, the RL `--batch-invariant` mode's products)
against XLA's dot, at a decode step's rows and a training step's, and whether a row's bits depend on the rows.

    python -m benchmarks.invariant_matmul                        # a GPU: the `bench` preset's dense weights
    python -m benchmarks.invariant_matmul --preset tiny --trials 1  # CPU: the plumbing only (portable kernel)

Per distinct weight shape of the preset (the attention projections, the dense MLP, each shared expert, the LM head
read as it lies, [vocab, hidden]; the routed experts run other kernels), bf16, random operands:
- at each row count of `--rows`: the invariant matmul at the tiles it takes there (`invariant.tiles`:
  `DECODE_TILES` up to `DECODE_ROWS` rows), the kernel at its default tiles, and XLA's dot, each the median of
  trials of back-to-back calls; as GB/s of the weight read up to `DECODE_ROWS` rows (a decode step reads its
  weights once), as TFLOP/s above; and the invariant matmul's speed over XLA's;
- `same bits`: each row count's product equals the first rows of the largest's, bit for bit (the tiles differ
  across `DECODE_ROWS`, the K order must not).
Prints one table and writes invariant_matmul.json.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import CALLS, attempt, median_seconds, save_json, stamp, stamp_line
from inkling_jax import preset
from inkling_jax.config import TextConfig
from inkling_jax.nn import invariant
from pallas_kernels.moe import ops
from pallas_kernels.moe.tuning import KernelConfigs


def weight_shapes(text: TextConfig) -> dict[tuple[int, int, bool], list[str]]:
    """(K, N, transposed) of each distinct dense product x [M, K] @ w the invariant mode computes -> what uses
    it. Transposed: the weight lies [N, K] and is read so (the LM head)."""
    hidden = text.hidden_size
    uses = {
        "attention q": (hidden, text.num_heads * text.head_dim),
        "attention k, v (full layers)": (hidden, text.num_kv_heads * text.head_dim),
        "attention k, v (sliding layers)": (hidden, text.swa_num_kv_heads * text.swa_head_dim),
        "relative-bias query": (hidden, text.num_heads * text.d_rel),
        "attention out": (text.num_heads * text.head_dim, hidden),
        "dense MLP gate, up": (hidden, text.dense_intermediate_size),
        "dense MLP down": (text.dense_intermediate_size, hidden),
        "a shared expert's gate, up": (hidden, text.moe_intermediate_size if text.num_shared_experts else 0),
        "a shared expert's down": (text.moe_intermediate_size if text.num_shared_experts else 0, hidden),
        "LM head": (hidden, text.vocab_size),
    }
    shapes: dict[tuple[int, int, bool], list[str]] = {}
    for name, (k, n) in uses.items():
        if min(k, n) > 0:
            shapes.setdefault((k, n, name == "LM head"), []).append(name)
    return shapes


def products(transposed: bool, interpret):
    """(the invariant matmul, the kernel at its default tiles, XLA's dot), each jitted x [M, K] @ w."""
    def default_tiles(x, w):
        sizes = jnp.full((1,), x.shape[0], jnp.int32)
        return ops.grouped_matmul(x, w[None], sizes, transpose_rhs=transposed, interpret=interpret,
                                  configs=KernelConfigs())
    return {"invariant": jax.jit(lambda x, w: invariant.matmul(x, w, interpret=interpret, transposed=transposed)),
            "default tiles": jax.jit(default_tiles),
            "xla": jax.jit(lambda x, w: x @ (w.T if transposed else w))}


def measure(shape, rows: list[int], trials: int, interpret) -> dict:
    k, n, transposed = shape
    keys = jax.random.split(jax.random.key(0), 2)
    w = (0.02 * jax.random.normal(keys[0], (n, k) if transposed else (k, n))).astype(jnp.bfloat16)
    x = jax.random.normal(keys[1], (max(rows), k)).astype(jnp.bfloat16)
    fns = products(transposed, interpret)
    whole = np.asarray(fns["invariant"](x, w))
    result = {"same_bits": all(np.array_equal(np.asarray(fns["invariant"](x[:m], w)), whole[:m]) for m in rows),
              "rows": {}}
    weight_bytes = w.size * w.dtype.itemsize
    for m in rows:
        seconds = {name: median_seconds(fn, x[:m], w, trials=trials, calls=CALLS) for name, fn in fns.items()}
        decode = m <= invariant.DECODE_ROWS
        rate = {name: (weight_bytes / s / 1e9 if decode else 2 * m * k * n / s / 1e12) for name, s in seconds.items()}
        result["rows"][m] = {"seconds": seconds, "unit": "GB/s" if decode else "TFLOP/s", "rate": rate,
                             "tiles": "decode" if invariant.tiles(m, w.dtype) == invariant.DECODE_TILES else "default",
                             "invariant_over_xla": seconds["xla"] / seconds["invariant"]}
    return result


def table(found: dict, shapes: dict, rows: list[int]) -> str:
    lines = ["| weight | K -> N | rows | tiles | invariant | default tiles | XLA dot | invariant / XLA | same bits |",
             "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for shape, names in shapes.items():
        got = found.get(str(shape))
        if got is None:
            continue
        k, n, transposed = shape
        for m in rows:
            r = got["rows"][m]
            rate = {name: f"{v:.0f} {r['unit']}" if r["unit"] == "GB/s" else f"{v:.1f} {r['unit']}"
                    for name, v in r["rate"].items()}
            lines.append(f"| {'; '.join(names)} | {k} -> {n}{' (as it lies)' if transposed else ''} | {m} | "
                         f"{r['tiles']} | {rate['invariant']} | {rate['default tiles']} | {rate['xla']} | "
                         f"{r['invariant_over_xla']:.2f} | {got['same_bits']} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.invariant_matmul", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bench", help="whose weight shapes (tiny: a check on CPU)")
    parser.add_argument("--rows", default="33,8192", help="row counts: a decode step's (32 sequences and the "
                        "engine's scratch row) and a training step's (`benchmarks.rl`'s: 32 sequences of 256 tokens)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for invariant_matmul.json")
    args = parser.parse_args(argv)
    rows = sorted(int(r) for r in args.rows.split(","))
    interpret = jax.default_backend() != "gpu"  # the portable kernel elsewhere
    shapes = weight_shapes(preset(args.preset).text)
    found, errors = {}, {}
    for shape in shapes:
        got = attempt(f"{shape}", lambda shape=shape: measure(shape, rows, args.trials, interpret), errors)
        if got is not None:
            found[str(shape)] = got
            print(f"{shape}: same bits {got['same_bits']}; invariant / XLA "
                  + ", ".join(f"{m} rows {r['invariant_over_xla']:.2f}" for m, r in got["rows"].items()), flush=True)
    where = stamp()
    print(f"\n{stamp_line(where)}; preset {args.preset}, bf16; {CALLS} calls per trial, median of {args.trials}")
    print(table(found, shapes, rows))
    save_json(args.out, "invariant_matmul.json", {"args": vars(args), "stamp": where, "results": found,
                                                   "errors": errors})


if __name__ == "__main__":
    main()
