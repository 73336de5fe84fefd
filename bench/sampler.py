"""The sampler's top-k / top-p filter on one GPU: `serve.runner.sampler.top_k_top_p` (cutoffs found digit by digit, no
sort) against the sort of its definition (the peer, in the same run), at the engine's row counts and Inkling's
vocabulary; and the whole `full` sampler (penalties, filters, draw, logprobs) against the plain temperature draw.

    PYTHONPATH=. python bench/sampler.py [--rows 8,32,128] [--vocab 200058] [--digit-bits 2,4,8]

Rows alike: rows whose kept sets the two filters agree on. They differ where a row's probability mass crosses
top_p within float32 rounding, and on top_p = 1 rows, whose tail the sort's float32 running sum cuts.
Bytes: each pass of a cutoff search reads the [R, V] fp32 logits once (2 x 32 / digit_bits passes, plus 3),
reported against a jitted sum over 1 GiB measured here (the read ceiling). The `rows-major` column runs the same
search with each pass laid out [R, probes, V] (a row reduction per probe) instead of [R, V, probes]. Rows mix
top_k / top_p settings as requests do.
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
from serve.runner import sampler  # noqa: E402
from serve.runner.sampler import SamplingBatch, sample, top_k_top_p  # noqa: E402


def top_k_top_p_sorted(x, top_k, top_p):
    """The filter by its definition, through a sort of every row (the serving sampler's filter until 2026-11-30)."""
    vocab = x.shape[-1]
    ranked = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    in_k = jnp.arange(vocab)[None, :] < k
    probs = jax.nn.softmax(jnp.where(in_k, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.sum(in_k & (before < top_p[:, None]), axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(ranked, jnp.maximum(kept - 1, 0), axis=-1)
    return jnp.where(x >= cutoff, x, -jnp.inf)


def count_at_least_rows_major(key, t, weight=None):
    """`sampler._count_at_least` with the probes before the vocabulary: [R, P, V] reduced over its last axis."""
    hit = key[:, None, :] >= t[:, :, None]
    return jnp.sum(hit, -1) if weight is None else jnp.sum(jnp.where(hit, weight[:, None, :], 0.0), -1)


def params(rows: int, rng) -> SamplingBatch:
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    return SamplingBatch(temperature=f32(rng.choice([0.7, 1.0], rows)), top_p=f32(rng.choice([0.9, 0.95, 1.0], rows)),
                         top_k=jnp.asarray(rng.choice([0, 40, 50], rows), jnp.int32), min_p=f32(np.zeros(rows)),
                         presence_penalty=f32(np.zeros(rows)), frequency_penalty=f32(np.zeros(rows)),
                         repetition_penalty=f32(np.ones(rows)),
                         seed=jnp.asarray(np.arange(rows), jnp.uint32), index=jnp.zeros((rows,), jnp.int32))


def time_it(fn, *args):
    return median_seconds(fn, *args, trials=5, warmup=2, calls=10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,32,128")
    ap.add_argument("--vocab", type=int, default=200058)
    ap.add_argument("--digit-bits", default="2,4,8")
    args = ap.parse_args()
    widths = [int(b) for b in args.digit_bits.split(",")]
    read = read_bandwidth(1 << 29, data="normal")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; read (sum x) {read / 1e9:.0f} GB/s")
    print("| rows | sort ms | " + " | ".join(f"{b}-bit digits ms (x sort, of read)" for b in widths)
          + " | 4-bit rows-major ms | rows alike | full sampler ms | plain sampler ms |")
    print("|---:|---:|" + "---:|" * len(widths) + "---:|---|---:|---:|")
    rng = np.random.default_rng(0)
    for rows in (int(r) for r in args.rows.split(",")):
        logits = jnp.asarray(rng.normal(0, 3, (rows, args.vocab)), jnp.float32)
        p = params(rows, rng)
        sort = jax.jit(top_k_top_p_sorted)
        t_sort = time_it(sort, logits, p.top_k, p.top_p)
        cells = []
        for bits in widths:
            fast = jax.jit(functools.partial(top_k_top_p, digit_bits=bits))
            t = time_it(fast, logits, p.top_k, p.top_p)
            rate = (2 * 32 // bits + 3) * logits.size * 4 / t
            cells.append(f"{t * 1e3:.3f} ({t_sort / t:.1f}x, {rate / read:.2f})")
        kept = [jnp.isfinite(f(logits, p.top_k, p.top_p)) for f in (jax.jit(top_k_top_p), sort)]
        alike = int(jnp.sum(jnp.all(kept[0] == kept[1], axis=-1)))  # rows whose kept sets are equal
        default_count = sampler._count_at_least
        sampler._count_at_least = count_at_least_rows_major
        t_rows_major = time_it(jax.jit(top_k_top_p), logits, p.top_k, p.top_p)
        sampler._count_at_least = default_count
        counts, mask = jnp.zeros(logits.shape, jnp.int32), jnp.zeros(logits.shape, bool)
        full, plain = (jax.jit(functools.partial(sample, params=p, num_top=5, full=f)) for f in (True, False))
        t_full = time_it(lambda x: full(x, counts=counts, prompt_mask=mask), logits)
        t_plain = time_it(lambda x: plain(x, counts=None, prompt_mask=None), logits)
        print(f"| {rows} | {t_sort * 1e3:.3f} | " + " | ".join(cells) + f" | {t_rows_major * 1e3:.3f} | "
              f"{alike} of {rows} | {t_full * 1e3:.3f} | {t_plain * 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
