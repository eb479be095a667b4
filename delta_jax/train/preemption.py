"""Stopping a run cleanly when the cluster (SIGTERM) or the user (SIGINT, Ctrl-C) asks.

    with StopOnSignal() as stop:          # installs the handlers (main thread only)
        ...
        if stop.requested(): ...          # checked between steps / phases

The first SIGINT or SIGTERM only sets a flag: the loop finishes (or abandons, if its updates have
not started) the step in hand, saves a checkpoint, closes the reward workers and raises
TrainingInterrupted, which delta_jax.main turns into a one-line message and exit code 128 + signal
(130 for SIGINT, 143 for SIGTERM). A second signal exits at once with that code.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    """The run stopped on a signal after saving checkpoint `step` (None: nothing was saved,
    e.g. during the SFT warm start, which is not checkpointed until it ends)."""

    def __init__(self, signum: int, step: int | None, checkpoint_dir: str):
        self.signum, self.step, self.checkpoint_dir = signum, step, checkpoint_dir
        name = signal.Signals(signum).name
        if step is None:
            where = "before the first checkpoint (nothing saved)"
        else:
            where = f"checkpoint step {step} saved in {checkpoint_dir}"
        super().__init__(f"stopped by {name}: {where}; run the same command to resume")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopOnSignal:
    """Context manager: SIGINT / SIGTERM set `signum` (the first) instead of killing the process;
    a second one exits at once with 128 + signal. Outside the main thread (where Python cannot
    install handlers) it does nothing and `requested()` stays False."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict = {}

    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is not None:
            print(f"second {signal.Signals(signum).name}: exiting now without saving",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"{signal.Signals(signum).name} received: stopping after the step in hand and "
              "saving a checkpoint (send it again to exit at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        return False
