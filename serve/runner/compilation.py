"""XLA's options for each warm-up program, and a count of the process's compilations (serving must compile nothing
after warm-up)."""

import jax

CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# Prefill programs of at least WIDE_TOKENS tokens (rows x chunk) on GPU: no GEMM autotuning. Their products are
# large, where cuBLAS's own choice serves, and autotuning the wide fp8 dots of `--fp8-twins` took minutes of
# compilation; the other programs keep it, faster tuned (see docs/performance.md).
WIDE_TOKENS = 512
WIDE_GPU_COMPILE_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}
_compilations = []


def compile_options(key) -> dict | None:
    """XLA options for the `warm_up` program of `key`, (rows, chunk, full) for a step or a helper's name. On CPU
    (tests, demos) compile time dominates, which XLA's cheaper backend passes cut."""
    if jax.default_backend() == "cpu":
        return CPU_COMPILE_OPTIONS
    wide = isinstance(key, tuple) and key[1] > 1 and key[0] * key[1] >= WIDE_TOKENS  # a wide prefill
    return WIDE_GPU_COMPILE_OPTIONS if wide else None


def compilation_count() -> int:
    """XLA compilations in this process since the first call (for checking that serving compiles nothing)."""
    if not _compilations:
        _compilations.append(0)
        jax.monitoring.register_event_duration_secs_listener(_count_compilation)
    return _compilations[0]


def _count_compilation(event: str, *_, **__) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compilations[0] += 1
