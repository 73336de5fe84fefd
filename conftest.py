"""Repository-wide pytest setup, loaded before any test module: 8 simulated CPU devices for the sharding
tests (XLA reads this when the backend starts, so it must be set before anything touches a device).

On a machine without a GPU, XLA's CPU backend also skips its expensive LLVM passes: compiling is most of the
suite's time there, and the programs compute the same functions (the serving engine's CPU warm-up uses the same
options)."""

import os
import shutil

FLAGS = ["--xla_force_host_platform_device_count=8"]
if shutil.which("nvidia-smi") is None:
    FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
os.environ.setdefault("XLA_FLAGS", " ".join(FLAGS))
