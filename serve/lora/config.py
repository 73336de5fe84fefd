"""What a server's LoRA adapters are and how many it holds (`--lora-modules`, `--max-loras`, `--max-lora-rank`,
`--max-cpu-loras`, vLLM's names)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    modules: tuple[tuple[str, str], ...]  # (name a request's `model` gives, path) of every adapter served
    max_loras: int = 1  # adapters on the device at once (their slots; the base needs none)
    max_rank: int = 16  # the largest rank served; every slot holds this rank
    root: str | None = None  # adapters may be loaded at run time from under this directory (`--lora-root`)
    max_cpu_loras: int | None = None  # adapters whose weights host memory keeps (None: max_loras); others on disk
    # Adapters may adapt the MoE's routed and shared experts (`--lora-experts`). Off, the MoE layers stay the base's:
    # the experts' slots and their adapted path (`serve.lora.experts`) are not built.
    experts: bool = False

    def __post_init__(self):
        if self.max_loras < 1 or self.max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {self.max_loras}, {self.max_rank}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"LoRA module names must be distinct and nonempty, got {names}")

    @classmethod
    def parse_modules(cls, specs: list[str]) -> tuple[tuple[str, str], ...]:
        """"NAME=PATH" arguments -> (name, path) pairs; a clear error for anything else."""
        pairs = []
        for spec in specs:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
            pairs.append((name, path))
        return tuple(pairs)
