"""Small helpers shared by every kernel folder."""

import contextlib

import jax

_lowering_for_gpu = [False]


def interpret_default() -> bool:
    """Kernels run compiled on GPU and in Pallas interpret mode everywhere else (CPU tests), unless
    `lowering_for_gpu` is active."""
    return not _lowering_for_gpu[0] and jax.default_backend() != "gpu"


@contextlib.contextmanager
def lowering_for_gpu():
    """Kernels traced inside take their compiled (GPU) form on any machine, so that a program can be lowered for
    CUDA on a CPU one (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`): Pallas then lowers every
    kernel to Mosaic GPU or Triton, which catches what the interpreter cannot check (register layouts, shapes the
    hardware instructions take). Nothing it traces can run on the CPU."""
    saved = _lowering_for_gpu[0]
    _lowering_for_gpu[0] = True
    try:
        yield
    finally:
        _lowering_for_gpu[0] = saved


def round_up(n, m):
    """n rounded up to a multiple of m (ints or integer arrays)."""
    return -(-n // m) * m
