"""The pure-jnp LoRA product: what the kernels compute, and the serving path of `Backend(lora="reference")`."""

import jax.numpy as jnp


def lora_add(y, x, a, b, scale, slots):
    """y [rows, ..., out] + scale[s] * (x [rows, ..., in] @ A[s]) @ B[s] in fp32, s = slots[row], rounded to y's
    dtype; a [slots, in, rank], b [slots, rank, out], scale [slots]. Each row's factors are gathered whole (one
    [in, rank] and one [rank, out] copy per row), so this suits few rows."""
    h = jnp.einsum("b...i,bir->b...r", x.astype(jnp.float32), a[slots].astype(jnp.float32))
    delta = jnp.einsum("b...r,bro->b...o", h, b[slots].astype(jnp.float32))
    row_scale = scale[slots].astype(jnp.float32).reshape((-1,) + (1,) * (x.ndim - 1))
    return (y.astype(jnp.float32) + row_scale * delta).astype(y.dtype)
