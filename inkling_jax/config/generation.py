"""`generation_config.json`, where transformers keeps a checkpoint's stop tokens and sampling defaults.

Only the fields a file states are defaults: a missing one leaves the server's own default in place. HF samples
only with `do_sample: true`, so an explicit `do_sample: false` means greedy (temperature 0). Fields with no
counterpart here (beam search, length limits, transformers' bookkeeping) are left to transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os

from inkling_jax.config.schema import ConfigError

FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()  # every token that ends a generation; () when the file names none
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def to_dict(self) -> dict:
        """The file's form (what transformers reads), fields left unset omitted."""
        out: dict = {}
        if self.eos_token_ids:
            out["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        sampled = {k: getattr(self, k) for k in SAMPLING_FIELDS}
        sampled = {k: v for k, v in sampled.items() if v is not None}
        if sampled:
            out.update(do_sample=self.temperature != 0, **sampled)
        return out


def parse_generation_config(data: dict, where: str = FILE) -> GenerationConfig:
    eos = data.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    if any(not isinstance(i, int) or i < 0 for i in eos_ids):
        raise ConfigError(f"{where}: eos_token_id must be a token id or a list of them, got {eos!r}")
    sampling = {k: data.get(k) for k in SAMPLING_FIELDS}
    if data.get("do_sample") is False:
        sampling["temperature"] = 0.0
    return GenerationConfig(eos_token_ids=eos_ids, **sampling)


def load_generation_config(directory: str | os.PathLike) -> GenerationConfig:
    """The generation defaults of a model directory (all unset when it has no generation_config.json)."""
    path = os.path.join(os.fspath(directory), FILE)
    if not os.path.exists(path):
        return GenerationConfig()
    try:
        with open(path) as fh:
            data = json.load(fh)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return parse_generation_config(data, path)
