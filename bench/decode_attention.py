"""Decode attention on one GPU: Inkling's paged (full layers) and ring (sliding layers) kernels against a copy
bandwidth measured in the same run, the jitted jnp reference and the peer decode kernels (no bias) of
../shared/peers at the same shape.

Run: PYTHONPATH=. python bench/decode_attention.py   (prints one table last; KV GB/s = K+V bytes read / time)
The cases (shapes, inputs, jitted calls, timer) are in bench/decode_attention_cases.py, shared with kernels.py.
"""

import functools
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leaves room for the torch peer
warnings.filterwarnings("ignore")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.ceilings import copy_bandwidth, read_bandwidth  # noqa: E402
from bench.decode_attention_cases import (CONTEXT, DIM, HEADS, KV_FULL, KV_RING, PAGE, PAGED, RING,  # noqa: E402
                                          WINDOW, copies_for, cudnn_decode_ms, paged_fn, paged_inputs, ring_fn,
                                          ring_inputs, timed_ms)
from pallas_kernels.decode_attention import paged_decode_reference, ring_decode_reference  # noqa: E402

ROWS = []  # (case, ms, bytes, reference ms, best peer ms)
TORCH = {}  # torch peer times (ms) measured in a child process, so torch and JAX never share one CUDA context
TORCH_SHAPES = [(b, CONTEXT, KV_FULL) for b in (64, 1, 8)] + [(b, WINDOW, KV_RING) for b in (64, 1, 8)]


def torch_peers():
    """Child process: torch device copy and SDPA decode (no bias) at each shape; prints one JSON dict."""
    import json

    import torch
    from triton.testing import do_bench

    times = {"version": f"torch {torch.__version__} on {torch.cuda.get_device_name()}"}
    buffers = [torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)]
    buffers.append(torch.empty_like(buffers[0]))
    times["copy"] = do_bench(lambda: buffers[1].copy_(buffers[0]), warmup=25, rep=200, return_mode="median")
    buffers.clear()  # 4 GiB back before the attention shapes
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


def attempt(name, thunk):
    try:
        return thunk()
    except Exception as e:  # noqa: BLE001 - one failing case must not stop the run
        print(f"{name}: FAILED {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}")
        traceback.print_exc(file=sys.stderr)
        return None


def report(name, ms, nbytes, extra=""):
    if ms is not None:
        print(f"{name:<62} {ms:8.3f} ms {nbytes / ms / 1e6:8.0f} GB/s {extra}", flush=True)


def copy_ceilings():
    """The best of the XLA copy and read ceilings (2 GiB bf16, random values) and torch's copy, in bytes/ms."""
    copy, read = copy_bandwidth(data="normal"), read_bandwidth(data="normal")
    for name, rate in (("y = 2*x, 2 GiB bf16 (read + write)", copy), ("sum(x), 2 GiB bf16 (read only)", read)):
        print(f"{'ceiling: XLA ' + name:<62} {rate / 1e9:20.0f} GB/s", flush=True)
    best = max(copy, read) / 1e3
    if "copy" in TORCH:
        moved = 2 * (2 << 30)  # 2 GiB read and written
        report("ceiling: torch d2d copy, 2 GiB bf16 (read + write)", TORCH["copy"], moved)
        best = max(best, moved / TORCH["copy"])
    return best


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
