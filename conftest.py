"""Repository-wide pytest setup, loaded before any test module: 8 simulated CPU devices for the sharding
tests, and XLA:CPU without fused multiply-adds, as `--batch-invariant` commands start it (`inkling_jax.backend.
NO_FMA_CPU_FLAG`: the batch-invariant tests' programs then round every multiply and add alike). XLA reads these
when the backend starts, so they must be set before anything touches a device.

On a machine without a GPU, compiling is most of the suite's time, and XLA's CPU backend is set up to compile
fast: it skips its expensive LLVM passes (as the serving engine's CPU warm-up does), emits fusions with its
classic LLVM emitters instead of the MLIR fusion emitters (those took half the compile time of the suite's
small programs; the programs run a little slower, which matters to none but the notebooks' RL run) and
generates each program as one LLVM module (parts compile in parallel, no gain where every core is busy, and
each part's fixed cost is paid again). The programs compute the same functions, to float rounding.

Files marked `heavy` are collected first, so that a parallel run (`--dist loadfile`, which hands out whole files
in collection order) starts them at once instead of ending on them."""

import os
import shutil

from inkling_jax.backend import NO_FMA_CPU_FLAG

FLAGS = ["--xla_force_host_platform_device_count=8", NO_FMA_CPU_FLAG]
if shutil.which("nvidia-smi") is None:
    FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
              "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"]
os.environ.setdefault("XLA_FLAGS", " ".join(FLAGS))


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)  # stable: the rest keep their order
