"""XLA's options for each warm-up program, and a count of the programs the process builds, per thread (serving
must build nothing after warm-up: the engine's `/metrics` counts what its thread builds)."""

import collections
import threading

import jax

CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# Prefill programs of at least WIDE_TOKENS tokens (rows x chunk) on GPU: no GEMM autotuning. Their products are
# large, where cuBLAS's own choice serves, and autotuning the wide fp8 dots of `--fp8-twins` took minutes of
# compilation; the other programs keep it, faster tuned (see docs/performance.md).
WIDE_TOKENS = 512
WIDE_GPU_COMPILE_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def compile_options(key) -> dict | None:
    """XLA options for the `warm_up` program of `key`: (rows, chunk, full) for a step, ("mixed", decode rows, prompt
    chunk tokens, full) for a mixed step (`StepPrograms.mixed`) or a helper's name. On CPU (tests, demos) compile
    time dominates, which XLA's cheaper backend passes cut."""
    if jax.default_backend() == "cpu":
        return CPU_COMPILE_OPTIONS
    return WIDE_GPU_COMPILE_OPTIONS if _wide(key) else None


def _wide(key) -> bool:
    """Whether `key`'s program is a wide prefill: at least WIDE_TOKENS rows x chunk tokens, a mixed step's decode
    rows counted beside its chunk."""
    if not isinstance(key, tuple):
        return False
    if key[0] == "mixed":
        return key[1] + key[2] >= WIDE_TOKENS
    return key[1] > 1 and key[0] * key[1] >= WIDE_TOKENS


# A program built: compiled, or loaded from the persistent compilation cache (a cache miss all the same).
BUILT = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits")
_counts: collections.Counter = collections.Counter()  # thread ident -> programs built on it; None: every thread
_listening = []


def compilation_count(thread: int | None = None) -> int:
    """Programs built in this process since the first call, on every thread or on one (`threading.get_ident()`; a
    new thread may reuse a finished one's ident, so count from a baseline)."""
    if not _listening:
        _listening.append(True)
        jax.monitoring.register_event_duration_secs_listener(_count_build)
        jax.monitoring.register_event_listener(_count_build)
    return _counts[thread]


def _count_build(event: str, *_, **__) -> None:
    if event in BUILT:  # XLA builds a program on the thread that asked for it
        _counts[None] += 1
        _counts[threading.get_ident()] += 1
