"""The table `python -m benchmarks.moe` prints last (and its JSON): every row's times and rates against the
peer's row and the matmul ceiling of the same run, the decode steps against the copy bandwidth, the quantised
experts against the read bandwidth."""

from benchmarks.timing import save_json, stamp_line

PEER = "kernel: jax Mosaic-GPU ragged_dot"  # the row the others are compared with
# The layer (routing layout, gathers and combine around the kernels) against the grouped FFN alone, both ours
OURS_LAYER = "layer: ours, shared as XLA einsum"
OURS_KERNEL = "kernel: ours (moe_ffn)"


def summary(run, out, seconds: float):
    """Prints the table; writes moe_bench.json into `out` (if given). `seconds`: the run's time so far."""
    s, r = run.s, run.results
    copy, peak = r.get("copy_GBps", float("nan")), r.get("matmul_TFLOPs", float("nan"))
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = ["", f"{stamp_line(r['stamp'])}; copy {copy:.0f} GB/s; XLA bf16 matmul {peak:.0f} TFLOP/s; "
             f"prefill {s.tokens} tokens x (top-{s.top_k} + {s.shared} shared), H={s.hidden} I={s.width} bf16; "
             f"{seconds:.0f} s",
             "| case | backend | fwd ms | fwd TFLOP/s | /matmul | vs peer | fwd+bwd ms | fwd+bwd TFLOP/s | /matmul "
             "| vs peer | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    peer = r["rows"].get(PEER, {})
    for name, row in r["rows"].items():
        cells = []
        for k in ("fwd", "fwdbwd"):
            rate, ms, peer_ms = row[f"{k}_TFLOPs"], row[f"{k}_ms"], peer.get(f"{k}_ms")
            cells += [fmt(ms, ".2f"), fmt(rate, ".1f"), fmt(rate and rate / peak, ".2f"),
                      fmt(ms and peer_ms and peer_ms / ms, ".3f")]
        lines.append(f"| {name} | {row['backend']} | " + " | ".join(cells) + f" | {row['note']} |")
    layer, kernel = r["rows"].get(OURS_LAYER, {}), r["rows"].get(OURS_KERNEL, {})
    over = {k: layer.get(f"{k}_ms") and kernel.get(f"{k}_ms") and layer[f"{k}_ms"] / kernel[f"{k}_ms"]
            for k in ("fwd", "fwdbwd")}
    lines.append(f"our layer's time over our kernel's: forward {fmt(over['fwd'], '.3f')}, "
                 f"forward + backward {fmt(over['fwdbwd'], '.3f')}")
    for tokens, row in r["decode"].items():
        cells = [f"{k[:-3]} {fmt(row.get(k), '.0f')} us = {fmt(row.get(k[:-3] + '_of_copy'), '.2f')} of copy"
                 for k in row if k.endswith("_us")]
        lines.append(f"| decode {tokens} tok: {row['touched_experts']} experts, {row['weight_GB']:.2f} GB | "
                     + " | ".join(cells) + " |")
    if "quantized" in r:
        lines += [f"read {r['read_GBps']:.0f} GB/s",
                  "| tokens | precision | us | of read | TFLOP/s | rel. L2 vs bf16 |",
                  "| ---: | --- | ---: | ---: | ---: | ---: |"]
        for tokens, row in r["quantized"].items():
            for name in ("bf16", "fp8", "nvfp4"):
                if name in row:
                    cell = row[name]
                    lines.append(f"| {tokens} | {name} | {cell['us']:.0f} | {cell['of_read']:.2f} | "
                                 f"{cell['TFLOPs']:.0f} | {fmt(row.get(f'{name}_vs_bf16_rel_l2'), '.3f')} |")
    for k in ("rel_err_vs_mgpu_peer", "errors"):
        if r.get(k):
            lines.append(f"{k}: {r[k]}")
    print("\n".join(lines), flush=True)
    if out:
        save_json(out, "moe_bench.json", r)
