"""Stopping a run cleanly when the cluster (SIGTERM) or the user (SIGINT, Ctrl-C) asks.

    with StopOnSignal() as stop:          # installs the handlers (main thread only)
        ...
        if stop.requested(): ...          # checked between steps / phases

The first SIGINT or SIGTERM only sets a flag: the loop finishes (or abandons, if its updates have
not started) the step in hand, saves a checkpoint, closes the reward workers and raises
TrainingInterrupted, which delta_jax.main turns into a one-line message and exit code 128 + signal
(130 for SIGINT, 143 for SIGTERM). A second signal exits at once with that code.

In a run of several processes (multi-host) a signal reaches each host on its own, at any point
of its step, and the hosts must still stop at the same step: requested() is then a collective
(every process calls it at the same points, as the loop does), true on all processes as soon as
any of them has a signal.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    """The run stopped on a signal after saving checkpoint `step` in `checkpoint_dir` (the RL
    steps' checkpoints, or the SFT warm start's own: loop.SFT_CHECKPOINTS; None: nothing was
    saved)."""

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
    a second one to this process exits at once with 128 + signal. Outside the main thread (where
    Python cannot install handlers) it does nothing and `requested()` stays False (but still
    takes part in the agreement of a multi-process run)."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.signum: int | None = None     # the signal the run stops with
        self._received: int | None = None  # the first signal this process itself received
        self._previous: dict = {}

    def requested(self) -> bool:
        """Whether to stop. Collective when there are several processes: all get the same
        answer, and one that had no signal takes the signal of one that had."""
        import jax
        if jax.process_count() == 1:
            return self._received is not None
        # The agreed answer alone: a signal that lands after this process's part was sent is
        # agreed on at the next call, by every process alike.
        agreed = agreed_signal(self._received or 0)
        if agreed and self.signum is None:
            self.signum = agreed
            print(f"{signal.Signals(agreed).name} received by another process: stopping "
                  "after the step in hand with it", file=sys.stderr, flush=True)
        return agreed != 0

    def _handle(self, signum, frame):
        if self._received is not None:
            print(f"second {signal.Signals(signum).name}: exiting now without saving",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self._received = signum
        if self.signum is None:
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


def agreed_signal(local: int) -> int:
    """The largest of every process's `local` signal number (0 = none); a collective."""
    import numpy as np
    from jax.experimental import multihost_utils
    return int(np.max(multihost_utils.process_allgather(np.int32(local))))
