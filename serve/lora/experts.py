"""Adapters on an MoE's routed and shared experts, per row of a step: the expert e of a token in adapter slot s adds
scale[s] * (x @ A[e, s]) @ B[e, s] to its gate, up and down products (`train.lora`'s adapters of
`mlp.w_gate`, `mlp.w_up`, `mlp.w_down` [E, in, out] and of `mlp.shared_gate`, ... [S, in, out]).

`AdaptedMoE` takes the place of an MoE in the adapted view (`serve.lora.view`). The tokens' slots travel into the
dispatch with their (token, expert) rows, which are sorted by (expert, slot). Each projection is then the
backend's grouped matmul over the experts (`nn.moe_dispatch.grouped_projection`: the kernel under its `moe`
"pallas", `jax.lax.ragged_dot` otherwise) plus the adapters' LoRA product over the (expert, slot) pairs, each pair
one slot of the pools seen as [experts * slots, ...] (the backend's `lora`: the segmented kernel, or the jnp
reference). On the kernels the memory grows with the rows, not with rows x groups as XLA's ragged product's,
which pads every group to all rows. The shared experts run on every token, so their factors are gathered per row.
A step none of whose rows has an adapter on this layer's experts runs the MoE it adapts, unchanged (its kernels;
base rows bit for bit), chosen on device, so one program serves any mix. The adapted path needs the routed
experts in the model's dtype: quantised routed experts (fp8, NVFP4) are not adapted, their shared experts are."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.backend import Backend
from inkling_jax.config import TextConfig
from inkling_jax.nn import kernels
from inkling_jax.nn.layers import swiglu
from inkling_jax.nn.moe import MoE, experts
from inkling_jax.nn.moe_dispatch import (ROUTED_BF16, SHARED_NAMES, grouped_projection, order_by_group,
                                         precision_of)
from inkling_jax.quant.form import ServingForm, take_parts
from pallas_kernels.moe.ops import pad_expert_width
from serve.lora.adapters import Adapter
from serve.lora.linear import AdapterPool, AdapterRows


class ProjectionAdapters(ServingForm):
    """The adapters of one projection of a stack of experts (`part`: its `train.lora` name): A [experts, slots,
    in, rank], B [experts, slots, rank, out], and each slot's scale (0 where its adapter leaves `part` alone)."""

    def __init__(self, part: str, shape: tuple[int, int, int], slots: int, rank: int):
        num_experts, fan_in, fan_out = shape
        self.part = part
        self.a = AdapterPool(jnp.zeros((num_experts, slots, fan_in, rank), jnp.float32))
        self.b = AdapterPool(jnp.zeros((num_experts, slots, rank, fan_out), jnp.float32))
        self.scale = AdapterPool(jnp.zeros((slots,), jnp.float32))

    @property
    def shape(self) -> tuple[int, int, int]:
        """The base weight's [experts, in, out]."""
        return self.a.shape[0], self.a.shape[2], self.b.shape[3]

    def add_sorted(self, y, rows, pairs, backend: Backend):
        """y [M, out] plus the scaled adapter products of rows [M, in] sorted by (expert, slot), in y's dtype;
        `pairs` [M]: each row's expert * slots + slot, 0 for slot 0 (the base's: its factors are zeros). The pools
        reshaped to [experts * slots, ...] hold one LoRA slot per pair, so this is the backend's `lora` product
        on long runs of a slot: under "pallas" the segmented kernel, whose memory grows with M alone."""
        num_experts, slots, fan_in, rank = self.a.shape
        return kernels.lora_add(y, rows, self.a[...].reshape(num_experts * slots, fan_in, rank),
                                self.b[...].reshape(num_experts * slots, rank, -1),
                                jnp.tile(self.scale[...], num_experts), pairs, backend=backend, sorted_slots=True)

    def per_row(self, x, slot):
        """x [R, T, experts, in] (every expert's input at each token), `slot` [R] of the rows -> the scaled adapter
        products, fp32 [R, T, experts, out]."""
        h = jnp.einsum("rtei,erik->rtek", x.astype(jnp.float32), self.a[...][:, slot])
        delta = jnp.einsum("rtek,erko->rteo", h, self.b[...][:, slot])
        return self.scale[...][slot][:, None, None, None] * delta

    def write(self, slot: int, adapter: Adapter | None) -> None:
        """Puts `adapter`'s factors of `part` (zeros for None or an adapter without them) in `slot`, its rank
        padded with zeros to the slot's."""
        a, b = np.zeros(self.a.shape[:1] + self.a.shape[2:], np.float32), np.zeros(
            self.b.shape[:1] + self.b.shape[2:], np.float32)
        scale = 0.0
        if adapter is not None and self.part in adapter.weights:
            part_a, part_b = adapter.weights[self.part]
            rank = part_a.shape[-1]
            a[..., :rank], b[:, :rank], scale = part_a, part_b, adapter.scale
        self.a.write(slot, a, axis=1)
        self.b.write(slot, b, axis=1)
        self.scale.write(slot, scale)


class StackAdapters(ServingForm):
    """The adapters of a stack of experts' gate, up and down projections."""

    def __init__(self, prefix: str, names: tuple[str, str, str], num_experts: int, hidden: int, width: int,
                 slots: int, rank: int):
        """prefix: the MoE's `train.lora` name ("layers.3.mlp."); names: its stack's gate, up and down."""
        self.gate, self.up, self.down = (
            ProjectionAdapters(prefix + name, shape, slots, rank)
            for name, shape in zip(names, ((num_experts, hidden, width),) * 2 + ((num_experts, width, hidden),)))

    def projections(self) -> tuple[ProjectionAdapters, ...]:
        return self.gate, self.up, self.down


def _plus(y, delta):
    """y + an fp32 adapter product, in y's dtype (exactly y where the product is 0: a base row)."""
    return (y.astype(jnp.float32) + delta).astype(y.dtype)


class AdaptedMoE(ServingForm, MoE):
    """`moe` (an MoE or a `ServingMoE`, kept whole: it runs steps without expert adapters) with adapters on its
    routed experts (`routed`; None where they are quantised) and its shared experts (`shared`; None without any),
    in the slots of each row's `rows` (shared with the view's `LoRALinear`s). Routes by `moe`'s router."""

    def __init__(self, moe: MoE, routed: StackAdapters | None, shared: StackAdapters | None, rows: AdapterRows):
        take_parts(self, moe, replaced=ROUTED_BF16 + SHARED_NAMES + ("experts", "shared"))
        self.moe, self.routed, self.shared, self.rows = moe, routed, shared, rows

    def stacks(self) -> tuple[StackAdapters, ...]:
        return tuple(s for s in (self.routed, self.shared) if s is not None)

    def expert_outputs(self, x, expert_ids, weights, shared_weights):
        row_slots = self.rows[...]
        token_slots = jnp.repeat(row_slots, x.shape[0] // row_slots.shape[0])  # x: the rows' tokens, row-major
        used = jnp.stack([p.scale[...][row_slots] for s in self.stacks() for p in s.projections()])

        def adapted():
            if self.routed is None:
                routed = experts(x, self.moe.routed_experts(x.shape[0]), None, expert_ids, weights, None,
                                 backend=self.backend, mesh=self.mesh)
            else:
                routed = self._routed(x, expert_ids, weights, token_slots)
            return routed + self._shared(x, shared_weights, row_slots)

        return jax.lax.cond(jnp.any(used != 0), adapted,
                            lambda: self.moe.expert_outputs(x, expert_ids, weights, shared_weights))

    def _routed(self, x, expert_ids, weights, token_slots):
        """The routed experts with their adapters, fp32 [N, hidden]: the (token, expert) rows sorted by (expert,
        slot), each projection the backend's grouped matmul over the experts (`grouped_projection`) plus its
        adapters' product over the (expert, slot) pairs (`ProjectionAdapters.add_sorted`)."""
        use = self.backend.resolve()
        num_tokens, top_k = expert_ids.shape
        w_gate, w_up, w_down = pad_expert_width(*self.moe.routed_experts(num_tokens))
        num_experts, slots = w_gate.shape[0], self.routed.gate.a.shape[1]
        source = jnp.arange(num_tokens * top_k, dtype=jnp.int32) // top_k
        group, slot = expert_ids.reshape(-1), token_slots[source]
        pair = group * slots + slot
        order, place = order_by_group(pair)
        sizes = jnp.bincount(group, length=num_experts).astype(jnp.int32)
        pairs = jnp.where(slot == 0, 0, pair)[order]  # slot 0's pairs: the LoRA product's "no work"
        products = grouped_projection(use)

        def project(rows, w, adapters: ProjectionAdapters):
            """rows' products by w (its expert width padded: `pad_expert_width`) plus their adapters'."""
            padded = jnp.pad(rows, ((0, 0), (0, w.shape[1] - rows.shape[1])))
            return adapters.add_sorted(products(padded, w, sizes)[:, :adapters.shape[2]], rows, pairs, use)

        rows = x[source[order]]
        h = swiglu(project(rows, w_gate, self.routed.gate), project(rows, w_up, self.routed.up))
        y = project(h, w_down, self.routed.down) * weights.reshape(-1)[order][:, None].astype(x.dtype)
        return y[place].astype(jnp.float32).reshape(num_tokens, top_k, -1).sum(1)

    def _shared(self, x, shared_weights, row_slots):
        """The shared experts with their adapters, fp32 [N, hidden], from their stacks or their widened MLP
        (`inkling_jax.quant.moe`); 0 without shared experts."""
        if self.shared is None:
            return 0.0
        stacks = self.moe.shared_experts()
        (tokens, hidden), units = x.shape, shared_weights.shape[-1]
        if stacks is None:  # widened: gate | up as one product, each expert's columns unit k of its half
            gate, up = jnp.split(self.moe.shared.w_gate_up(x), 2, axis=-1)
        else:
            gate, up = (jnp.einsum("nh,shi->nsi", x, w) for w in stacks[:2])
        by_row = lambda y: y.reshape(row_slots.shape[0], -1, units, y.shape[-1])  # noqa: E731
        per_expert = by_row(jnp.broadcast_to(x[:, None], (tokens, units, hidden)))
        gate, up = (_plus(y.reshape(tokens, units, -1), adapters.per_row(per_expert, row_slots).reshape(
            tokens, units, -1)) for y, adapters in ((gate, self.shared.gate), (up, self.shared.up)))
        h = swiglu(gate, up) * shared_weights[..., None].astype(gate.dtype)
        if stacks is None:
            y = self.moe.shared.w_down(h.reshape(tokens, -1)).astype(jnp.float32)
        else:
            y = jnp.einsum("nsi,sih->nsh", h, stacks[2]).astype(jnp.float32).sum(1)
        return y + self.shared.down.per_row(by_row(h), row_slots).sum(2).reshape(tokens, hidden)


def adapted_moe(moe: MoE, prefix: str, config: TextConfig, slots: int, rank: int, rows: AdapterRows) -> AdaptedMoE:
    """`moe` (layer `prefix`, "layers.3.mlp.") with `slots` adapter slots of `rank` on its experts."""
    size = (config.hidden_size, config.moe_intermediate_size, slots, rank)
    routed = None if precision_of(moe.routed_experts()) != "bf16" else StackAdapters(
        prefix, ROUTED_BF16, config.num_experts, *size)
    shared = None if not config.num_shared_experts else StackAdapters(
        prefix, SHARED_NAMES, config.num_shared_experts, *size)
    return AdaptedMoE(moe, routed, shared, rows)
