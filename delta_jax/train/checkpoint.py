"""Orbax checkpoints of a run: train state (params, optimizer state, step), the data iterator's
state and run metadata (seed, counters), saved atomically under <workdir>/checkpoints/<step>.

Randomness is not stored as key arrays: every random draw in the loop is seeded from (seed, step),
so the metadata's seed plus the step reproduce it exactly after a resume.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from delta_jax import files
from delta_jax.errors import InputError, first_line
from delta_jax.log_utils import absl_warning_held_back

log = logging.getLogger("delta_jax.train")

# Orbax writes an array that several devices hold (replicated) "replica-parallel" by default
# (unless JAX_PLATFORMS names a GPU): each replica writes a slice of it, cut by one dispatched
# device op (compiled for its shape on first use) per replica and array. Worth it for big arrays
# spread over hosts; for small ones the dispatches cost more than the writes they share (the
# tests' tiny RL state on 8 CPU devices: a process's first save 3.5 s, later ones 0.27 s, against
# 0.14 s written whole). Slices below this size are written whole by one replica instead.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _use_array_handler():
    """Registers orbax's jax.Array handler with MIN_REPLICA_SLICE_BYTES (its other options at
    their defaults) for every checkpoint of this process; this module is orbax's only user."""
    handler = ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES)
    # orbax warns 'Type handler registry type "<jax.Array>" overriding ...': the point here.
    with absl_warning_held_back("Type handler registry type"):
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


class CheckpointError(InputError):
    """A checkpoint that does not read back; the message names its directory and the cause.

    An input error (delta_jax.main prints it without a traceback, exit code 1): what a run
    directory holds is the user's to fix (the settings that wrote it, or another --workdir)."""


class Checkpointer:
    """Save every `save_every` steps (and when forced), keep the newest `keep`, resume latest."""

    def __init__(self, directory: str, *, save_every: int = 1, keep: int = 3,
                 read_only: bool = False):
        """read_only: for reading a run's checkpoints without touching them (mode=eval): the
        directory is not created, nothing is saved, and restore_latest leaves unreadable
        checkpoints where they are."""
        self.directory = os.path.abspath(directory)
        self.save_every = save_every
        self.read_only = read_only
        _use_array_handler()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                               read_only=read_only,
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
        if self.read_only:
            raise RuntimeError(f"{self.directory}: opened read-only, not saving step {step}")
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

    def restore(self, step: int, target_state: Any, partial: bool = False):
        """Returns (state, data_state, meta); `target_state` gives the structure, shapes, dtypes
        and shardings (real arrays or jax.ShapeDtypeStruct). partial: `target_state` names a
        part of the saved state ({"params": params}: what evaluation needs), and only that part
        is read (orbax's partial restore); the state returned has its structure."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        try:
            if partial:  # the manager's "state" handler is the one it saved with: read it apart
                with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
                    state = reader.restore(
                        os.path.join(self.directory, str(step), "state"),
                        args=ocp.args.PyTreeRestore(
                            abstract, partial_restore=True,
                            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))
                out = self._manager.restore(step, args=ocp.args.Composite(
                    data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
            else:
                out = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract),
                    data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore()))
                state = out["state"]
            data, meta = out["data"], out["meta"]
        except Exception as e:  # noqa: BLE001 -- orbax / tensorstore / json raise many kinds
            raise CheckpointError(f"{os.path.join(self.directory, str(step))}: does not read "
                                  f"back ({first_line(e)})"
                                  f"{'' if partial else self._layout_hint(step, abstract)}"
                                  ) from e
        for name, value in (("data", data), ("meta", meta)):
            if not isinstance(value, dict):
                raise CheckpointError(f"{os.path.join(self.directory, str(step), name)}: expected "
                                      f"a JSON object, got {type(value).__name__}")
        return state, data, meta

    def _layout_hint(self, step: int, abstract) -> str:
        """Where the saved state holds another number of arrays than this run's: which settings
        change the state's layout."""
        try:
            saved = len(jax.tree.leaves(self._manager.item_metadata(step)["state"]))
        except Exception:  # noqa: BLE001 -- no readable metadata: the error above says enough
            return ""
        wanted = len(jax.tree.leaves(abstract))
        if saved == wanted:
            return ""
        return (f"; it holds {saved} arrays of train state where this run's has {wanted}: it was "
                "written by a run with other settings among optim.master_weights (bfloat16 "
                "parameters' float32 master copy; checkpoints of bfloat16 runs from before "
                "2026-11-28 have none: resume them with optim.master_weights=False) and "
                "model.lora_rank / lora_targets")

    def restore_latest(self, target_state: Any, partial: bool = False):
        """(step, state, data_state, meta) of the newest checkpoint that reads back (`partial`:
        as restore), or None when there is none. Newer ones that do not read back are skipped
        with a warning naming them and why; if every checkpoint fails, CheckpointError lists
        them all.

        With several processes each reads its own shards, so one may fail where the others
        succeed (a damaged file only it reads): they agree on every candidate (one all-gather
        of a flag each) and skip it together, so all resume from the same step."""
        failures = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                state, data, meta = self.restore(step, target_state, partial)
                error = None
            except CheckpointError as e:
                error = str(e)
            if not readable_everywhere(error is None):
                error = error or (f"{os.path.join(self.directory, str(step))}: another process "
                                  "could not read it back")
                log.warning("skipping checkpoint %d: %s", step, error)
                failures.append(error)
                continue
            if failures and self.read_only:
                log.warning("reading checkpoint %d, the newest that reads back (the newer ones "
                            "are left as they are)", step)
            elif failures:
                log.warning("resuming from checkpoint %d, the newest that reads back; the newer "
                            "ones are kept aside as %s/unreadable-<step>", step, self.directory)
                self._set_aside([s for s in self.all_steps() if s > step])
            return step, state, data, meta
        if failures:
            raise CheckpointError("no checkpoint in " + self.directory + " reads back:\n  "
                                  + "\n  ".join(failures) + "\nResume with the settings that "
                                  "wrote them, or use another --workdir (they are left as "
                                  "they are)")
        return None

    def _set_aside(self, steps):
        """Renames unreadable checkpoints out of the step sequence (a resumed run saves those
        steps again); nothing is deleted. Process 0 renames; every process waits for it."""
        if jax.process_index() == 0:
            for step in steps:
                os.rename(os.path.join(self.directory, str(step)),
                          files.unused_path(os.path.join(self.directory, f"unreadable-{step}")))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("checkpoint set-aside")
        self._manager.reload()

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()

    def remove(self):
        """Closes the manager and removes the whole directory, every step in it. Collective:
        process 0 removes it once every process has closed; all return once it is gone."""
        self.close()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"checkpoint remove {self.directory}")
        if jax.process_index() == 0:
            shutil.rmtree(self.directory, ignore_errors=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint removed {self.directory}")


def readable_everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (this process's answer alone with one process)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))
