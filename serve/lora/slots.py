"""The adapters a server holds: every registered adapter read at start (strictly: `adapters.load_adapter`), at
most `max_loras` of them in device slots at once. A step's adapters are put in slots before it runs, the least
recently used others making room; the scheduler admits no more distinct adapters than there are slots
(`serve.engine.scheduler`), so a step's always fit and no row runs with another's adapter."""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from serve.lora.adapters import Adapter, load_adapter
from serve.lora.config import LoRAConfig
from serve.lora.view import adapted_shapes, write_slot

log = logging.getLogger(__name__)


class UnknownAdapter(KeyError):
    """A request names an adapter the server does not serve (the API answers 404)."""


class AdapterSlots:
    def __init__(self, view, config: LoRAConfig,
                 on_load: Callable[[str, float, str | None], None] = lambda *_: None):
        """view: the adapted serving view (`serve.lora.view.lora_view`, `config.max_loras + 1` slots);
        on_load(adapter, seconds, evicted adapter or None): called for every adapter put in a slot."""
        self.on_load = on_load
        self.config = config
        shapes = adapted_shapes(view)
        self.adapters: dict[str, Adapter] = {name: load_adapter(name, path, shapes, config.max_rank)
                                             for name, path in config.modules}
        self.resident: collections.OrderedDict[str, int] = collections.OrderedDict()  # name -> slot, LRU first
        self.free = list(range(config.max_loras, 0, -1))  # slot 0 is the base's
        self.loads = 0

    def place(self, view, names: set[str]) -> dict[str, int]:
        """Puts the adapters `names` (at most `max_loras`) in slots of `view`, evicting the least recently used
        others; returns the slot of each. Writes the view's arrays: the caller takes its parameters anew where
        `loads` grew."""
        if len(names) > self.config.max_loras:
            raise ValueError(f"a step with {len(names)} adapters; {self.config.max_loras} slots")
        for name in names:
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            victim = None
            if not self.free:
                victim = next(n for n in self.resident if n not in names)
                self.free.append(self.resident.pop(victim))
            start = time.perf_counter()
            slot = self.free.pop()
            write_slot(view, slot, self.adapters[name])
            self.resident[name] = slot
            self.loads += 1
            self.on_load(name, time.perf_counter() - start, victim)
            log.debug("LoRA adapter %s in slot %d%s", name, slot, "" if victim is None else f" (was {victim}'s)")
        return {name: self.resident[name] for name in names}

    def assign(self, view, seqs) -> bool:
        """Gives each sequence of a step the slot of its adapter (`lora_slot`; 0: the base), placing the adapters
        first (`place`); whether a slot was written."""
        loads = self.loads
        slots = self.place(view, {seq.adapter for seq in seqs if seq.adapter is not None})
        for seq in seqs:
            seq.lora_slot = slots.get(seq.adapter, 0)
        return self.loads != loads
