"""The metrics of a run, named as vLLM's serving benchmark names them in its saved JSON, and their printout.

TTFT is arrival of the first chunk; TPOT per request (latency - TTFT) / (output tokens - 1), for requests of more
than one token; ITL every gap between chunks, of all requests together; E2EL a request's whole latency. Each is
given as mean, median, std and the asked percentiles, in milliseconds.
"""

from __future__ import annotations

import numpy as np

from benchmarks.load.client import Result

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def metrics(results: list[Result], duration: float, percentiles: tuple[float, ...] = (99,)) -> dict:
    done = [r for r in results if r.success]
    values = {"ttft": [r.ttft for r in done],
              "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
              "itl": [gap for r in done for gap in r.itl],
              "e2el": [r.latency for r in done]}
    total_in, total_out = sum(r.prompt_len for r in done), sum(r.output_len for r in done)
    out = {"duration": duration, "completed": len(done), "failed": len(results) - len(done),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(done) / duration, "input_throughput": total_in / duration,
           "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration}
    for name in LATENCIES:
        ms = 1e3 * np.asarray(values[name] or [0.0])  # no values (say no request had two tokens): zeros
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"] = float(ms.mean()), float(np.median(ms))
        out[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def details(results: list[Result]) -> dict:
    """Per request, as vLLM saves them: token counts, TTFT and ITLs (seconds), and the errors."""
    return {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "errors": [r.error for r in results]}


def summary(found: dict, percentiles: tuple[float, ...] = (99,)) -> str:
    """The metrics as aligned lines, for the terminal."""
    rows = [("completed requests", found["completed"]), ("failed requests", found["failed"]),
            ("duration (s)", found["duration"]), ("input tokens", found["total_input_tokens"]),
            ("output tokens", found["total_output_tokens"]),
            ("request throughput (req/s)", found["request_throughput"]),
            ("input throughput (tok/s)", found["input_throughput"]),
            ("output throughput (tok/s)", found["output_throughput"]),
            ("total token throughput (tok/s)", found["total_token_throughput"])]
    for name in LATENCIES:
        for stat in ("mean", "median", "std", *(f"p{p:g}" for p in percentiles)):
            rows.append((f"{stat} {name.upper()} (ms)", found[f"{stat}_{name}_ms"]))
    return "\n".join(f"{label:<32}{value:>14.2f}" if isinstance(value, float) else f"{label:<32}{value:>14}"
                     for label, value in rows)
