"""The adapters a server holds, in three tiers: registered (strictly read: `adapters.load_adapter`; at start, and at
run time with `--lora-root`), their weights in host memory for at most `max_cpu_loras` of them, and at most
`max_loras` in device slots. Each tier drops its least recently used adapter to the one below to make room: from
a device slot to host memory, from host memory to disk, whence it is read again when a request needs it (and
refused if its files changed since). A sequence holds the `Adapter` it was submitted with, so unregistering one
only refuses new requests. The scheduler admits a sequence once its adapter's weights are in host memory
(`fetch`) and no more distinct adapters than there are slots (`serve.engine.scheduler`); a step's adapters are put
in slots before it runs, so a request waits for its adapter and no row runs with another's."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable

from serve.lora.adapters import Adapter, load_adapter, read_again
from serve.lora.config import LoRAConfig
from serve.lora.view import adapted_shapes, write_slot

log = logging.getLogger(__name__)


class UnknownAdapter(KeyError):
    """A request names an adapter the server does not serve (the API answers 404)."""


class AdapterUnavailable(Exception):
    """An adapter's weights left host memory and cannot be read again (its files are gone or changed)."""


class AdapterSlots:
    def __init__(self, view, config: LoRAConfig,
                 on_load: Callable[[str, float, str | None], None] = lambda *_: None):
        """view: the adapted serving view (`serve.lora.view.lora_view`, `config.max_loras + 1` slots);
        on_load(adapter, seconds, evicted adapter or None): called for every adapter put in a slot."""
        self.config = config
        self.on_load = on_load
        self.shapes = adapted_shapes(view)
        write_slot(view, 0, None)  # the base's zeros again: builds the slot writes' programs before serving
        self._lock = threading.Lock()  # request threads register and unregister, the engine thread places
        self.resident: collections.OrderedDict[Adapter, int] = collections.OrderedDict()  # -> slot, LRU first
        self.free = list(range(config.max_loras, 0, -1))  # slot 0 is the base's
        self.host: collections.OrderedDict[Adapter, None] = collections.OrderedDict()  # weights held, LRU first
        self.adapters: dict[str, Adapter] = {}
        for name, path in config.modules:
            self.adapters[name] = self._hold(load_adapter(name, path, self.shapes, config.max_rank))
        self.loads = 0
        self.reads = 0  # adapters read again from disk

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
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"LoRA adapter {name!r} is already served")
            self.adapters[name] = self._hold(adapter, locked=True)
        return adapter

    def unregister(self, name: str) -> None:
        """Refuses new requests for `name`; those already submitted finish with it (UnknownAdapter if not
        served)."""
        with self._lock:
            self.get(name)
            del self.adapters[name]

    def fetch(self, adapter: Adapter) -> None:
        """Makes sure `adapter` can be put in a slot: in one already, or its weights in host memory, read again
        from disk if they left (the engine thread waits for the read); AdapterUnavailable if they cannot be.
        Weights in host memory become its most recently used."""
        with self._lock:
            self._weights(adapter)

    def place(self, view, adapters: set[Adapter]) -> dict[Adapter, int]:
        """Puts `adapters` (at most `max_loras`) in slots of `view`, evicting the least recently used others;
        returns the slot of each. Writes the view's arrays: the caller takes its parameters anew where `loads`
        grew."""
        if len(adapters) > self.config.max_loras:
            raise ValueError(f"a step with {len(adapters)} adapters; {self.config.max_loras} slots")
        for adapter in adapters:
            with self._lock:
                if adapter in self.resident:
                    self.resident.move_to_end(adapter)
                    continue
                start = time.perf_counter()
                self._weights(adapter)
                victim = None
                if not self.free:  # the victim goes to host memory, or on to disk if it is the least used there
                    victim = next(a for a in self.resident if a not in adapters)
                    self.free.append(self.resident.pop(victim))
                    self._trim(keep=adapter)
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

    def _weights(self, adapter: Adapter) -> None:
        """(Holding the lock) `adapter`'s weights in host memory, the most recently used there."""
        if adapter.weights is None:
            try:
                weights = read_again(adapter, self.shapes, self.config.max_rank)
            except (ValueError, OSError) as exc:
                raise AdapterUnavailable(str(exc)) from None
            adapter.weights = weights
            self.reads += 1
            log.info("LoRA adapter %s read again from %s", adapter.name, adapter.path)
        self._hold(adapter, locked=True)

    def _hold(self, adapter: Adapter, locked: bool = False) -> Adapter:
        """Keeps `adapter`'s weights in host memory, the most recently used there, dropping those of the least
        recently used beyond `max_cpu_loras` (read again from disk when needed). Those of adapters in device
        slots stay, so that one taken out of its slot is still in host memory (`max_cpu_loras` >= `max_loras`:
        only while `adapter` is put in a slot do they hold one more)."""
        if not locked:
            with self._lock:
                return self._hold(adapter, locked=True)
        self.host[adapter] = None
        self.host.move_to_end(adapter)
        self._trim(keep=adapter)
        return adapter

    def _trim(self, keep: Adapter) -> None:
        """(Holding the lock) drops the weights of the least recently used adapters in host memory beyond
        `max_cpu_loras`, but not those of `keep` and of the adapters in slots."""
        while len(self.host) > self.config.max_cpu_loras:
            dropped = next((a for a in self.host if a not in self.resident and a is not keep), None)
            if dropped is None:
                return
            del self.host[dropped]
            dropped.weights = None
            log.debug("LoRA adapter %s left host memory", dropped.name)
