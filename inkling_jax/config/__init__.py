"""Frozen configuration of Inkling, parsed from a model directory's `config.json` or taken from a preset.

- `schema`: the dataclasses (`InklingConfig`, `TextConfig`, ...) and `log_scaling_tau`;
- `json_format`: `parse_config` / `load_config` of both `config.json` forms, and the published form written back;
- `presets`: `preset(name)`;
- `generation`: `GenerationConfig` / `load_generation_config`, the stop tokens and sampling defaults of
  `generation_config.json`.
"""

from inkling_jax.config.generation import GenerationConfig, load_generation_config
from inkling_jax.config.json_format import load_config, parse_config, to_published
from inkling_jax.config.presets import preset
from inkling_jax.config.schema import (
                                       AttentionShape,
                                       AudioConfig,
                                       ConfigError,
                                       InklingConfig,
                                       MTPConfig,
                                       TextConfig,
                                       VisionConfig,
                                       log_scaling_tau,
)

__all__ = ["InklingConfig", "TextConfig", "VisionConfig", "AudioConfig", "MTPConfig", "AttentionShape",
           "ConfigError", "parse_config", "load_config", "to_published", "preset", "log_scaling_tau",
           "GenerationConfig", "load_generation_config"]
