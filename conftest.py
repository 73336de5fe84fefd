"""Repository-wide pytest setup, loaded before any test module: 8 simulated CPU devices for the sharding
tests (XLA reads this when the backend starts, so it must be set before anything touches a device)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
