"""The sampler's top-k / top-p filter on one GPU: the bisection `serve.sampler.top_k_top_p` against the sort of
its definition (`top_k_top_p_sorted`, the peer in the same run), and the whole `full` sampler against the greedy /
plain-temperature one, at the engine's row counts and Inkling's vocabulary.

    PYTHONPATH=. python bench/sampler.py [--rows 8,32,128] [--vocab 200058]

Rows alike: rows whose kept sets the two filters agree on; they may differ where a row's probability mass
crosses top_p within float32 rounding (both are then right to that precision). Bytes: the bisection reads the
[R, V] fp32 logits once per step (64 steps, plus a few passes), reported against a jitted sum over 1 GiB measured
here (the read ceiling). Rows mix top_k / top_p settings as requests do.
"""

import argparse
import functools
import os
import sys

# Run as a script, this file's folder comes first on sys.path and bench/serve.py would shadow the `serve` package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.ceilings import median_seconds, read_bandwidth  # noqa: E402
from serve.sampler import SamplingBatch, choose, top_k_top_p, top_k_top_p_sorted  # noqa: E402

BISECTION_PASSES = 64  # two bisections of 32 halvings, each a masked reduction over [R, V]


def params(rows: int, rng) -> SamplingBatch:
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    return SamplingBatch(temperature=f32(rng.choice([0.7, 1.0], rows)), top_p=f32(rng.choice([0.9, 0.95, 1.0], rows)),
                         top_k=jnp.asarray(rng.choice([0, 40, 50], rows), jnp.int32), min_p=f32(np.zeros(rows)),
                         presence=f32(np.zeros(rows)), frequency=f32(np.zeros(rows)), repetition=f32(np.ones(rows)),
                         seed=jnp.asarray(np.arange(rows), jnp.uint32), index=jnp.zeros((rows,), jnp.int32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,32,128")
    ap.add_argument("--vocab", type=int, default=200058)
    args = ap.parse_args()
    read = read_bandwidth(1 << 29, data="normal")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; read (sum x) {read / 1e9:.0f} GB/s")
    print("| rows | filter: bisection ms | sort ms | sort / bisection | bisection GB/s | of read | rows alike "
          "| full sampler ms | greedy sampler ms |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    rng = np.random.default_rng(0)
    for rows in (int(r) for r in args.rows.split(",")):
        logits = jnp.asarray(rng.normal(0, 3, (rows, args.vocab)), jnp.float32)
        p = params(rows, rng)
        fast, sort = (jax.jit(f) for f in (top_k_top_p, top_k_top_p_sorted))
        kept = [jnp.isfinite(f(logits, p.top_k, p.top_p)) for f in (fast, sort)]
        alike = int(jnp.sum(jnp.all(kept[0] == kept[1], axis=-1)))  # rows whose kept sets are equal
        t_fast = median_seconds(fast, logits, p.top_k, p.top_p, trials=5, warmup=2, calls=10)
        t_sort = median_seconds(sort, logits, p.top_k, p.top_p, trials=5, warmup=2, calls=10)
        full, plain = (jax.jit(functools.partial(choose, params=p, num_top=5, full=f)) for f in (True, False))
        t_full = median_seconds(lambda x: full(x, x), logits, trials=5, warmup=2, calls=10)
        t_plain = median_seconds(lambda x: plain(x, x), logits, trials=5, warmup=2, calls=10)
        rate = BISECTION_PASSES * logits.size * 4 / t_fast
        print(f"| {rows} | {t_fast * 1e3:.3f} | {t_sort * 1e3:.3f} | {t_sort / t_fast:.1f} | {rate / 1e9:.0f} | "
              f"{rate / read:.2f} | {alike} of {rows} | {t_full * 1e3:.3f} | {t_plain * 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
