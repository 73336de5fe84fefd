"""When each request is sent: at once (`request_rate` inf), or after gamma-distributed gaps whose mean is
1 / request_rate. Shape `burstiness` 1 is a Poisson process (exponential gaps); below 1 the requests come in
bursts, above 1 more evenly (vLLM's `--burstiness`)."""

from __future__ import annotations

import math

import numpy as np


def send_offsets(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds from the start at which each of n requests is sent; the first at 0."""
    if not request_rate > 0:
        raise ValueError(f"the request rate must be > 0 (inf: all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"the burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])[:n]
