"""Rebuild BENCHMARKS.md from the per-benchmark result files in bench/results/."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = [("Whole model (bench preset)", "model.md"), ("Kernel targets in one table", "kernels.md"),
            ("MoE grouped matmul", "moe.md"),
            ("Dense matmuls of the decode step", "dense_matmuls.md"),
            ("Relative flash attention", "rel_attention.md"),
            ("Prefill chunks over the KV cache", "chunk_attention.md"), ("Decode attention", "decode_attention.md"),
            ("ShortConv and the fused decode prologue", "shortconv.md"), ("Checkpoint conversion", "convert.md"),
            ("Training", "train.md"), ("Serving", "serve.md")]


def main():
    out = ["# Benchmarks", "",
           "Measured results only; each section says the date, device, versions and the command that produced it.",
           "The per-benchmark files in `bench/results/` are the sources; this page collects them",
           "(`python bench/collect.py` rebuilds it).", ""]
    for title, file in SECTIONS:
        path = os.path.join(ROOT, "bench", "results", file)
        if not os.path.exists(path):
            continue
        lines = open(path).read().strip().splitlines()
        if lines and lines[0].startswith("# "):
            lines = lines[1:]  # the section title replaces the file's own
        out += [f"## {title}", ""] + ["#" + line if line.startswith("## ") else line for line in lines] + [""]
    with open(os.path.join(ROOT, "BENCHMARKS.md"), "w") as fh:
        fh.write("\n".join(out))


if __name__ == "__main__":
    main()
