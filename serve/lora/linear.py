"""A projection with per-row LoRA adapters: `base(x) + scale[s] * (x @ A[s]) @ B[s]`, s the adapter slot of x's
row. The factors of every slot are arrays of the module (inputs of the compiled step, not constants), so one
program serves any mix of adapters; slot 0 holds zeros and is the base. The products run as the backend's `lora`
names (`inkling_jax.nn.kernels.lora_add`): the Pallas kernels of `pallas_kernels/lora` or their jnp reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.nn import kernels
from inkling_jax.quant.form import ServingForm


class AdapterRows(nnx.Variable):
    """[rows] int32: the adapter slot of each row of a step (0: the base). One Variable shared by every
    `LoRALinear` of a view, so a step sets it once (`serve.lora.view.route`)."""


class AdapterPool(nnx.Variable):
    """A slot-indexed array of adapter factors or scales."""

    def write(self, slot: int, value, axis: int = 0) -> None:
        """Puts `value` (the array without its slot dimension `axis`) in `slot`, keeping the array's sharding
        exactly: the compiled steps take the new array as they took the old one. One program per pool shape,
        whatever the slot (`AdapterSlots` builds them before serving)."""
        old = self.get_value()
        self.set_value(jax.device_put(_with_slot(old, value, slot, axis), old.sharding))


@functools.partial(jax.jit, static_argnames="axis")
def _with_slot(pool, value, slot, axis: int):
    return jax.lax.dynamic_update_index_in_dim(pool, jnp.asarray(value, pool.dtype), slot, axis)


class LoRALinear(ServingForm):
    """A linear module (`Linear`, fp8, NVFP4) with adapters. A fused projection (attention q|k|v|r, MLP gate|up)
    is adapted part by part: its A is the parts' A side by side [in, parts * rank] and its B the parts' B placed
    block-diagonally [parts * rank, out], so the fused matmul stays one and the adapters add one product pair."""

    def __init__(self, base: nnx.Module, parts: tuple[str, ...], widths: tuple[int, ...], fan_in: int,
                 slots: int, rank: int, rows: AdapterRows, *, backend: Backend = Backend()):
        """parts: the base weights (`train.lora`'s names) whose output columns this module holds, widths: theirs;
        slots: adapters held at once, plus the base's slot 0; rank: the largest rank a slot holds; backend: its
        `lora` picks the kernel or the jnp products."""
        self.base, self.parts, self.widths, self.rank, self.backend = base, parts, widths, rank, backend
        self.a = AdapterPool(jnp.zeros((slots, fan_in, len(parts) * rank), jnp.float32))
        self.b = AdapterPool(jnp.zeros((slots, len(parts) * rank, sum(widths)), jnp.float32))
        self.scale = AdapterPool(jnp.zeros((slots,), jnp.float32))
        self.rows = rows

    def __call__(self, x):
        """x [rows, ..., in] -> [rows, ..., out]; the adapters' products in fp32."""
        return kernels.lora_add(self.base(x), x, self.a[...], self.b[...], self.scale[...], self.rows[...],
                                backend=self.backend)

    def slot_factors(self, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """(A [in, parts * rank], B [parts * rank, out]) of one adapter's `weights` (base weight -> (A, B), ranks
        up to `rank`): each part's factors at its block, zeros where the adapter leaves a part alone."""
        a = np.zeros(self.a.shape[1:], np.float32)
        b = np.zeros(self.b.shape[1:], np.float32)
        column = 0
        for i, (part, width) in enumerate(zip(self.parts, self.widths)):
            if part in weights:
                part_a, part_b = weights[part]
                r = part_a.shape[1]
                a[:, i * self.rank:i * self.rank + r] = part_a
                b[i * self.rank:i * self.rank + r, column:column + width] = part_b
            column += width
        return a, b
