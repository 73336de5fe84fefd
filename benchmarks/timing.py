"""What every benchmark shares: the timer, the device ceilings it divides by (measured in the same run), the
stamp that says where and with what a figure was measured, and the guard that keeps one failed measurement from
costing the rest of a run.

- `median_seconds`: seconds per call of a (jitted) function, the median over trials after warm-up;
- `chained_seconds`: seconds per step of a jitted chain of dependent steps (kernels too short to time alone);
- `copy_bandwidth`: bytes/s of a jitted `y = 2x` over bf16, counting the bytes read and the bytes written;
- `read_bandwidth`: bytes/s of a jitted fp32-accumulated sum over bf16, counting the bytes read;
- `matmul_flops`: FLOP/s of a jitted bf16 n x n x n matmul;
- `stamp`: date, device and versions, for the line every table starts with (`versions` alone where no device
  is used);
- `save_json`: a benchmark's results file, the folder made if needed, written whole or not at all;
- `show_progress_logs`: the engine's and trainer's INFO lines (compile times, pool sizes) as a run goes.

The ceilings' input data is an explicit argument, `data="ones"` or `data="normal"`, because it changes the
result: an H200's matmuls are power-limited, and constant inputs toggle fewer bits than random ones, so the same
matmul runs at a higher clock on ones. Each benchmark passes the kind its figures in docs/performance.md were
measured with. Every ceiling times `CALLS` back-to-back calls per trial, so that the host's dispatch and wait
are not charged to the device.

    python -m benchmarks.timing [--data ones|normal]     # the stamp and the three ceilings
"""

import argparse
import datetime
import gc
import importlib.metadata
import json
import logging
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

DATA = ("ones", "normal")
CALLS = 5


def median_seconds(fn, *args, trials=10, warmup=1, calls=1):
    """Seconds per call of fn(*args): `warmup` calls first (the first compiles), then `trials` trials of `calls`
    back-to-back calls each, waiting for the device once at a trial's end; the median over trials of a trial's
    time / calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def chained_seconds(step, carry, consts, *, reps, feed_back, calls=4, trials=5):
    """Seconds per step(carry, *consts) -> carry, timed as one jitted chain of `reps` dependent steps.

    Each step reads what the one before wrote, and optimisation barriers keep them apart, so XLA can neither
    merge nor drop any, and no host launch falls between them. With `feed_back` the (donated) result starts the
    next call, which keeps pools and caches in place; without, every call restarts from `carry`, which keeps
    values bounded."""
    def run(carry, *consts):
        for _ in range(reps):
            carry = jax.lax.optimization_barrier(step(carry, *consts))
        return carry

    chain = jax.jit(run, donate_argnums=0 if feed_back else ())
    state = [carry]

    def call():
        state[0] = chain(state[0] if feed_back else carry, *consts)
        return state[0]

    seconds = median_seconds(call, trials=trials, calls=calls) / reps
    floats = [a for a in jax.tree.leaves(state[0]) if jnp.issubdtype(a.dtype, jnp.floating)]
    if not all(bool(jnp.isfinite(a).all()) for a in floats):
        print("WARNING: non-finite values at the end of a timed chain", flush=True)
    return seconds


def filled(shape, *, data, seed=0):
    """A bf16 array of `shape`: all ones, or standard normal values."""
    if data == "ones":
        return jnp.ones(shape, jnp.bfloat16)
    if data == "normal":
        return jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    raise ValueError(f"data must be one of {DATA}, not {data!r}")


def copy_bandwidth(elements=1 << 30, *, data, trials=10):
    """Bytes read + written per second by a jitted y = 2x over `elements` bf16 values (default 2 GiB)."""
    x = filled((elements,), data=data)
    return 2 * x.nbytes / median_seconds(jax.jit(lambda a: a * 2), x, trials=trials, calls=CALLS)


def read_bandwidth(elements=1 << 30, *, data, trials=10):
    """Bytes read per second by a jitted sum (fp32 accumulation) over `elements` bf16 values (default 2 GiB)."""
    x = filled((elements,), data=data)
    seconds = median_seconds(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x, trials=trials, calls=CALLS)
    return x.nbytes / seconds


def matmul_flops(n=8192, *, data, trials=10):
    """FLOP/s (2 n^3 per call) of a jitted bf16 [n, n] @ [n, n] of two independent inputs."""
    a, b = filled((n, n), data=data, seed=1), filled((n, n), data=data, seed=2)
    return 2 * n ** 3 / median_seconds(jax.jit(lambda p, q: p @ q), a, b, trials=trials, calls=CALLS)


def stamp(**peers) -> dict:
    """Where and with what this run measures: date, device kind and count, and the versions of jax, jaxlib and
    flax; `peers` adds the versions of what it measures against (torch, transformers)."""
    return {"date": str(datetime.date.today()), "device": jax.devices()[0].device_kind,
            "devices": jax.device_count(), **versions("jax", "jaxlib", "flax"), **{k: v for k, v in peers.items() if v}}


def stamp_line(found: dict) -> str:
    """A stamp as the first line of a table: '2026-12-02, 1 x NVIDIA H200, jax 0.11.2, jaxlib 0.11.2, ...'."""
    versions = ", ".join(f"{k} {v}" for k, v in found.items() if k not in ("date", "device", "devices"))
    return f"{found['date']}, {found['devices']} x {found['device']}, {versions}"


def versions(*packages) -> dict:
    """{package: installed version} of those installed."""
    found = {}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def save_json(directory: str, name: str, data) -> str:
    """Writes `data` as DIRECTORY/NAME (indented JSON; numpy and jax scalars as numbers, any other value JSON
    lacks as its str) through a temporary file, so that a run cut short leaves the last complete file; returns
    the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, default=lambda v: v.item() if hasattr(v, "item") else str(v))
    os.replace(path + ".tmp", path)
    return path


def show_progress_logs() -> None:
    """The INFO lines of serve, train and inkling_jax (warm-up compile times, KV pool sizes), stamped with the
    time, on stderr (unless logging has handlers already): a run cut short on a GPU still shows where its time
    went."""
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    for name in ("serve", "train", "inkling_jax"):
        logging.getLogger(name).setLevel(logging.INFO)


def attempt(label, fn, errors: dict | None = None):
    """fn(), or None when it raises: the failure is printed (traceback to stderr) and, given `errors`, recorded
    there under `label`. An out-of-memory or a shape a backend rejects is a result too; the run goes on."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one failure must not cost the rest of the run
        message = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        print(f"{label} FAILED {message}", flush=True)
        traceback.print_exc(file=sys.stderr)
        if errors is not None:
            errors[label] = message
        return None
    finally:
        gc.collect()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="normal", choices=DATA)
    parser.add_argument("--elements", type=int, default=1 << 30, help="bf16 values of the bandwidth ceilings")
    parser.add_argument("--n", type=int, default=8192, help="size of the square matmul")
    args = parser.parse_args(argv)
    print(stamp_line(stamp()), "data", args.data)
    print(f"y = 2x (read + write): {copy_bandwidth(args.elements, data=args.data) / 1e9:.0f} GB/s")
    print(f"sum(x) (read):         {read_bandwidth(args.elements, data=args.data) / 1e9:.0f} GB/s")
    print(f"bf16 matmul {args.n}^3:   {matmul_flops(args.n, data=args.data) / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
