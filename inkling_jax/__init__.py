"""inkling-jax: Inkling in JAX / Flax NNX.

    from inkling_jax import load_pretrained
    model = load_pretrained("path/to/Inkling", dtype="bfloat16")
    logits = model(input_ids)

`Backend` names the kernels the model runs (`load_pretrained(..., backend=Backend.parse("moe=ragged"))`);
`with_backend(model, backend)` gives a model that runs others, sharing the weights.
"""

from inkling_jax.backend import Backend, with_backend
from inkling_jax.checkpoint.loading import load_pretrained
from inkling_jax.checkpoint.safetensors_io import CheckpointError
from inkling_jax.config import ConfigError, InklingConfig, load_config, parse_config, preset
from inkling_jax.nn.cache import Cache, init_cache
from inkling_jax.nn.model import InklingModel

__all__ = ["InklingModel", "InklingConfig", "Cache", "init_cache", "load_pretrained", "load_config",
           "parse_config", "preset", "ConfigError", "CheckpointError", "Backend", "with_backend"]
