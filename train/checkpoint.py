"""Checkpoints with orbax's CheckpointManager: the whole TrainState (parameters, optimizer, MoE biases, step, RNG)
and a small JSON record (data position, run settings), saved asynchronously every N steps and at the last step,
keeping the last K. Works with orbax-checkpoint 0.12.x; restores onto any mesh (the target carries shardings).
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp

from train.state import TrainState


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

    def close(self) -> None:
        """Wait for saves in flight, then release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
