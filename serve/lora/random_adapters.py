"""Random LoRA adapters in `train.lora`'s names (what `train.run --lora-rank` writes, `train.lora.save_adapters`),
for the tests and the benchmarks: nonzero A and B, large enough to change greedy tokens."""

import numpy as np

from train import lora


def random_factors(shapes: dict[str, tuple[int, ...]], rank: int, seed: int) -> dict[str, np.ndarray]:
    """For each base weight -> shape ([in, out], experts' [experts, in, out]) of `shapes`, in its order: A [..., in,
    rank] ~ N(0, 1 / in) and B [..., rank, out] ~ N(0, 1 / 4), fp32."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (*lead, fan_in, fan_out) in shapes.items():
        out[name + lora.A] = (rng.standard_normal((*lead, fan_in, rank)) / np.sqrt(fan_in)).astype(np.float32)
        out[name + lora.B] = (rng.standard_normal((*lead, rank, fan_out)) * 0.5).astype(np.float32)
    return out
