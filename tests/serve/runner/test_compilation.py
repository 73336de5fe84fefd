"""XLA options per warm-up program."""

from serve.runner import compilation
from serve.runner.compilation import CPU_COMPILE_OPTIONS, WIDE_GPU_COMPILE_OPTIONS, WIDE_TOKENS, compile_options


def test_only_wide_prefill_programs_compile_untuned_on_gpu(monkeypatch):
    assert compile_options((32, 128, False)) == CPU_COMPILE_OPTIONS
    monkeypatch.setattr(compilation.jax, "default_backend", lambda: "gpu")
    assert compile_options((WIDE_TOKENS // 128, 128, False)) == compile_options((32, 128, True)) == \
        WIDE_GPU_COMPILE_OPTIONS
    for narrow in ((1, 128, False), (WIDE_TOKENS, 1, False), "init_penalties"):  # a short prefill, a decode, a helper
        assert compile_options(narrow) is None
