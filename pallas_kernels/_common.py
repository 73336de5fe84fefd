"""Small helpers shared by every kernel folder."""

import jax


def interpret_default() -> bool:
    """Kernels run compiled on GPU and in Pallas interpret mode everywhere else (CPU tests)."""
    return jax.default_backend() != "gpu"


def round_up(n, m):
    """n rounded up to a multiple of m (ints or integer arrays)."""
    return -(-n // m) * m
