"""Small helpers shared by every kernel folder."""

import jax


def interpret_default() -> bool:
    """What a kernel's `interpret=None` means: compiled on GPU, in Pallas' interpreter everywhere else (CPU
    tests). The model passes its own choice instead (`inkling_jax.backend.Backend.interpret`), which can also ask
    for the compiled form on a CPU machine, to lower a program for CUDA there."""
    return jax.default_backend() != "gpu"


def round_up(n, m):
    """n rounded up to a multiple of m (ints or integer arrays)."""
    return -(-n // m) * m
