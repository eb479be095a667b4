"""The best policy by an eval metric (train.best_metric), as the DelTA paper picks its checkpoint:
AIME25 avg@8, validated every 4 steps (DELTA_SPEC.md section 3).

`BestPolicy.offer(step, metrics, export)` runs after each training evaluation: when the eval's
value of the metric beats the best so far (train.best_mode: "max" or "min"), `export(path)`
writes the policy there as a Hugging Face directory (what workdir/final holds) and
workdir/best/best.json records {"metric", "value", "step", "mode"}. The new export is written
beside the old one (best.partial) and takes its place once complete, so workdir/best always
holds a whole policy. The best so far comes from best/best.json when the run starts (process 0
reads it, every process gets its value), so a resumed run goes on comparing with it; the eval
metrics are global, so every process of a multi-host run takes the same decisions and calls
the (collective) export together.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from typing import Callable, Mapping, Optional

import jax
import numpy as np

from delta_jax import sharding as sharding_lib

BEST = "best"
RECORD = "best.json"

log = logging.getLogger("delta_jax.train")


def read_best(workdir: str) -> Optional[dict]:
    """workdir/best/best.json ({"metric", "value", "step", "mode"}), None when absent or
    unreadable (an export that did not finish never replaces it)."""
    path = os.path.join(workdir, BEST, RECORD)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        return record if isinstance(record, dict) and "value" in record else None
    except (OSError, ValueError):
        return None


class BestPolicy:
    def __init__(self, workdir: str, metric: str, mode: str = "max"):
        if mode not in ("max", "min"):
            raise ValueError(f"train.best_mode must be 'max' or 'min', got {mode!r}")
        self.workdir, self.metric, self.mode = workdir, metric, mode
        value = math.nan
        if jax.process_index() == 0:
            record = read_best(workdir)
            if record is not None and record.get("metric") == metric and record.get("mode") == mode:
                value = float(record["value"])
        value = float(sharding_lib.from_process_0(np.float64(value)))
        self.value: Optional[float] = None if math.isnan(value) else value

    def better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def offer(self, step: int, metrics: Mapping[str, float],
              export: Callable[[str], None]) -> bool:
        """Exports the policy (export(path), collective) when metrics[self.metric] beats the best
        so far; returns whether it did. Metrics without it (no eval this time) change nothing."""
        if self.metric not in metrics or not self.better(float(metrics[self.metric])):
            return False
        value = float(metrics[self.metric])
        path = os.path.join(self.workdir, BEST)
        partial, old = path + ".partial", path + ".old"
        if jax.process_index() == 0 and os.path.exists(partial):  # a stopped export's remains
            shutil.rmtree(partial)
        export(partial)
        if jax.process_index() == 0:
            with open(os.path.join(partial, RECORD), "w", encoding="utf-8") as f:
                json.dump({"metric": self.metric, "value": value, "step": int(step),
                           "mode": self.mode}, f, indent=2)
            if os.path.exists(old):
                shutil.rmtree(old)
            if os.path.exists(path):
                os.rename(path, old)
            os.rename(partial, path)
            shutil.rmtree(old, ignore_errors=True)
        log.info("best %s so far: %.4g at step %d (before: %s); the policy is in %s",
                 self.metric, value, step,
                 "none" if self.value is None else f"{self.value:.4g}", path)
        self.value = value
        return True
