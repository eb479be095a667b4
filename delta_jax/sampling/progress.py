"""Progress lines for long generate() calls (a rollout of long responses, an evaluation).

`ProgressLog(label, every_s)` is a Sampler.generate(progress=) callback: after the first
`every_s` seconds of a call, and then every `every_s` seconds, it logs one line

    rollout step 3: 812 / 2,048 samples done, 4.12 M tokens in 120 s (34,300 tok/s), 3,840 decode steps

so that a rollout or evaluation that runs for many minutes says where it is. A call shorter than
`every_s` logs nothing; `every_s` <= 0 never logs. One ProgressLog may serve several generate()
calls in turn (an evaluation's benchmarks): a call's clock starting again starts its throttle
again.
"""
from __future__ import annotations

import logging
import math

log = logging.getLogger("delta_jax.sampling")


def format_progress(label: str, info: dict) -> str:
    """The line for one progress dict of Sampler.generate(progress=)."""
    seconds = max(float(info["seconds"]), 1e-9)
    tokens = int(info["generated_tokens"])
    return (f"{label}: {info['finished']:,} / {info['samples']:,} samples done, "
            f"{tokens / 1e6:.2f} M tokens in {seconds:.0f} s ({tokens / seconds:,.0f} tok/s), "
            f"{info['decode_steps']:,} decode steps")


class ProgressLog:
    """Sampler.generate(progress=) callback logging format_progress lines every `every_s`
    seconds of a call (none in its first `every_s`)."""

    def __init__(self, label: str, every_s: float):
        self.label, self.every_s = label, float(every_s)
        self._next = self.every_s
        self._last_seconds = 0.0

    def __call__(self, info: dict) -> None:
        if self.every_s <= 0:
            return
        seconds = float(info["seconds"])
        if seconds < self._last_seconds:  # the next generate() call: its own clock
            self._next = self.every_s
        self._last_seconds = seconds
        if seconds >= self._next:
            log.info("%s", format_progress(self.label, info))
            self._next = (math.floor(seconds / self.every_s) + 1) * self.every_s
