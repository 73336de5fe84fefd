"""XLA options per warm-up program, and the count of programs built per thread."""

import threading

import jax
import jax.numpy as jnp

from serve.runner import compilation
from serve.runner.compilation import CPU_COMPILE_OPTIONS, WIDE_GPU_COMPILE_OPTIONS, WIDE_TOKENS, compile_options


def test_only_wide_prefill_programs_compile_untuned_on_gpu(monkeypatch):
    assert compile_options((32, 128, False)) == CPU_COMPILE_OPTIONS
    monkeypatch.setattr(compilation.jax, "default_backend", lambda: "gpu")
    assert compile_options((WIDE_TOKENS // 128, 128, False)) == compile_options((32, 128, True)) == \
        WIDE_GPU_COMPILE_OPTIONS
    assert compile_options(("mixed", 8, WIDE_TOKENS - 8, False)) == WIDE_GPU_COMPILE_OPTIONS  # decodes + a chunk
    for narrow in ((1, 128, False), (WIDE_TOKENS, 1, False), "init_penalties", ("mixed", 8, 128, True)):
        assert compile_options(narrow) is None  # a short prefill, a decode, a helper, a short mixed step


def test_compilations_are_counted_on_the_thread_that_builds_them():
    compilation.compilation_count()  # listening
    here, total = compilation.compilation_count(threading.get_ident()), compilation.compilation_count()
    other = {}

    def build():  # a program never built before: a shape of its own
        jax.jit(lambda x: x * 3 + 1)(jnp.ones((7, 13)))
        other["count"] = compilation.compilation_count(threading.get_ident())

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert other["count"] >= 1 and compilation.compilation_count() >= total + 1
    assert compilation.compilation_count(threading.get_ident()) == here
