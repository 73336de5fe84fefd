"""inkling-jax: Inkling in JAX / Flax NNX.

    from inkling_jax import load_pretrained
    model = load_pretrained("path/to/Inkling", dtype="bfloat16")
    logits = model(input_ids)
"""

from inkling_jax.cache import Cache, init_cache
from inkling_jax.config import ConfigError, InklingConfig, load_config, parse_config, preset
from inkling_jax.loading import load_pretrained
from inkling_jax.model import InklingModel
from inkling_jax.safetensors_io import CheckpointError

__all__ = ["InklingModel", "InklingConfig", "Cache", "init_cache", "load_pretrained", "load_config",
           "parse_config", "preset", "ConfigError", "CheckpointError"]
