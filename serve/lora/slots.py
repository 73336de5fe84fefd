"""The adapters a server holds: those registered (strictly read: `adapters.load_adapter`; at start, and at run
time with `--lora-root`), and at most `max_loras` of them in device slots at once. A sequence holds the
`Adapter` it was submitted with, so unregistering one only refuses new requests. A step's adapters are put in
slots before it runs, the least recently used others making room; the scheduler admits no more distinct
adapters than there are slots (`serve.engine.scheduler`), so a step's always fit and no row runs with another's
adapter."""

from __future__ import annotations

import collections
import logging
import os
import threading
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
        self.config = config
        self.on_load = on_load
        self.shapes = adapted_shapes(view)
        self.adapters: dict[str, Adapter] = {name: load_adapter(name, path, self.shapes, config.max_rank)
                                             for name, path in config.modules}
        self._registry = threading.Lock()  # request threads register and unregister
        self.resident: collections.OrderedDict[Adapter, int] = collections.OrderedDict()  # -> slot, LRU first
        self.free = list(range(config.max_loras, 0, -1))  # slot 0 is the base's
        self.loads = 0

    def get(self, name: str) -> Adapter:
        try:
            return self.adapters[name]
        except KeyError:
            raise UnknownAdapter(name) from None

    def register(self, name: str, path: str) -> Adapter:
        """Reads the adapter at `path` (which must lie under `config.root`) and serves it as `name`; a ValueError
        for a path outside the root, a name already served or an adapter that does not fit."""
        real = os.path.realpath(path)  # links and ".." resolved: the file that would be read
        root = None if self.config.root is None else os.path.realpath(self.config.root)
        if root is None or real == root or os.path.commonpath([root, real]) != root:
            raise ValueError(f"LoRA adapter {name!r}: {path} is not under the server's LoRA root")
        adapter = load_adapter(name, real, self.shapes, self.config.max_rank)
        with self._registry:
            if name in self.adapters:
                raise ValueError(f"LoRA adapter {name!r} is already served")
            self.adapters[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        """Refuses new requests for `name`; those already submitted finish with it (UnknownAdapter if not
        served)."""
        with self._registry:
            self.get(name)
            del self.adapters[name]

    def place(self, view, adapters: set[Adapter]) -> dict[Adapter, int]:
        """Puts `adapters` (at most `max_loras`) in slots of `view`, evicting the least recently used others;
        returns the slot of each. Writes the view's arrays: the caller takes its parameters anew where `loads`
        grew."""
        if len(adapters) > self.config.max_loras:
            raise ValueError(f"a step with {len(adapters)} adapters; {self.config.max_loras} slots")
        for adapter in adapters:
            if adapter in self.resident:
                self.resident.move_to_end(adapter)
                continue
            victim = None
            if not self.free:
                victim = next(a for a in self.resident if a not in adapters)
                self.free.append(self.resident.pop(victim))
            start = time.perf_counter()
            slot = self.free.pop()
            write_slot(view, slot, adapter)
            self.resident[adapter] = slot
            self.loads += 1
            self.on_load(adapter.name, time.perf_counter() - start, None if victim is None else victim.name)
            log.debug("LoRA adapter %s in slot %d%s", adapter.name, slot,
                      "" if victim is None else f" (was {victim.name}'s)")
        return {adapter: self.resident[adapter] for adapter in adapters}

    def assign(self, view, seqs) -> bool:
        """Gives each sequence of a step the slot of its adapter (`lora_slot`; 0: the base), placing the adapters
        first (`place`); whether a slot was written."""
        loads = self.loads
        slots = self.place(view, {seq.adapter for seq in seqs if seq.adapter is not None})
        for seq in seqs:
            seq.lora_slot = slots.get(seq.adapter, 0)
        return self.loads != loads
