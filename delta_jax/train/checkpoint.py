"""Orbax checkpoints of a run: train state (params, optimizer state, step), the data iterator's
state and run metadata (seed, counters), saved atomically under <workdir>/checkpoints/<step>.

Randomness is not stored as key arrays: every random draw in the loop is seeded from (seed, step),
so the metadata's seed plus the step reproduce it exactly after a resume.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Save every `save_every` steps (and when forced), keep the newest `keep`, resume latest."""

    def __init__(self, directory: str, *, save_every: int = 1, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "data", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        return self.save_every > 0 and step % self.save_every == 0

    def save(self, step: int, state: Any, data_state: dict | None, meta: dict,
             force: bool = False) -> bool:
        """Saves if `step` is on the save interval (or forced); blocks until it is on disk."""
        if not (force or self.should_save(step)):
            return False
        if step in self.all_steps():
            return False
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state or {}),
            meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()
        return True

    def restore(self, step: int, target_state: Any):
        """Returns (state, data_state, meta); `target_state` gives the structure, shapes, dtypes
        and shardings (real arrays or jax.ShapeDtypeStruct)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract),
            data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return out["state"], out["data"], out["meta"]

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()
