"""The grouped FFN's forward at serving and training step sizes in each row layout the kernels can run, against
jax's Mosaic-GPU ragged dot on the same rows, all in the same run:

    python -m benchmarks.moe_layouts [--tokens 257,384,1024,2048,4096,8192,16384] [--out DIR]
    python -m benchmarks.moe_layouts --dry-run      # tiny shapes on CPU (portable kernels): the plumbing only

Rows: T tokens routed top-6 over 32 experts (hidden 6144, width 3072, bf16), sorted by expert; at 16384 tokens
also the 2 shared experts as two more groups of every token, as `benchmarks.moe` runs them. Layouts:
- row-blocked: the kernels' row blocks over the sorted rows as they lie; a block that straddles experts is
  visited once per expert (`tuning.DEFAULTS`' 128-row tiles and `LARGE`'s 256-row tiles);
- slabs: every expert's rows padded to whole blocks first (`decode.in_slabs`), 128 rows with the default tiles,
  256 with the large ones;
- `moe_ffn`: what the library runs for a forward-only call (slabs, the tiles `block_tiles` picks).
Each row gives ms, TFLOP/s of the useful work (6 M H I) and the peer's time over the row's (above 1: faster).
Prints a table last and writes moe_layouts.json into --out.
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.moe import DRY, INKLING, rnd, routing
from benchmarks.moe_peers import mgpu_peer, unfused_ffn
from benchmarks.timing import attempt, median_seconds, save_json, stamp, stamp_line
from pallas_kernels.moe import moe_ffn, ops
from pallas_kernels.moe.jax_mgpu import MatmulKernels
from pallas_kernels.moe.tuning import KernelConfigs

TILES = {"default": KernelConfigs(), "large": KernelConfigs(large=True)}


def layouts(interpret) -> dict:
    """name -> f(x, w_gate, w_up, w_down, group_sizes, row_weights)."""
    def rows_as_they_lie(configs):
        return lambda x, wg, wu, wd, gs, rw: ops.moe_ffn_core(x, wg, wu, wd, gs, rw, interpret, configs,
                                                              MatmulKernels())

    def slabs(configs):  # moe_ffn pads each expert's rows to the block rows of the tiles it is given
        return functools.partial(moe_ffn, interpret=interpret, configs=configs)

    return {"row-blocked, default tiles": rows_as_they_lie(TILES["default"]),
            "row-blocked, large tiles": rows_as_they_lie(TILES["large"]),
            "slabs of 128, default tiles": slabs(TILES["default"]),
            "slabs of 256, large tiles": slabs(TILES["large"]),
            "moe_ffn": functools.partial(moe_ffn, interpret=interpret)}


def step_rows(s, tokens: int, shared: int, seed: int = 0):
    """(x, group sizes, row weights) of `tokens` tokens routed top-k over the local experts (`benchmarks.moe`'s
    routing), plus `shared` groups of every token."""
    _, gs = routing(s, tokens, seed)
    gs = gs[:s.local + shared]
    m = int(gs.sum())
    ks = jax.random.split(jax.random.key(seed), 2)
    return rnd(ks[0], (m, s.hidden)), gs, jax.random.uniform(ks[1], (m,), jnp.float32, 0.05, 1.0)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_layouts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="257,384,1024,2048,4096,8192,16384", help="step sizes, comma-separated")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (portable kernels): plumbing only")
    p.add_argument("--out", help="directory for moe_layouts.json")
    args = p.parse_args(argv)
    s = DRY if args.dry_run else INKLING
    token_list = [40, 70] if args.dry_run else [int(t) for t in args.tokens.split(",")]
    results = {"stamp": stamp(), "steps": {}, "errors": {}}
    print(stamp_line(results["stamp"]), flush=True)
    ks = jax.random.split(jax.random.key(1), 3)
    groups = s.local + s.shared
    weights = (rnd(ks[0], (groups, s.hidden, s.width), s.hidden ** -0.5),
               rnd(ks[1], (groups, s.hidden, s.width), s.hidden ** -0.5),
               rnd(ks[2], (groups, s.width, s.hidden), s.width ** -0.5))
    cases = layouts(interpret=args.dry_run)
    if not args.dry_run:
        peer = attempt("mgpu peer import", mgpu_peer, results["errors"])
        if peer is not None:
            cases["peer: jax ragged_dot_mgpu"] = functools.partial(unfused_ffn, peer)
    for tokens in token_list:
        shared = s.shared if tokens >= 16384 or args.dry_run else 0
        x, gs, rw = step_rows(s, tokens, shared)
        w = tuple(m[:s.local + shared] for m in weights)
        flops = 6 * x.shape[0] * s.hidden * s.width
        row = results["steps"][tokens] = {"rows": x.shape[0], "groups": s.local + shared, "ms": {}}
        for name, f in cases.items():
            t = attempt(f"{tokens} tokens, {name}", lambda f=f: median_seconds(
                jax.jit(f), x, *w, gs, rw, trials=5, calls=5), results["errors"])
            row["ms"][name] = t and t * 1e3
            if t:
                print(f"{tokens} tokens ({x.shape[0]} rows), {name}: {t * 1e3:.3f} ms, "
                      f"{flops / t / 1e12:.0f} TFLOP/s", flush=True)
        if args.out:
            save_json(args.out, "moe_layouts.json", results)
    print(table(results), flush=True)


def table(results) -> str:
    names = list(next(iter(results["steps"].values()))["ms"])
    peer = next((n for n in names if n.startswith("peer")), None)
    lines = ["| tokens | rows | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
    for tokens, row in results["steps"].items():
        cells = []
        for name in names:
            ms, peer_ms = row["ms"][name], peer and row["ms"][peer]
            ratio = f" ({peer_ms / ms:.2f}x)" if ms and peer_ms and name != peer else ""
            cells.append(f"{ms:.3f}{ratio}" if ms else "-")
        lines.append(f"| {tokens} | {row['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
