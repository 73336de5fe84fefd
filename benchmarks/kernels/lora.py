"""The multi-LoRA kernels (`pallas_kernels/lora`) against their jnp reference and a bandwidth roofline: the
cases, their inputs and how a call is timed.

Each time is `timing.chained_seconds`: a jitted chain of dependent calls, y donated and carried from call to
call (the kernels add into it in place). The roofline is the bytes a call must move at least (x read, y read and
written, each distinct adapter's A and B read once) at the copy bandwidth measured in the same run.
"""

import dataclasses

import jax
import jax.numpy as jnp

from benchmarks.timing import chained_seconds


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    rows: int
    tokens: int  # per row: 1 runs the gathered form, a prefill chunk the segmented one
    adapters: int  # distinct adapters, in slots 1..adapters, taken by the rows in turn
    fan_in: int
    rank: int  # a slot's rank: a fused projection's parts' ranks side by side
    fan_out: int

    def shape(self) -> str:
        return (f"{self.rows}x{self.tokens} tokens, {self.adapters} adapters, "
                f"{self.fan_in}->{self.rank}->{self.fan_out}")


# The bench preset's fused q|k|v|r projection (6144 -> 64 x 128 + 2 x 8 x 128 + 64 x 16) with rank-16 adapters
# on its 4 parts; 32 decode rows of 8 adapters (issue 41's case), and prefill chunks of 2048 tokens.
INKLING = (Case("decode", rows=32, tokens=1, adapters=8, fan_in=6144, rank=64, fan_out=11264),
           Case("prefill", rows=4, tokens=2048, adapters=4, fan_in=6144, rank=64, fan_out=11264))
SMOKE = (Case("decode", rows=3, tokens=1, adapters=2, fan_in=40, rank=8, fan_out=48),
         Case("prefill", rows=2, tokens=20, adapters=2, fan_in=40, rank=8, fan_out=48))


def inputs(case: Case):
    """(y, the other arguments of `lora_add`, bytes a call moves at least); bf16 activations, fp32 pools as the
    server holds them, slot 0 the base's."""
    keys = iter(jax.random.split(jax.random.key(0), 4))
    slots = case.adapters + 1

    def normal(shape, dtype=jnp.float32):
        return jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)

    x = normal((case.rows, case.tokens, case.fan_in), jnp.bfloat16)
    y = normal((case.rows, case.tokens, case.fan_out), jnp.bfloat16)
    a = normal((slots, case.fan_in, case.rank)).at[0].set(0) / case.fan_in ** 0.5
    b = normal((slots, case.rank, case.fan_out)).at[0].set(0)
    scale = jnp.full((slots,), 1e-3, jnp.float32)  # small: y stays finite over the chained calls
    row_slots = 1 + jnp.arange(case.rows, dtype=jnp.int32) % case.adapters
    moved = x.size * 2 + 2 * y.size * 2 + case.adapters * (a[0].size + b[0].size) * 4
    return y, (x, a, b, scale, row_slots), moved


def seconds(fn, y, args, reps):
    """Seconds per call fn(y, *args) -> y; on a copy of y (the chain donates it)."""
    return chained_seconds(lambda y, args: fn(y, *args), jnp.copy(y), (args,), reps=reps, feed_back=True)
