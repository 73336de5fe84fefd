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
`--sweep SECONDS` also searches tiles per row count (`benchmarks.moe_tiles`' search: tile shapes, then stages and
grid order), scored by the summed time of every shape's product, the K blocks kept at the current tiles' so that
any candidate gives the same bits (checked for the best). `--weights head,down` keeps the shapes of the weights
named so (here the LM head and both down projections). Prints one table (and the sweep's) and writes
invariant_matmul.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.moe_tiles import Problem, Sweep, cell
from benchmarks.timing import CALLS, attempt, median_seconds, save_json, stamp, stamp_line
from inkling_jax import preset
from inkling_jax.config import TextConfig
from inkling_jax.nn import invariant
from pallas_kernels.moe.tuning import GmmConfig, KernelConfigs


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


def operands(shape, rows: int):
    """Random bf16 (x [rows, K], w) for a product of `weight_shapes`."""
    k, n, transposed = shape
    keys = jax.random.split(jax.random.key(0), 2)
    w = (0.02 * jax.random.normal(keys[0], (n, k) if transposed else (k, n))).astype(jnp.bfloat16)
    return jax.random.normal(keys[1], (rows, k)).astype(jnp.bfloat16), w


def kernel_product(cfg: GmmConfig, x, w, *, transposed: bool, interpret):
    """x @ w as `invariant.matmul` runs it, at the matmul tiles `cfg` (the sweep's candidates are these)."""
    return invariant.one_group(x, w, KernelConfigs(gmm=cfg), transposed=transposed, interpret=interpret)


def products(transposed: bool, interpret):
    """(the invariant matmul, the kernel at its default tiles, XLA's dot), each jitted x [M, K] @ w."""
    default = KernelConfigs().get("gmm", jnp.bfloat16)
    return {"invariant": jax.jit(lambda x, w: invariant.matmul(x, w, interpret=interpret, transposed=transposed)),
            "default tiles": jax.jit(functools.partial(kernel_product, default, transposed=transposed,
                                                       interpret=interpret)),
            "xla": jax.jit(lambda x, w: x @ (w.T if transposed else w))}


def measure(shape, rows: list[int], trials: int, interpret) -> dict:
    k, n, transposed = shape
    x, w = operands(shape, max(rows))
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


def candidates(current: GmmConfig) -> list[GmmConfig]:
    """The sweep's first round: the current tiles, then each tile shape at their K blocks, stages and grid order."""
    shaped = [dataclasses.replace(current, compute_wgs=wgs, block_n=block_n) for wgs in (1, 2)
              for block_n in (64, 128, 256)]
    return list(dict.fromkeys([current, *shaped]))


def sweep(shapes: dict, rows: list[int], seconds: float, interpret) -> dict:
    """Per row count, the tiles whose summed time over every shape's product is least, against the current tiles
    (`invariant.tiles`), and whether the best gives the current tiles' bits."""
    arrays = {shape: operands(shape, max(rows)) for shape in shapes}
    found = {}
    for m in rows:
        current = invariant.tiles(m, jnp.bfloat16).get("gmm", jnp.bfloat16)
        cases = [Problem(f"{'; '.join(names)} at {m} rows",
                         functools.partial(kernel_product, transposed=shape[2], interpret=interpret),
                         (arrays[shape][0][:m], arrays[shape][1]), 2 * m * shape[0] * shape[1])
                 for shape, names in shapes.items()]
        search = Sweep(f"{m} rows", cases, seconds / len(rows))
        search.run(candidates(current))
        found[m] = search.summary(current, "current")
        best = next(iter(search.ranked()), None)
        found[m]["best_same_bits"] = best == current or best is not None and all(
            np.array_equal(np.asarray(jax.jit(functools.partial(c.run, best))(*c.arrays)),
                           np.asarray(jax.jit(functools.partial(c.run, current))(*c.arrays))) for c in cases)
    return found


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
    parser.add_argument("--weights", default="", help="comma-separated words: only the shapes of the weights "
                        "whose names contain one (default: every shape)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--sweep", type=float, default=None, metavar="SECONDS",
                        help="also search tiles per row count for this long (0: the current tiles only)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for invariant_matmul.json")
    args = parser.parse_args(argv)
    rows = sorted(int(r) for r in args.rows.split(","))
    interpret = jax.default_backend() != "gpu"  # the portable kernel elsewhere
    every = weight_shapes(preset(args.preset).text)
    words = [word.strip() for word in args.weights.split(",") if word.strip()] or [""]
    shapes = {shape: names for shape, names in every.items() if any(w in n for w in words for n in names)}
    if not shapes:
        parser.error(f"--weights {args.weights!r} names none of {[n for names in every.values() for n in names]}")
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
    searched = None if args.sweep is None else sweep(shapes, rows, args.sweep, interpret)
    if searched:
        print("\n| rows | current ms | best ms | best / current | same bits | best tiles |")
        print("|---:|---:|---:|---:|---|---|")
        for m, r in searched.items():
            ratio = r["best_ms"] and r["current_ms"] and r["best_ms"] / r["current_ms"]
            print(f"| {m} | {cell(r['current_ms'])} | {cell(r['best_ms'])} | {cell(ratio)} | "
                  f"{r['best_same_bits']} | {r['best'] or '-'} |")
    save_json(args.out, "invariant_matmul.json", {"args": vars(args), "stamp": where, "results": found,
                                                   "sweep": searched, "errors": errors})


if __name__ == "__main__":
    main()
