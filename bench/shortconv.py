"""ShortConv kernels and the fused decode prologue on a GPU, against the roofline and the jnp paths, one run.

    PYTHONPATH=. python bench/shortconv.py [--out DIR] [--sweep-seconds S] [--prefill-sweep]

- prefill: the kernel's bandwidth against a plain jitted `y = 2x` over the same bytes (the copy roofline) and its
  speed against the jitted jnp reference; a few settings are swept and each is printed;
- decode: the state-pool kernel against the jitted jnp reference;
- prologue: the fused kernel against the jitted unfused jnp sequence (pools and caches donated in both).
Each time is the median over trials of a jitted chain of `reps` dependent calls kept apart by optimization
barriers (no host launches between calls, no fusion across them); pools and caches are donated, so they
update in place. Bytes count each input read once and each output written once.
"""

import argparse
import datetime
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.attn_prologue import PrologueBlocks, attn_prologue
from pallas_kernels.attn_prologue import reference as prologue_ref
from pallas_kernels.shortconv import DecodeBlocks, StripBlocks, reference, shortconv_decode, shortconv_prefill

BF16, WIDTH = jnp.bfloat16, 4
PREFILL_SHAPES = [(1, 8192, 6144), (1, 8192, 2048), (4, 8192, 2048)]
# Strip settings (channels, rows, unroll, num_warps), the two earlier defaults first. A thread keeps about
# `unroll` row loads in flight; more resident programs per SM (shorter runs, fewer registers) keep more bytes in
# flight. 8 channels per thread (channels = 256 x num_warps) give 16 B loads, 4 give 8 B loads.
STRIP_SWEEP = [StripBlocks(512, 256, 8, 2), StripBlocks(256, 128, 8, 1), StripBlocks(512, 128, 16, 2),
               StripBlocks(256, 64, 16, 1), StripBlocks(256, 32, 16, 1), StripBlocks(512, 64, 16, 2),
               StripBlocks(256, 64, 16, 2), StripBlocks(512, 32, 8, 2), StripBlocks(512, 16, 16, 2),
               StripBlocks(256, 16, 16, 1), StripBlocks(256, 32, 16, 2), StripBlocks(512, 128, 16, 4),
               StripBlocks(512, 64, 8, 2), StripBlocks(512, 128, 8, 2), StripBlocks(256, 128, 16, 1),
               StripBlocks(1024, 128, 16, 4)]
PREFILL_SWEEP_SHAPES = [(1, 8192, 6144), (1, 8192, 2048)]  # --prefill-sweep
DECODE_SHAPES = [(1, 6144), (256, 6144), (256, 2048)]  # (tokens, channels)
DECODE_SWEEP = [DecodeBlocks(512, 4), DecodeBlocks(1024, 4), DecodeBlocks(512, 2), DecodeBlocks(256, 2)]
PROLOGUE_LAYERS = {"global": (64, 8, True), "local": (64, 16, False)}  # Hq, Hkv, tau
PROLOGUE_TOKENS = [1, 8, 64, 256]
PROLOGUE_SWEEP = [PrologueBlocks(1, 4), PrologueBlocks(2, 4), PrologueBlocks(4, 4)]
HEAD_DIM, POOL_SLOTS, CACHE_SLOTS = 128, 512, 16384
SWEEP_SECONDS = [170.0]  # past this (--sweep-seconds), sweeps time only their first setting: fits a time limit
START = time.monotonic()


def per_call_seconds(step, carry, consts, reps, feed_back, calls=4, trials=5):
    """Median seconds of one step(carry, *consts) -> carry, from a jitted chain of `reps` dependent steps.

    Each step reads what the one before wrote, so XLA can neither merge nor drop any. With feed_back the
    (donated) result starts the next call, which keeps pools and caches in place; without, every call
    restarts from `carry`, which keeps values bounded.
    """
    def run(carry, *consts):
        for _ in range(reps):
            carry = jax.lax.optimization_barrier(step(carry, *consts))
        return carry

    chain = jax.jit(run, donate_argnums=0 if feed_back else ())
    out = jax.block_until_ready(chain(carry, *consts))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            out = chain(out if feed_back else carry, *consts)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / (calls * reps))
    if not all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(out) if jnp.issubdtype(a.dtype, jnp.floating)):
        print("WARNING: non-finite values at the end of a timed chain")
    return statistics.median(times)


def normal(key, shape, dtype=BF16):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def best_of(sweep, measure, log, label):
    """Times every setting (printing each, skipping any that fails to build) and returns (seconds, setting)."""
    best = None
    for i, blocks in enumerate(sweep):
        if i and time.monotonic() - START > SWEEP_SECONDS[0]:
            log(f"  {label}: sweep cut short (time)")
            break
        try:
            seconds = measure(blocks)
        except Exception as err:  # a setting the backend rejects is reported, not fatal
            log(f"  {label} {blocks}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            continue
        log(f"  {label} {blocks}: {seconds * 1e6:.1f} us")
        if best is None or seconds < best[0]:
            best = (seconds, blocks)
    return best


def kernel_vs_jnp(rows, log, op, name, measure, kernel, jnp_path, sweep, moved, base_rate):
    """Sweeps the kernel's settings, times the jitted jnp path, and appends a row for each; returns the jnp time."""
    found = best_of(sweep, lambda b: measure(functools.partial(kernel, blocks=b)), log, f"{op} {name}")
    jnp_seconds = measure(jnp_path)
    rows.append((f"{op} jnp", name, jnp_seconds, moved, base_rate, jnp_seconds, ""))
    if found:
        rows.append((f"{op} kernel", name, found[0], moved, base_rate, jnp_seconds, str(found[1])))
    return jnp_seconds


def prefill_inputs(shape):
    """x [B, T, C] bf16 and w [C, 4] fp32 for the prefill, and the bytes a call moves."""
    batch, _, channels = shape
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = normal(kx, shape), 0.1 * normal(kw, (channels, WIDTH), jnp.float32)
    return x, w, 2 * x.size * 2 + w.size * 4 + batch * (WIDTH - 1) * channels * 2


def prefill_measure(x, w, reps=10, with_state=False):
    """measure(fn) -> seconds per prefill call fn(x, w) -> (y, state); y feeds the next step's x and, with_state,
    the state returned feeds the next step's state (as the model calls the kernel: always with a state)."""
    state0 = jnp.zeros((x.shape[0], WIDTH - 1, x.shape[2]), BF16)

    def measure(fn):
        def step(carry, w):
            return fn(carry[0], w, carry[1]) if with_state else fn(carry[0], w)
        return per_call_seconds(step, (x, state0), (w,), reps=reps, feed_back=False)
    return measure


def scale_seconds(x, reps=10):
    """Seconds per jitted y = 2x over x: the copy roofline of the same bytes."""
    return per_call_seconds(lambda x: x * 2, x, (), reps=reps, feed_back=False)


def bench_prefill(shape, rows, log):
    x, w, moved = prefill_inputs(shape)
    scale = scale_seconds(x)
    scale_rate = 2 * x.size * 2 / scale
    name = "x".join(map(str, shape))
    rows.append(("y = 2x (XLA)", name, scale, 2 * x.size * 2, scale_rate, None, ""))
    measure = prefill_measure(x, w)
    kernel_vs_jnp(rows, log, "sconv prefill", name, measure, shortconv_prefill, reference.shortconv_prefill,
                  STRIP_SWEEP, moved, scale_rate)
    return scale_rate


def prefill_sweep(shape, rows, log):
    """Every setting of STRIP_SWEEP, and the fastest again with a state (the model's call), against y = 2x timed
    before and after them; appends a row for each."""
    x, w, moved = prefill_inputs(shape)
    name = "x".join(map(str, shape))
    scale_before = scale_seconds(x)
    measure = prefill_measure(x, w)
    timed = []
    for blocks in STRIP_SWEEP:
        try:
            seconds = measure(functools.partial(shortconv_prefill, blocks=blocks))
        except Exception as err:  # a setting the backend rejects is reported, not fatal
            log(f"  {name} {blocks}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            continue
        log(f"  {name} {blocks}: {seconds * 1e6:.1f} us")
        timed.append(("sconv prefill", seconds, blocks))
    if timed:
        best = min(timed, key=lambda t: t[1])[2]
        seconds = prefill_measure(x, w, with_state=True)(functools.partial(shortconv_prefill, blocks=best))
        log(f"  + state {name} {best}: {seconds * 1e6:.1f} us")
        timed.append(("sconv prefill + state", seconds, best))
    scale_after = scale_seconds(x)
    scale_rate = 2 * x.size * 2 / min(scale_before, scale_after)  # the faster of the two: the stricter roofline
    for seconds in (scale_before, scale_after):
        rows.append(("y = 2x (XLA)", name, seconds, 2 * x.size * 2, scale_rate, None, ""))
    rows.extend((op, name, seconds, moved, scale_rate, None, str(blocks))
                for op, seconds, blocks in sorted(timed, key=lambda t: t[1]))


def bench_decode(shape, rows, log, copy_rate):
    tokens, channels = shape
    keys = jax.random.split(jax.random.key(1), 4)
    x, w = normal(keys[0], (tokens, channels)), 0.01 * normal(keys[1], (channels, WIDTH), jnp.float32)
    pool = normal(keys[2], (POOL_SLOTS, WIDTH - 1, channels))
    slots = jax.random.permutation(keys[3], POOL_SLOTS)[:tokens]
    moved = tokens * channels * 2 * (2 + 2 * (WIDTH - 1)) + w.size * 4

    def measure(fn):  # y feeds the next step's x; the pool stays in place
        return per_call_seconds(lambda carry, w, slots: fn(carry[0], w, carry[1], slots),
                                (x.copy(), pool.copy()), (w, slots), reps=50, feed_back=True)

    kernel_vs_jnp(rows, log, "sconv decode", f"N={tokens} C={channels}", measure, shortconv_decode,
                  reference.shortconv_decode, DECODE_SWEEP, moved, copy_rate)


def prologue_inputs(tokens, heads, kv_heads, with_tau, head_dim=HEAD_DIM, pool_slots=POOL_SLOTS,
                    cache_slots=CACHE_SLOTS):
    """(constant arguments, state carried from step to step, bytes a call moves) of the prologue."""
    keys = iter(jax.random.split(jax.random.key(2), 16))
    kv = kv_heads * head_dim
    consts = dict(
        k_conv_w=0.01 * normal(next(keys), (kv, WIDTH), jnp.float32),
        v_conv_w=0.01 * normal(next(keys), (kv, WIDTH), jnp.float32), q_norm_w=normal(next(keys), (head_dim,)),
        k_norm_w=normal(next(keys), (head_dim,)),
        slots=jax.random.permutation(next(keys), pool_slots)[:tokens],
        write_idx=jax.random.permutation(next(keys), cache_slots)[:tokens],
        tau=1.0 + jax.random.uniform(next(keys), (tokens,)) if with_tau else None)
    state = dict(q=normal(next(keys), (tokens, heads * head_dim)), k=normal(next(keys), (tokens, kv)),
                 v=normal(next(keys), (tokens, kv)), k_pool=normal(next(keys), (pool_slots, WIDTH - 1, kv)),
                 v_pool=normal(next(keys), (pool_slots, WIDTH - 1, kv)),
                 k_cache=normal(next(keys), (cache_slots, kv_heads, head_dim)),
                 v_cache=normal(next(keys), (cache_slots, kv_heads, head_dim)))
    moved = 2 * (2 * tokens * heads * head_dim + 6 * tokens * kv + 2 * 2 * (WIDTH - 1) * tokens * kv)
    moved += 2 * kv * WIDTH * 4 + tokens * 12
    return consts, state, moved


def prologue_measure(consts, state, tokens, reps=50):
    """measure(fn) -> seconds per prologue call; q, k, v out feed the next step's q, k, v and the pools and
    caches stay in place."""
    def measure(fn):
        def step(carry, consts):
            out = fn(**consts, **carry)
            names = ("q", "k", "v", "k_pool", "v_pool", "k_cache", "v_cache")
            return {name: a.reshape(tokens, -1) if i < 3 else a for i, (name, a) in enumerate(zip(names, out))}
        return per_call_seconds(step, jax.tree.map(jnp.copy, state), (consts,), reps=reps, feed_back=True)
    return measure


def bench_prologue(layer, tokens, rows, log, copy_rate):
    heads, kv_heads, with_tau = PROLOGUE_LAYERS[layer]
    consts, state, moved = prologue_inputs(tokens, heads, kv_heads, with_tau)
    measure = prologue_measure(consts, state, tokens)
    sweep = [b for b in PROLOGUE_SWEEP if kv_heads % b.kv_heads == 0]
    kernel_vs_jnp(rows, log, "prologue", f"{layer} Hkv={kv_heads} N={tokens}", measure, attn_prologue,
                  prologue_ref.attn_prologue, sweep, moved, copy_rate)


def table(rows):
    lines = ["| op | shape | us | MB moved | GB/s | BW vs y=2x | speedup vs jnp | blocks |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for op, shape, seconds, moved, base_rate, ref, blocks in rows:
        rate = moved / seconds
        speedup = f"{ref / seconds:.2f}" if ref else ""
        lines.append(f"| {op} | {shape} | {seconds * 1e6:.1f} | {moved / 1e6:.2f} | {rate / 1e9:.0f} | "
                     f"{rate / base_rate:.2f} | {speedup} | {blocks} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--sweep-seconds", type=float, default=SWEEP_SECONDS[0])
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only the prefill: each STRIP_SWEEP setting at PREFILL_SWEEP_SHAPES, a row each")
    args = parser.parse_args()
    SWEEP_SECONDS[0] = args.sweep_seconds
    detail_path = os.path.join(args.out, "shortconv_bench.log") if args.out else os.devnull

    def log(line):
        print(line, flush=True)
        with open(detail_path, "a") as f:  # written as we go: a run cut off still leaves its numbers
            f.write(line + "\n")

    log(f"{datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__}")
    rows = []

    def measured(count_before):
        for op, shape, seconds, *_ in rows[count_before:]:
            log(f"  = {op} {shape}: {seconds * 1e6:.1f} us")

    if args.prefill_sweep:
        for shape in PREFILL_SWEEP_SHAPES:
            prefill_sweep(shape, rows, log)
            log(table(rows))  # after each shape: a run cut short still leaves a table
        return
    copy_rate = None
    for shape in PREFILL_SHAPES:
        count = len(rows)
        rate = bench_prefill(shape, rows, log)
        copy_rate = copy_rate or rate  # y = 2x at the largest shape: the bandwidth roofline
        measured(count)
    for shape in DECODE_SHAPES:
        count = len(rows)
        bench_decode(shape, rows, log, copy_rate)
        measured(count)
    for layer in PROLOGUE_LAYERS:
        for tokens in PROLOGUE_TOKENS:
            count = len(rows)
            bench_prologue(layer, tokens, rows, log, copy_rate)
            measured(count)
    if args.out:
        with open(os.path.join(args.out, "shortconv_bench.json"), "w") as f:
            json.dump(rows, f)
    log(f"\ncopy roofline (y = 2x, {PREFILL_SHAPES[0]} bf16): {copy_rate / 1e9:.0f} GB/s")
    log(table(rows))


if __name__ == "__main__":
    main()
