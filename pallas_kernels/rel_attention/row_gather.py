"""`take_along_axis(src, idx, axis)` for 2-D tiles, usable inside Pallas kernels.

The relative bias of a tile is a diagonal shear of a small band matrix; this is the in-register gather that
performs it. Pallas' Triton lowering has no rule for `lax.gather`, so the primitive lowers to Triton's own
`tt.gather` there (registers and shared memory, no round trip through global memory), and to
`jnp.take_along_axis` everywhere else (interpret mode, CPU).
"""

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

take_along_axis_p = Primitive("tile_take_along_axis")


def _take_along_axis_jnp(src, idx, *, axis):
    return jnp.take_along_axis(src, idx, axis=axis)


def _abstract_eval(src, idx, *, axis):
    other = 1 - axis
    if src.ndim != 2 or idx.ndim != 2 or idx.shape[other] != src.shape[other]:
        raise ValueError(f"take_along_axis wants 2-D tiles that agree off axis {axis}: {src.shape}, {idx.shape}")
    return jax.core.ShapedArray(idx.shape, src.dtype)


take_along_axis_p.def_impl(_take_along_axis_jnp)
take_along_axis_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(take_along_axis_p, mlir.lower_fun(_take_along_axis_jnp, multiple_results=False))


def _register_triton_rule():
    # Private JAX modules: the Pallas Triton lowering keeps its rules in a dict keyed by primitive.
    try:
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as triton_lowering
    except ImportError:  # a jaxlib without the Triton dialect: only interpret mode is available
        return
    triton_lowering.triton_lowering_rules[take_along_axis_p] = (
        lambda ctx, src, idx, *, axis: tt_dialect.gather(src, idx, axis))


_register_triton_rule()


def take_along_axis(src: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    """out[i, j] = src[idx[i, j], j] (axis 0) or src[i, idx[i, j]] (axis 1); idx in range."""
    return take_along_axis_p.bind(src, idx.astype(jnp.int32), axis=axis)
