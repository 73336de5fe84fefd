"""The one switch between the pure-jnp reference paths and the Pallas kernels.

The model calls the functions below and never a kernel directly. `set_backend` picks the implementation:
- "jnp": the references in `pallas_kernels/*/reference.py` (CPU tests, the numerical ground truth);
- "pallas": the Pallas kernels (GPU);
- "auto" (default): Pallas on GPU, jnp elsewhere.
The MoE has its own choice because it has three: "dense" (einsum over every expert, tiny models only),
"ragged" (`jax.lax.ragged_dot` on tokens sorted by expert, also what "auto" picks for now) and "pallas".
The choice is read while tracing, so set it before the first call of a jitted function.
"""

import contextlib

import jax
import numpy as np

from pallas_kernels.rel_attention import reference as attention_reference
from pallas_kernels.shortconv import reference as shortconv_reference

_VALID = {"backend": ("auto", "jnp", "pallas"), "moe": ("auto", "dense", "ragged", "pallas")}
_settings = {"backend": "auto", "moe": "auto"}


def set_backend(backend: str | None = None, *, moe: str | None = None) -> None:
    for key, value in (("backend", backend), ("moe", moe)):
        if value is None:
            continue
        if value not in _VALID[key]:
            raise ValueError(f"{key} must be one of {_VALID[key]}, got {value!r}")
        _settings[key] = value


@contextlib.contextmanager
def use(backend: str | None = None, *, moe: str | None = None):
    """Temporarily select implementations: `with kernels.use("jnp", moe="dense"): ...`."""
    saved = dict(_settings)
    set_backend(backend, moe=moe)
    try:
        yield
    finally:
        _settings.update(saved)


def _pallas() -> bool:
    choice = _settings["backend"]
    return choice == "pallas" or (choice == "auto" and jax.default_backend() == "gpu")


def moe_backend() -> str:
    """"auto" means "ragged" for now: the Pallas MoE kernel passes its own tests on the H200, but the trainer's
    tests saw an all-NaN w_down gradient from it in interpret mode at the tiny preset's shapes, so it stays
    opt-in (`set_backend(moe="pallas")`) until that is understood."""
    choice = _settings["moe"]
    return "ragged" if choice == "auto" else choice


def shortconv_prefill(x, w, state=None, *, segment_ids=None, lengths=None):
    if _pallas():
        if state is None:
            state = jax.numpy.zeros((x.shape[0], w.shape[-1] - 1, x.shape[-1]), x.dtype)
        return _shortconv_kernel(x, w, state, segment_ids, lengths)
    return shortconv_reference.shortconv_prefill(x, w, state, segment_ids=segment_ids, lengths=lengths)


@jax.custom_vjp
def _shortconv_kernel(x, w, state, segment_ids, lengths):
    """The Pallas forward with the reference's gradient (the conv is cheap to recompute; Pallas kernels have no
    transpose rule of their own)."""
    from pallas_kernels.shortconv import shortconv_prefill as kernel

    return kernel(x, w, state, segment_ids=segment_ids, lengths=lengths)


def _shortconv_fwd(x, w, state, segment_ids, lengths):
    return _shortconv_kernel(x, w, state, segment_ids, lengths), (x, w, state, segment_ids, lengths)


def _shortconv_bwd(residuals, cotangents):
    x, w, state, segment_ids, lengths = residuals
    _, vjp = jax.vjp(lambda x, w, s: shortconv_reference.shortconv_prefill(x, w, s, segment_ids=segment_ids,
                                                                            lengths=lengths), x, w, state)
    no_grad = tuple(None if a is None else np.zeros(a.shape, jax.dtypes.float0) for a in (segment_ids, lengths))
    return vjp(cotangents) + no_grad


_shortconv_kernel.defvjp(_shortconv_fwd, _shortconv_bwd)


def attention(q, k, v, r, rel_proj, q_pos, k_pos, *, window=None, tau=None, k_valid=None):
    """Relative-bias attention over explicit positions (see `pallas_kernels/rel_attention/reference.py`): the
    general case (a prefill chunk continuing a cache), always the jnp path."""
    return attention_reference.rel_attention(q, k, v, r, rel_proj, q_pos, k_pos, window=window, tau=tau,
                                             k_valid=k_valid)


def self_attention(q, k, v, r, rel_proj, positions, *, window=None, tau=None, segment_ids=None):
    """T tokens attending among themselves; positions must step by one inside each segment (packed sequences
    restart at 0), which is what lets the flash kernel use index differences as distances."""
    if _pallas():
        from pallas_kernels.rel_attention import rel_flash_attention

        return rel_flash_attention(q, k, v, r, rel_proj, window=window, tau=tau, segment_ids=segment_ids)
    return attention_reference.rel_attention(q, k, v, r, rel_proj, positions, positions, window=window, tau=tau,
                                             q_segment=segment_ids, k_segment=segment_ids)


def decode_attention(q, k_cache, v_cache, r, rel_proj, lengths, *, page_table=None, window=None, tau=None):
    """One new token per row over the cache that already holds it: paged pages (full layers, `page_table`
    given) or a window ring (sliding layers). `lengths` counts the new token."""
    from pallas_kernels import decode_attention as decode

    if page_table is None:
        fn = decode.ring_decode_attention if _pallas() else decode.ring_decode_reference
        return fn(q, k_cache, v_cache, lengths, r, rel_proj, window=window)
    fn = decode.paged_decode_attention if _pallas() else decode.paged_decode_reference
    return fn(q, k_cache, v_cache, page_table, lengths, r, rel_proj, tau=tau)
