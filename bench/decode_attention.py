"""Decode attention on one GPU: Inkling's paged (full layers) and ring (sliding layers) kernels against a copy
bandwidth measured in the same run, the jitted jnp reference and the peer decode kernels (no bias) of
../shared/peers at the same shape.

Run: PYTHONPATH=. python bench/decode_attention.py   (prints one table last; KV GB/s = K+V bytes read / time)
The input builders and timers take a `CacheShape` so that bench/kernels.py can reuse them (also tiny, on CPU).
"""

import dataclasses
import functools
import math
import os
import statistics
import sys
import time
import traceback
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leaves room for the torch peer
warnings.filterwarnings("ignore")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.decode_attention import (contiguous_as_pages, paged_decode_attention,  # noqa: E402
                                             paged_decode_reference, ring_decode_attention, ring_decode_reference)

HEADS, DIM, D_REL, EXTENT_FULL, WINDOW = 64, 128, 16, 1024, 512
KV_FULL, KV_RING, CONTEXT, PAGE = 8, 16, 8192, 128


@dataclasses.dataclass(frozen=True)
class CacheShape:
    kv_heads: int
    context: int  # keys per sequence: the full context (paged) or the window (ring)
    extent: int
    heads: int = HEADS
    dim: int = DIM
    d_rel: int = D_REL
    page: int = PAGE

    def kv_bytes(self, batch):
        """K + V bytes (bf16) of every visible key."""
        return 2 * batch * self.context * self.kv_heads * self.dim * 2


PAGED = CacheShape(kv_heads=KV_FULL, context=CONTEXT, extent=EXTENT_FULL)
RING = CacheShape(kv_heads=KV_RING, context=WINDOW, extent=WINDOW)
L2_DEFEAT_BYTES = 256 << 20  # rotate input copies until this many bytes: the H200's L2 is 60 MB
ROWS = []  # (case, ms, bytes, reference ms, best peer ms)
TORCH = {}  # torch peer times (ms) measured in a child process, so torch and JAX never share one CUDA context
TORCH_SHAPES = [(b, CONTEXT, KV_FULL) for b in (64, 1, 8)] + [(b, WINDOW, KV_RING) for b in (64, 1, 8)]


def torch_peers():
    """Child process: torch device copy and SDPA decode (no bias) at each shape; prints one JSON dict."""
    import json

    import torch
    from triton.testing import do_bench

    times = {"version": f"torch {torch.__version__} on {torch.cuda.get_device_name()}"}
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times["copy"] = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    for batch, seq, kv_heads in TORCH_SHAPES:
        q = torch.randn(batch, HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, seq, DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        times[f"sdpa {batch} {seq} {kv_heads}"] = do_bench(lambda: sdpa(q, k, v, enable_gqa=True), warmup=25,
                                                          rep=100, return_mode="median")
    print("TORCH_JSON", json.dumps(times))


def run_torch_peers():
    import json
    import subprocess
    done = subprocess.run([sys.executable, __file__, "--torch-peers"], capture_output=True, text=True, timeout=90)
    for line in done.stdout.splitlines():
        if line.startswith("TORCH_JSON "):
            TORCH.update(json.loads(line[len("TORCH_JSON "):]))
    if not TORCH:
        print("torch peers failed:", done.stderr.strip().splitlines()[-3:])


def timed_ms(fn, arg_sets, reps=5):
    """Median over reps of the time per call of fn. One jitted step runs fn on every input set in turn, so host
    dispatch is amortised over len(arg_sets) calls, as inside a model's decode step (warm-up first)."""
    step = jax.jit(lambda sets: [fn(*args) for args in sets])
    jax.block_until_ready(step(arg_sets))
    iters = max(5, math.ceil(20 / len(arg_sets)))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            out = step(arg_sets)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / (iters * len(arg_sets)))
    return statistics.median(samples) * 1e3


def attempt(name, thunk):
    try:
        return thunk()
    except Exception as e:  # noqa: BLE001 - one failing case must not stop the run
        print(f"{name}: FAILED {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}")
        traceback.print_exc(file=sys.stderr)
        return None


def copies_for(nbytes):
    return max(1, min(64, math.ceil(L2_DEFEAT_BYTES / nbytes)))


def normal(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(key, shape, dtype)


def report(name, ms, nbytes, extra=""):
    if ms is not None:
        print(f"{name:<62} {ms:8.3f} ms {nbytes / ms / 1e6:8.0f} GB/s {extra}", flush=True)


def copy_ceilings():
    x = normal(jax.random.key(0), (1 << 30,))  # 2 GiB
    ms = timed_ms(jax.jit(lambda a: a * 2), [(x,)])
    report("ceiling: XLA y = 2*x, 2 GiB bf16 (read + write)", ms, 2 * x.nbytes)
    read_ms = timed_ms(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), [(x,)])
    report("ceiling: XLA sum(x), 2 GiB bf16 (read only)", read_ms, x.nbytes)
    best = max(2 * x.nbytes / ms, x.nbytes / read_ms)
    if "copy" in TORCH:
        report("ceiling: torch d2d copy, 2 GiB bf16 (read + write)", TORCH["copy"], 2 * x.nbytes)
        best = max(best, 2 * x.nbytes / TORCH["copy"])
    return best  # bytes per ms


def paged_inputs(key, batch, shuffle, copies, shape=PAGED):
    """`copies` independent caches [B*L/page, page, Hkv, D] (contiguous layout, identity or shuffled table),
    every sequence full."""
    sets = []
    dense = (batch, shape.context, shape.kv_heads, shape.dim)
    for c in range(copies):
        ks = jax.random.split(jax.random.fold_in(key, c), 6)
        k_pages, table = contiguous_as_pages(normal(ks[0], dense), shape.page)
        v_pages, _ = contiguous_as_pages(normal(ks[1], dense), shape.page)
        if shuffle:
            table = jax.random.permutation(ks[2], table.size).reshape(table.shape).astype(jnp.int32)
        lengths = jnp.full((batch,), shape.context, jnp.int32)
        tau = 1.0 + 0.1 * jnp.log(jnp.maximum(1.0, lengths / 128000.0))
        sets.append((normal(ks[3], (batch, shape.heads, shape.dim)), k_pages, v_pages, table, lengths,
                     normal(ks[4], (batch, shape.heads, shape.d_rel)), normal(ks[5], (shape.d_rel, shape.extent)),
                     tau))
    return sets


def ring_inputs(batch, copies, shape=RING):
    """`copies` independent rings [B, window, Hkv, D], each sequence 7893..8192 tokens long (rings wrapped)."""
    sets = []
    ring = (batch, shape.context, shape.kv_heads, shape.dim)
    for c in range(copies):
        ks = jax.random.split(jax.random.fold_in(jax.random.key(100 + batch), c), 6)
        sets.append((normal(ks[0], (batch, shape.heads, shape.dim)), normal(ks[1], ring), normal(ks[2], ring),
                     CONTEXT - jax.random.randint(ks[3], (batch,), 0, 300, jnp.int32),
                     normal(ks[4], (batch, shape.heads, shape.d_rel)), normal(ks[5], (shape.d_rel, shape.extent))))
    return sets


def ring_fn(impl=ring_decode_attention, shape=RING, **launch):
    """jit of impl over the positional tuples of `ring_inputs` (the window is the ring's length)."""
    return jax.jit(functools.partial(impl, window=shape.context, **launch))


def cudnn_decode_ms(q, k, v, implementation="cudnn"):
    """jax.nn.dot_product_attention of one query per sequence over dense k, v [B, S, Hkv, D], no bias."""
    return timed_ms(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q[:, None], k, v, implementation=implementation)), [(q, k, v)])


def paged_fn(impl=paged_decode_attention, **launch):
    """jit of impl over the positional tuples of `paged_inputs` (tau is keyword-only)."""
    def run(q, k, v, table, lengths, r, p, tau):
        return impl(q, k, v, table, lengths, r, p, tau=tau, **launch)
    return jax.jit(run)


def peers_full(q, k, v):
    """No-bias decode peers on the contiguous cache k, v [B, S, Hkv, D]; returns {name: ms}."""
    batch, seq, kv_heads, dim = k.shape
    times = {}
    times["peer XLA einsum decode (GQA)"] = attempt("xla", lambda: timed_ms(jax.jit(
        lambda q, k, v: jnp.einsum("bhgs,bshd->bhgd", jax.nn.softmax(jnp.einsum(
            "bhgd,bshd->bhgs", q.reshape(batch, kv_heads, -1, dim).astype(jnp.float32), k.astype(jnp.float32)),
            axis=-1), v.astype(jnp.float32))), [(q, k, v)]))
    times["peer jax.nn.dpa[cudnn] T=1"] = attempt("cudnn", lambda: cudnn_decode_ms(q, k, v))

    def triton_peer():
        from jax.experimental.pallas.ops.gpu import decode_attention as da
        inner = functools.partial(da.decode_attn_unbatched, sm_scale=1 / dim, block_h=16, block_k=128,
                                  k_splits=16, num_warps=None, num_stages=2, grid=None, interpret=False,
                                  debug=False, return_residuals=False, normalize_output=True)
        kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        fn = jax.jit(lambda q, k, v: jax.vmap(jax.vmap(inner))(q.reshape(batch, kv_heads, -1, dim), k, v,
                                                               None, None))
        return timed_ms(fn, [(q, kt, vt)])
    times["peer pallas-triton decode, KV pre-laid [B,Hkv,S,D]"] = attempt("triton peer", triton_peer)

    times["peer torch sdpa (enable_gqa), separate process"] = TORCH.get(f"sdpa {batch} {seq} {kv_heads}")
    for name, ms in times.items():
        report(f"  {name}", ms, 2 * k.nbytes)
    return times


def bench_paged(batch, configs):
    key = jax.random.key(batch)
    kv_bytes = PAGED.kv_bytes(batch)
    sets = paged_inputs(key, batch, shuffle=True, copies=copies_for(kv_bytes))
    print(f"--- paged B={batch} context={CONTEXT} Hq={HEADS} Hkv={KV_FULL} D={DIM} page={PAGE} bf16, "
          f"KV {kv_bytes / 1e9:.3f} GB, {len(sets)} input copies", flush=True)
    results = {}
    for launch in [dict()] + configs:
        ms = attempt(f"paged {launch}", lambda launch=launch: timed_ms(paged_fn(**launch), sets))
        report(f"kernel shuffled table {launch or 'defaults'}", ms, kv_bytes)
        if ms is not None:
            results[str(launch or "defaults")] = ms
    best_name = min(results, key=results.get) if results else None
    identity = paged_inputs(key, batch, shuffle=False, copies=len(sets))
    ms_identity = attempt("paged identity", lambda: timed_ms(paged_fn(), identity))
    report("kernel contiguous cache via identity table, defaults", ms_identity, kv_bytes)
    reference = paged_fn(paged_decode_reference)
    ref_ms = attempt("paged reference", lambda: timed_ms(reference, sets[:1]))
    report("jnp reference (jitted, gathers pages)", ref_ms, kv_bytes)
    err = attempt("paged check", lambda: check_against_reference(paged_fn(), reference, sets[0]))
    print(f"  defaults vs fp32 reference: relative error {err}")
    q, k_pages, v_pages = sets[0][:3]
    dense = (batch, CONTEXT, KV_FULL, DIM)
    peers = peers_full(q, k_pages.reshape(dense), v_pages.reshape(dense))
    best_peer = min((t for t in peers.values() if t), default=None)
    ROWS.append((f"paged B={batch} defaults", results.get("defaults"), kv_bytes, ref_ms, best_peer))
    if best_name and best_name != "defaults":
        ROWS.append((f"paged B={batch} best {best_name}", results[best_name], kv_bytes, ref_ms, best_peer))


def check_against_reference(kernel, reference, args):
    """Relative error of the bf16 kernel against the reference on the same inputs upcast to fp32, at full
    matmul precision."""
    upcast = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(reference(*upcast), np.float32)
    out = np.asarray(kernel(*args), np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def bench_ring(batch, configs):
    kv_bytes = RING.kv_bytes(batch)
    sets = ring_inputs(batch, copies_for(kv_bytes))
    print(f"--- ring B={batch} window={WINDOW} Hq={HEADS} Hkv={KV_RING} D={DIM} bf16, KV {kv_bytes / 1e9:.3f} GB, "
          f"{len(sets)} input copies", flush=True)
    results = {}
    for launch in [dict()] + configs:
        fn = ring_fn(**launch)
        ms = attempt(f"ring {launch}", lambda fn=fn: timed_ms(fn, sets))
        report(f"kernel {launch or 'defaults'}", ms, kv_bytes)
        if ms is not None:
            results[str(launch or "defaults")] = ms
    reference = ring_fn(ring_decode_reference)
    ref_ms = attempt("ring reference", lambda: timed_ms(reference, sets[:1]))
    report("jnp reference (jitted)", ref_ms, kv_bytes)
    err = attempt("ring check", lambda: check_against_reference(ring_fn(), reference, sets[0]))
    print(f"  defaults vs fp32 reference: relative error {err}")
    q, k, v = sets[0][:3]
    cudnn = attempt("ring cudnn", lambda: cudnn_decode_ms(q, k, v))
    report("  peer jax.nn.dpa[cudnn] T=1 over the 512 window keys (no bias)", cudnn, kv_bytes)
    sdpa = TORCH.get(f"sdpa {batch} {WINDOW} {KV_RING}")
    report("  peer torch sdpa (enable_gqa) over the 512 window keys (no bias)", sdpa, kv_bytes)
    cudnn = min((t for t in (cudnn, sdpa) if t), default=None)
    best_name = min(results, key=results.get) if results else None
    ROWS.append((f"ring B={batch} defaults", results.get("defaults"), kv_bytes, ref_ms, cudnn))
    if best_name and best_name != "defaults":
        ROWS.append((f"ring B={batch} best {best_name}", results[best_name], kv_bytes, ref_ms, cudnn))


def main():
    started = time.perf_counter()
    budget_s = float(os.environ.get("DECODE_BENCH_BUDGET_S", "600"))  # later sections are skipped past this
    attempt("torch peers", run_torch_peers)  # before JAX touches the GPU
    print("jax", jax.__version__, jax.devices(), "|", TORCH.get("version", "torch peers unavailable"), flush=True)
    copy_bytes_per_ms = copy_ceilings()
    # Launch variants tried besides the defaults (the best one gets its own row in the table).
    paged_sweep = [dict(num_splits=s) for s in (1, 2, 4, 8)] + [
        dict(num_splits=4, num_warps=8), dict(num_splits=4, num_stages=3),
        dict(num_splits=4, num_warps=8, num_stages=3), dict(num_splits=4, pages_per_block=2, num_warps=8)]
    ring_sweep = [dict(num_splits=2), dict(num_stages=3), dict(num_stages=1), dict(block_slots=64),
                  dict(block_slots=64, num_splits=2), dict(block_slots=64, num_stages=3), dict(block_slots=256)]
    sections = [(bench_paged, 64, paged_sweep), (bench_ring, 64, ring_sweep),
                (bench_paged, 1, [dict(num_splits=16), dict(num_splits=32), dict(num_warps=8)]),
                (bench_ring, 1, [dict(block_slots=64, num_splits=8), dict(block_slots=32, num_splits=16)]),
                (bench_paged, 8, [dict(num_splits=4), dict(num_splits=16)]),
                (bench_ring, 8, [dict(block_slots=64, num_splits=8), dict(block_slots=64)])]
    for bench, batch, configs in sections:
        if time.perf_counter() - started > budget_s:
            print(f"skipped {bench.__name__} B={batch}: past the {budget_s:.0f} s budget")
            continue
        attempt(f"{bench.__name__} {batch}", lambda: bench(batch, configs))
    print_table(copy_bytes_per_ms)


def print_table(copy_bytes_per_ms):
    print(f"\n=== decode attention, bf16, KV GB/s vs best copy ceiling {copy_bytes_per_ms / 1e6:.0f} GB/s ===")
    print(f"{'case':<52} {'ms':>8} {'KV GB/s':>8} {'/copy':>6} {'ref/ker':>8} {'peer/ker':>8}")
    for name, ms, nbytes, ref_ms, peer_ms in ROWS:
        if ms is None:
            print(f"{name:<52} FAILED")
            continue
        ratio = lambda other: f"{other / ms:8.2f}" if other else f"{'-':>8}"  # noqa: E731
        print(f"{name:<52} {ms:8.3f} {nbytes / ms / 1e6:8.0f} {nbytes / ms / copy_bytes_per_ms:6.2f} "
              f"{ratio(ref_ms)} {ratio(peer_ms)}")


if __name__ == "__main__":
    torch_peers() if "--torch-peers" in sys.argv else main()
