"""LoRA: low-rank adapters on the attention projections (q, k, v, r, o), the dense MLP, the routed experts and the
shared experts. Only the adapters train; the base weights stay frozen in the compute dtype.

Every adapted weight W [..., in, out] (experts carry a leading expert axis) gets A [..., in, r] and
B [..., r, out]; the model runs with W + (alpha / r) * A @ B, formed in fp32 inside the step. Merging in weight
space keeps every MoE backend (dense, ragged, Pallas) and the export path unchanged: the merged dict *is* a
model. B starts at zero, so training starts from the base model exactly.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from train.distributed import host_copy

TARGETS = re.compile(r"^layers\.\d+\.(attn\.w[qkvro]\.kernel|mlp\.(w_gate|w_up|w_down|shared_gate|shared_up|"
                     r"shared_down))$")
A, B = ".lora_a", ".lora_b"
FORMAT = "inkling-jax-lora"


def target_names(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The weights that get adapters, from a name -> shape table."""
    return [n for n in shapes if TARGETS.match(n) and len(shapes[n]) >= 2]


def init_adapters(shapes: dict[str, tuple[int, ...]], rank: int, key) -> dict[str, jax.Array]:
    """fp32 adapters: A ~ N(0, 1/in), B = 0."""
    out = {}
    for i, name in enumerate(target_names(shapes)):
        *lead, fan_in, fan_out = shapes[name]
        a = jax.random.normal(jax.random.fold_in(key, i), (*lead, fan_in, rank), jnp.float32)
        out[name + A] = a / np.sqrt(fan_in)
        out[name + B] = jnp.zeros((*lead, rank, fan_out), jnp.float32)
    return out


def base_name(adapter_name: str) -> str:
    return adapter_name[: -len(A)] if adapter_name.endswith(A) else adapter_name[: -len(B)]


def adapter_axes(adapter_name: str, base_axes: tuple) -> tuple:
    """Logical axes of an adapter from its base weight's: A keeps the input axis, B the output axis."""
    if adapter_name.endswith(A):
        return base_axes[:-1] + (None,)
    return base_axes[:-2] + (None, base_axes[-1])


def rank_of(adapters: dict) -> int:
    return next(x.shape[-1] for n, x in adapters.items() if n.endswith(A))


def merge(base: dict, adapters: dict, alpha: float) -> dict:
    """{name: W + (alpha / r) * A @ B} for every adapted weight, in W's dtype."""
    scale = alpha / rank_of(adapters)
    out = {}
    for name in sorted({base_name(n) for n in adapters}):
        delta = jnp.einsum("...ir,...ro->...io", adapters[name + A], adapters[name + B])
        out[name] = (base[name].astype(jnp.float32) + scale * delta).astype(base[name].dtype)
    return out


def save_adapters(path: str, adapters: dict, alpha: float) -> None:
    """Write the adapters (fp32) and their rank and alpha to one safetensors file."""
    host = {n: np.asarray(x) for n, x in host_copy(adapters).items()}
    if jax.process_index() == 0:
        write_safetensors(path, host, metadata={"format": FORMAT, "rank": str(rank_of(adapters)),
                                                "alpha": repr(float(alpha))})


def load_adapters(path: str) -> tuple[dict[str, np.ndarray], float]:
    """(adapters as host arrays, alpha) from a file `save_adapters` wrote."""
    f = SafetensorsFile(path)
    if f.metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: not an inkling-jax LoRA file (metadata {f.metadata})")
    bad = [n for n in f.names if not (n.endswith((A, B)) and TARGETS.match(base_name(n)))]
    if bad:
        raise ValueError(f"{path}: {bad[0]} is not an adapter of a LoRA target")
    return {n: np.array(f.read(n)) for n in f.names}, float(f.metadata["alpha"])
