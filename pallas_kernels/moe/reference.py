"""Pure-jnp grouped matmul and SwiGLU MoE FFN: the contracts the Pallas kernels are tested against.

Rows of x are sorted by group: group g owns rows [offset_g, offset_g + group_sizes[g]). Rows past
sum(group_sizes) belong to no group and produce zeros. Matmuls accumulate in fp32; the SwiGLU activation and
the routing weight are applied in fp32; each result is cast once to x.dtype.
"""

import jax
import jax.numpy as jnp


def grouped_matmul(x, w, group_sizes):
    """x [M, K], w [G, K, N], group_sizes [G] -> [M, N] in x.dtype (fp32 accumulation)."""
    out = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def swiglu(gate, up):
    """silu(gate) * up in fp32."""
    gate = gate.astype(jnp.float32)
    return gate * jax.nn.sigmoid(gate) * up.astype(jnp.float32)


def moe_ffn(x, w_gate, w_up, w_down, group_sizes, row_weights):
    """row_weights * (silu(x @ w_gate) * (x @ w_up)) @ w_down, per group; [M, H] in x.dtype.

    The row weight scales the activation (before the down projection), which equals scaling the output.
    """
    def mm(a, w):
        return jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=jnp.float32,
                                  precision=jax.lax.Precision.HIGHEST)

    act = swiglu(mm(x, w_gate), mm(x, w_up)) * row_weights.astype(jnp.float32)[:, None]
    return mm(act.astype(x.dtype), w_down).astype(x.dtype)


def group_ids(group_sizes, num_rows):
    """Group of each row, or -1 for rows past sum(group_sizes)."""
    ends = jnp.cumsum(group_sizes)
    gid = jnp.searchsorted(ends, jnp.arange(num_rows), side="right")
    return jnp.where(gid < group_sizes.shape[0], gid, -1)


def grouped_matmul_dense(x, w, group_sizes):
    """Same contract as `grouped_matmul`, as a dense per-group einsum with a one-hot row mask (tiny checks)."""
    onehot = jax.nn.one_hot(group_ids(group_sizes, x.shape[0]), w.shape[0], dtype=jnp.float32)
    out = jnp.einsum("mg,mk,gkn->mn", onehot, x.astype(jnp.float32), w.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def moe_ffn_dense(x, w_gate, w_up, w_down, group_sizes, row_weights):
    """Same contract as `moe_ffn`, through `grouped_matmul_dense`."""
    gate = grouped_matmul_dense(x.astype(jnp.float32), w_gate, group_sizes)
    up = grouped_matmul_dense(x.astype(jnp.float32), w_up, group_sizes)
    act = swiglu(gate, up) * row_weights.astype(jnp.float32)[:, None]
    return grouped_matmul_dense(act, w_down, group_sizes).astype(x.dtype)
