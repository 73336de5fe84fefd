"""Checkpoints with orbax's CheckpointManager: the whole TrainState (parameters, optimizer, MoE biases, step, RNG)
and a small JSON record (data position, run settings), saved asynchronously every N steps and at the last step,
keeping the last K. Works with orbax-checkpoint 0.12.x; restores onto any mesh (the target carries shardings).
"""

from __future__ import annotations

import logging
import os

import orbax.checkpoint as ocp

from train.state import TrainState

log = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, directory: str, *, save_every: int, keep: int, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(save_interval_steps=max(save_every, 1), max_to_keep=keep,
                                               enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, record: dict, *, force: bool = False) -> bool:
        """Start saving `state` as checkpoint `step` when the interval says so (or `force`); returns whether it
        did. The arrays are copied off the devices before this returns, so the state may be donated next."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state.to_dict()), record=ocp.args.JsonSave(record))
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict]:
        """(state, record) of checkpoint `step`; `target` gives shapes, dtypes and shardings (abstract is fine)."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target.to_dict()), record=ocp.args.JsonRestore())
        out = self.manager.restore(step, args=args)
        return TrainState.from_dict(out["state"]), dict(out["record"])

    def restore_latest(self, target: TrainState, record: dict) -> tuple[TrainState, dict] | None:
        """(state, saved record) of the newest checkpoint, warning about the entries of `record` (this run's
        settings) that differ from the saved ones; None when there is no checkpoint."""
        step = self.latest_step()
        if not step:
            return None
        state, saved = self.restore(step, target)
        changed = {k: (saved.get(k), v) for k, v in record.items() if saved.get(k) != v}
        if changed:
            log.warning("resuming with different settings (saved, now): %s", changed)
        log.info("resuming from checkpoint %d", step)
        return state, saved

    def close(self) -> None:
        """Wait for saves in flight, then release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
