"""The tile sweep of the MoE grouped-matmul kernels: each kernel role alone at Inkling's expert shapes, over tile
candidates, against the role's current tiles at these rows (`pallas_kernels/moe/tuning.py`) and jax's Mosaic-GPU
ragged dot on the same operands, all in the same run.

    python -m benchmarks.moe_tiles [--roles swiglu,gmm,gmm_pairs,wgrad] [--seconds 500] [--out DIR]
    python -m benchmarks.moe_tiles --dry-run      # tiny shapes on CPU (portable kernels): the plumbing only

The rows are `benchmarks.moe`'s (16k tokens x (top-6 + 2 shared), hidden 6144, width 3072, bf16). A role is
timed on every product it serves in a training step, and a candidate's score is their summed time:
- swiglu: the training forward's gate|up kernel (h, gate and up stored);
- gmm: the down projection forward and its dgrad dh = dy @ w_down^T;
- gmm_pairs: dx = dgate @ w_gate^T + dup @ w_up^T;
- wgrad: x^T @ dgate (the gate and up weight gradients' shape) and h^T @ dy (the down's).
The search goes in three rounds per role: the tile shape (rows per warpgroup, compute warpgroups, block_n, block_k
or block_rows) at the default stages and grid order, then the stages of the two best shapes, then the grid order of
the best one.
A candidate that fails to compile (shared memory, registers) is recorded and skipped. Each role gets an equal
share of --seconds; a role whose share is spent stops starting candidates (its current tiles are always
timed). Prints each candidate as it is timed, then per role the best tiles, and writes moe_tiles.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from benchmarks.moe import DRY, INKLING, rnd, rows_inputs, weights
from benchmarks.timing import CALLS, attempt, median_seconds, save_json, stamp, stamp_line
from pallas_kernels.moe import block_tiles, epilogues, jax_mgpu, matmuls
from pallas_kernels.moe.tuning import WgradConfig

ROLES = ("swiglu", "gmm", "gmm_pairs", "wgrad")
PLAIN = ((0, 0, 0),)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One product a role's kernel computes: run(cfg, *arrays) and, where jax's kernel computes it, peer(*arrays)."""

    label: str
    run: object
    arrays: tuple
    flops: float
    peer: object = None


def problems(s, interpret) -> dict[str, list[Problem]]:
    d = rows_inputs(s, s.tokens)
    w_gate, w_up, w_down = weights(s)
    x, gs, dy, rw = d["x"], d["gs"], d["dy"], d["rw"]
    m = x.shape[0]
    keys = jax.random.split(jax.random.key(7), 3)
    h, dgate, dup = (rnd(k, (m, s.width)) for k in keys)
    product = 2 * m * s.hidden * s.width  # FLOPs of one [M, H] x [H, I] grouped product

    def gmm(lhs, ws, *, transpose_rhs=False, pairs=PLAIN, **kw):
        def run(cfg, *arrays):
            n = len(lhs)
            return matmuls.gmm(list(arrays[:n]), list(arrays[n:-1]), arrays[-1], transpose_rhs=transpose_rhs,
                               pairs=pairs, cfg=cfg, interpret=interpret, **kw)
        return run, (*lhs, *ws, gs)

    def peer(transpose_rhs=False, pairs=PLAIN, n_lhs=1):
        def run(*arrays):
            return jax_mgpu.gmm(list(arrays[:n_lhs]), list(arrays[n_lhs:-1]), arrays[-1], transpose_rhs=transpose_rhs,
                                pairs=pairs, interpret=interpret)
        return None if interpret else run

    swiglu = functools.partial(epilogues.swiglu, keep_preactivations=True)
    gate_up_run, gate_up_arrays = gmm([x], [w_gate, w_up], pairs=((0, 0, 0), (0, 1, 1)), epilogue=swiglu,
                                      num_outputs=3, row_inputs=(rw,))
    down_run, down_arrays = gmm([h], [w_down], epilogue=epilogues.plain, num_outputs=1)
    dh_run, dh_arrays = gmm([dy], [w_down], transpose_rhs=True, epilogue=epilogues.plain, num_outputs=1)
    pairs = ((0, 0, 0), (1, 1, 0))
    dx_run, dx_arrays = gmm([dgate, dup], [w_gate, w_up], transpose_rhs=True, pairs=pairs, epilogue=epilogues.plain,
                            num_outputs=1)

    def wgrad(cfg, a, b, sizes):
        return matmuls.tgmm(a, b, sizes, cfg=cfg, interpret=interpret)

    wgrad_peer = None if interpret else (lambda a, b, sizes: jax_mgpu.tgmm(a, b, sizes, interpret=False))
    return {
        "swiglu": [Problem("gate|up forward, preactivations kept", gate_up_run, gate_up_arrays, 2 * product)],
        "gmm": [Problem("down forward", down_run, down_arrays, product, peer()),
                Problem("dh = dy @ w_down^T", dh_run, dh_arrays, product, peer(transpose_rhs=True))],
        "gmm_pairs": [Problem("dx = dgate @ w_gate^T + dup @ w_up^T", dx_run, dx_arrays, 2 * product,
                              peer(transpose_rhs=True, pairs=pairs, n_lhs=2))],
        "wgrad": [Problem("x^T @ dgate", wgrad, (x, dgate, gs), product, wgrad_peer),
                  Problem("h^T @ dy", wgrad, (h, dy, gs), product, wgrad_peer)],
    }


def shapes(default, dry: bool) -> list:
    """Round one's candidates: the default first, then every tile shape (at the default stages and grid order)."""
    if dry:
        return [default, dataclasses.replace(default, compute_wgs=1)]
    found = [default]
    field = "block_rows" if isinstance(default, WgradConfig) else "block_k"
    for wg_rows in (128, 64):  # 128: each warpgroup issues two 64-row wgmmas per operand tile
        for wgs in (2, 1):
            for block_n in (64, 128, 256):
                for depth in (32, 64, 128):
                    found.append(dataclasses.replace(default, wg_rows=wg_rows, compute_wgs=wgs, block_n=block_n,
                                                     **{field: depth}))
    return list(dict.fromkeys(found))


def describe(cfg) -> str:
    return ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg))


class Sweep:
    def __init__(self, role: str, cases: list[Problem], seconds: float):
        self.role, self.cases, self.deadline = role, cases, time.monotonic() + seconds
        self.timed: dict = {}  # cfg -> seconds summed over the cases (None: failed)
        self.errors: dict = {}

    def time(self, cfg) -> float | None:
        if cfg in self.timed:
            return self.timed[cfg]
        total = 0.0
        for case in self.cases:
            fn = jax.jit(functools.partial(case.run, cfg))
            t = attempt(f"{self.role} [{describe(cfg)}] {case.label}",
                        lambda: median_seconds(fn, *case.arrays, trials=5, warmup=1, calls=CALLS), self.errors)
            if t is None:
                total = None
                break
            total += t
        self.timed[cfg] = total
        shown = "failed" if total is None else f"{total * 1e3:.3f} ms"
        print(f"{self.role}: {shown} [{describe(cfg)}]", flush=True)
        return total

    def run(self, first: list) -> None:
        """Times first[0] (the baseline) whatever the budget, then the rounds while it lasts."""
        self.time(first[0])
        for cfg in first[1:]:
            if time.monotonic() > self.deadline:
                return
            self.time(cfg)
        for vary, values in (("stages", (2, 3, 4, 5, 6)), ("grid_tile_width", (1, 2, 4, 8, 16))):
            leaders = self.ranked()[:2 if vary == "stages" else 1]
            for cfg in leaders:
                for value in values:
                    if time.monotonic() > self.deadline:
                        return
                    self.time(dataclasses.replace(cfg, **{vary: value}))

    def ranked(self) -> list:
        return sorted((c for c, t in self.timed.items() if t is not None), key=self.timed.get)

    def summary(self, baseline, name: str) -> dict:
        """The sweep as its JSON reports it: the baseline tiles under `name` (and `name`_ms), the best ones, every
        candidate's summed milliseconds, the errors."""
        best = next(iter(self.ranked()), None)
        return {name: describe(baseline), f"{name}_ms": milliseconds(self.timed.get(baseline)),
                "best": best and describe(best), "best_ms": best and milliseconds(self.timed[best]),
                "candidates": {describe(c): milliseconds(t) for c, t in self.timed.items()}, "errors": self.errors}


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def cell(value: float | None) -> str:
    """A table cell of a time or ratio that may be missing."""
    return "-" if not value else f"{value:.3f}"


def peer_seconds(cases: list[Problem], errors: dict) -> float | None:
    """jax's kernel over the role's products, where it computes them all."""
    if any(c.peer is None for c in cases):
        return None
    times = [attempt(f"peer {c.label}", lambda c=c: median_seconds(jax.jit(c.peer), *c.arrays, trials=5, warmup=1),
                     errors) for c in cases]
    return None if None in times else sum(times)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_tiles", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--roles", default=",".join(ROLES), help=f"comma-separated, of {', '.join(ROLES)}")
    p.add_argument("--seconds", type=float, default=500.0, help="time budget of the whole sweep")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (portable kernels): plumbing only")
    p.add_argument("--out", help="directory for moe_tiles.json")
    args = p.parse_args(argv)
    roles = args.roles.split(",")
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        p.error(f"unknown roles {unknown}: choose from {', '.join(ROLES)}")
    s = DRY if args.dry_run else INKLING
    interpret = args.dry_run
    results = {"stamp": stamp(), "roles": {}}
    print(stamp_line(results["stamp"]), flush=True)
    cases = problems(s, interpret)
    share = args.seconds / len(roles)
    current, _ = block_tiles(s.tokens * (s.top_k + s.shared), s.local + s.shared, jnp.bfloat16)
    for role in roles:
        default = current.get(role, jnp.bfloat16)
        sweep = Sweep(role, cases[role], share)
        sweep.run(shapes(default, args.dry_run))
        peer = None if args.dry_run else peer_seconds(cases[role], sweep.errors)
        best = next(iter(sweep.ranked()), None)
        found = {"products": [c.label for c in cases[role]], **sweep.summary(default, "default"),
                 "best_TFLOPs": best and sum(c.flops for c in cases[role]) / sweep.timed[best] / 1e12,
                 "jax_mgpu_ms": milliseconds(peer)}
        results["roles"][role] = found
        if args.out:
            save_json(args.out, "moe_tiles.json", results)
    print("\n| role | default ms | best ms | best / default | jax ms | ours / jax time | best tiles |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for role, r in results["roles"].items():
        ratio = r["default_ms"] and r["best_ms"] and r["best_ms"] / r["default_ms"]
        vs_jax = r["jax_mgpu_ms"] and r["best_ms"] and r["best_ms"] / r["jax_mgpu_ms"]
        print(f"| {role} | {cell(r['default_ms'])} | {cell(r['best_ms'])} | {cell(ratio)} | "
              f"{cell(r['jax_mgpu_ms'])} | {cell(vs_jax)} | {r['best'] or '-'} |")


if __name__ == "__main__":
    main()
