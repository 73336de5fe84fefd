"""The one table of logical-axis rules.

Every parameter dimension has a logical name (`LOGICAL_AXES`, matched on the parameter's path); `RULES` maps
logical names to mesh axes (`inkling_jax.parallel.mesh`). The model, the converter, the trainer and the server all
shard through `param_shardings`, so changing a layout is a one-line change here.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical dimension name -> mesh axis (or axes) it is split over; None: replicated.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp", "expert"),  # `expert` too: attention and dense work are not repeated per expert shard
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",  # query heads x head_dim (and the r projection's heads x d_rel)
    "kv_heads": "tensor",
    "mlp": "tensor",  # dense MLP and shared-expert width
    "experts": "expert",
    "expert_mlp": "tensor",
    "media": None,  # the small towers stay replicated
    # Activations (see ACTIVATIONS): sequence and residual width stay whole on every device.
    "length": None,
    "act_embed": None,
    "microbatch": None,
}

# Activations the trainer and the server pin (inputs, the residual stream between layers): logical names per
# dimension, through the same RULES as the parameters.
ACTIVATIONS: dict[str, tuple[str | None, ...]] = {
    "tokens": ("batch", "length"),  # ids, segment ids, positions, loss masks [B, T]
    "microbatches": ("microbatch", "batch", "length"),  # the same, stacked for gradient accumulation
    "hidden": ("batch", "length", "act_embed"),  # the residual stream [B, T, H]
}

# (last path components, logical names per dimension): the first entry whose names end the path wins.
LOGICAL_AXES: list[tuple[tuple[str, ...], tuple[str | None, ...]]] = [
    (("embed",), ("vocab", "embed")),
    (("unembed",), ("vocab", "embed")),
    (("wq", "kernel"), ("embed", "q_heads")),
    (("wr", "kernel"), ("embed", "q_heads")),
    (("wk", "kernel"), ("embed", "kv_heads")),
    (("wv", "kernel"), ("embed", "kv_heads")),
    (("wo", "kernel"), ("q_heads", "embed")),
    (("k_sconv", "weight"), ("kv_heads", None)),
    (("v_sconv", "weight"), ("kv_heads", None)),
    (("router",), ("embed", None)),
    (("mlp", "w_gate"), ("experts", "embed", "expert_mlp")),  # MoE: 3-D; dense MLP: 2-D (below)
    (("mlp", "w_up"), ("experts", "embed", "expert_mlp")),
    (("mlp", "w_down"), ("experts", "expert_mlp", "embed")),
    (("shared_gate",), (None, "embed", "mlp")),
    (("shared_up",), (None, "embed", "mlp")),
    (("shared_down",), (None, "mlp", "embed")),
    (("input_proj", "kernel"), (None, "embed")),
    # Serving forms (inkling_jax/quant). Routed experts of a ServingMoE (`experts`): as loaded, fp8 (K-minor) or
    # NVFP4 (pallas_kernels/moe/nvfp4.py), and an NVFP4 form's fp8 twin (`experts.twin`), by the same names.
    (("experts", "w_gate"), ("experts", "embed", "expert_mlp")),
    (("experts", "w_up"), ("experts", "embed", "expert_mlp")),
    (("experts", "w_down"), ("experts", "expert_mlp", "embed")),
    (("w_gate_fp8",), ("experts", "expert_mlp", "embed")),
    (("w_up_fp8",), ("experts", "expert_mlp", "embed")),
    (("w_down_fp8",), ("experts", "embed", "expert_mlp")),
    (("w_gate_scale",), ("experts",)),
    (("w_up_scale",), ("experts",)),
    (("w_down_scale",), ("experts",)),
    (("w13_nvfp4",), ("experts", "expert_mlp", None, None, None)),
    (("w13_scale",), ("experts", None, "expert_mlp", None, None)),
    (("w13_scale2",), ("experts",)),
    (("w2_nvfp4",), ("experts", None, "expert_mlp", None, None)),
    (("w2_scale",), ("experts", "expert_mlp", None, None, None)),
    (("w2_scale2",), ("experts",)),
    # Fused matrices (FusedAttention's q|k|v|r, FusedMLP's and the widened shared experts' gate|up): their
    # columns mix heads or gate and up, never split. fp8 matrices (Fp8Linear) are [out, in], a scale per output.
    (("wqkvr", "kernel"), ("embed", None)),
    (("w_gate_up", "kernel"), ("embed", None)),
    (("w_gate_up", "values"), (None, "embed")),
    (("w_gate_up", "scale"), (None,)),
    (("w_down", "kernel"), ("mlp", "embed")),
    (("w_gate", "values"), ("mlp", "embed")),
    (("w_up", "values"), ("mlp", "embed")),
    (("w_down", "values"), ("embed", "mlp")),
    (("w_gate", "scale"), ("mlp",)),
    (("w_up", "scale"), ("mlp",)),
    (("w_down", "scale"), ("embed",)),
    (("head", "values"), ("vocab", "embed")),  # the fp8 LM head (Fp8HeadModel): [vocab, hidden] as `unembed`
    (("head", "scale"), ("vocab",)),
    # NVFP4 dense matrices (Nvfp4Linear: fused q|k|v|r, wo, the widened shared experts) and their fp8 twins
    # (`twin`, [out, in]): whole on every device, as the fused matrices are
    (("twin", "values"), (None, None)),
    (("twin", "scale"), (None,)),
    (("nvfp4_codes",), (None, None, None, None, None)),
    (("nvfp4_scales",), (None, None, None, None, None)),
    (("nvfp4_scale2",), (None,)),
]
# The dense MLP's matrices share their names with the MoE's (told apart by rank).
DENSE_MLP = {"w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}


def logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """The logical name of each dimension of the parameter at `path`."""
    names = tuple(str(p) for p in path)
    if names[-1] in DENSE_MLP and len(DENSE_MLP[names[-1]]) == ndim:
        return DENSE_MLP[names[-1]]
    if names and names[0] in ("vision", "audio"):
        return ("media",) * ndim
    for suffix, axes in LOGICAL_AXES:
        if names[-len(suffix):] == suffix and len(axes) == ndim:
            return axes
    return (None,) * ndim  # norms, scales, conv taps of the residual stream, relative-bias banks


_RULES_IN_USE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("inkling_rules", default=None)


def rules_in_use() -> dict:
    """RULES, or the override whose block is being traced (`override_rules`)."""
    return _RULES_IN_USE.get() or RULES


@contextlib.contextmanager
def override_rules(**changes):
    """Inside the block, `spec_for` (and so the model's own splits) maps the named logical dimensions as given,
    e.g. the server keeps its rows whole over `expert` (`serve.runner.placement`). For code traced inside the block."""
    token = _RULES_IN_USE.set({**rules_in_use(), **changes})
    try:
        yield
    finally:
        _RULES_IN_USE.reset(token)


def axes_of(entry) -> tuple[str, ...]:
    """A rule's target or a PartitionSpec entry (None, a mesh axis, or a tuple of them) as a tuple of axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules=None) -> PartitionSpec:
    """PartitionSpec for a dimension list. A dimension goes over the longest leading run of its rule's mesh axes
    whose sizes multiply to a divisor of it (a batch of 6 over data=2, expert=4: over `data`), else replicated."""
    rules = rules_in_use() if rules is None else rules
    used: set[str] = set()
    out = []
    for name, size in zip(axes, shape):
        target = rules.get(name) if name else None
        mesh_axes = tuple(a for a in axes_of(target) if mesh.shape[a] > 1 and a not in used)
        while mesh_axes and size % int(np.prod([mesh.shape[a] for a in mesh_axes])):
            mesh_axes = mesh_axes[:-1]
        used.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*out)


def param_shardings(model: nnx.Module, mesh: Mesh, rules=None) -> dict[tuple, NamedSharding]:
    """path -> NamedSharding for every parameter of `model` (which may be abstract)."""
    out = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            shape = tuple(var.get_value().shape)
            out[path] = NamedSharding(mesh, spec_for(logical_axes(path, len(shape)), shape, mesh, rules))
    return out


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Inputs [batch, ...]: the batch over data x fsdp x expert (when it divides), everything else replicated."""
    return NamedSharding(mesh, spec_for(("batch",) + (None,) * (len(shape) - 1), shape, mesh))


def activation_sharding(mesh: Mesh, kind: str, shape: tuple[int, ...], rules=None) -> NamedSharding:
    """The sharding of an activation of `kind` (a key of ACTIVATIONS) and `shape`."""
    return NamedSharding(mesh, spec_for(ACTIVATIONS[kind], shape, mesh, rules))


def constrain(x, mesh: Mesh, kind: str, rules=None):
    """Pin an activation inside a jitted function to its ACTIVATIONS layout."""
    return jax.lax.with_sharding_constraint(x, activation_sharding(mesh, kind, x.shape, rules))
