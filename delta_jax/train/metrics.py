"""Metrics output: TensorBoard event files (tensorboardX), <workdir>/metrics.jsonl, console line.

`MetricsWriter.write(step, metrics)` takes a flat dict of Python/NumPy/JAX scalars; names use "/"
to group ("rollout/reward_mean", "time/update_s", "delta/gamma_pos"). metrics.jsonl keeps the
names as given; TensorBoard tags allow only letters, digits, "_", "-", "/" and ".", so there "@"
reads "_at_" ("eval/average/pass_at_4") and any other character "_".
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Mapping

import numpy as np

# Shown on the one-line console summary when present, in this order.
SUMMARY_KEYS = (
    ("rollout/reward_mean", "reward"), ("rollout/accuracy", "acc"),
    ("rollout/response_len_mean", "len"), ("policy/entropy", "ent"), ("policy/loss", "loss"),
    ("policy/grad_norm", "gnorm"), ("policy/approx_kl", "kl"), ("policy/clip_frac", "clip"),
    ("optim/learning_rate", "lr"), ("time/step_s", "s"), ("perf/tokens_per_s", "tok/s"),
)


def device_memory_metrics(devices=None) -> dict[str, float]:
    """What the allocators of `devices` (default this process's local devices) report, in GB of
    1e9 bytes as plan mode prints them, where the backend reports it (GPUs, TPUs; not the
    CPU, which gives {}): "memory/peak_gb", the most any of them has held since the process
    started (peak_bytes_in_use), "memory/in_use_gb", the most one holds now, and
    "memory/limit_gb", the least one may hold (bytes_limit: what plan.check_memory judges the
    phases against)."""
    import jax

    stats = []
    for device in jax.local_devices() if devices is None else devices:
        try:
            got = device.memory_stats()
        except Exception:  # noqa: BLE001  (backends without allocator statistics raise)
            got = None
        if got and "bytes_in_use" in got:
            stats.append(got)
    if not stats:
        return {}
    out = {"memory/peak_gb": max(s.get("peak_bytes_in_use", s["bytes_in_use"]) for s in stats),
           "memory/in_use_gb": max(s["bytes_in_use"] for s in stats)}
    limits = [s["bytes_limit"] for s in stats if s.get("bytes_limit")]
    if limits:
        out["memory/limit_gb"] = min(limits)
    return {k: v / 1e9 for k, v in out.items()}


def sampler_metrics(counters: Mapping[str, float], prefix: str) -> dict[str, float]:
    """A run's sampler counters (GenerationOutput.counters, summed over its generate() calls) as
    metrics under `prefix` ("rollout", "eval"): tokens generated and their rate over the sampler's
    wall time, decode steps, slot utilization (live samples per slot and decode step),
    preemptions (samples set back when the KV page pool, rollout.kv_budget_gb, ran dry), how many
    of them resumed with their tokens (rollout.resume_preempted; the others restarted) and the
    seconds in the prefill and decode programs."""
    tokens = counters["generated_tokens"]
    return {f"{prefix}/generated_tokens": tokens,
            f"{prefix}/tokens_per_s": tokens / max(counters["seconds"], 1e-9),
            f"{prefix}/decode_steps": counters["decode_steps"],
            f"{prefix}/slot_utilization": tokens / max(counters["slot_steps"], 1.0),
            f"{prefix}/preemptions": counters["preemptions"],
            f"{prefix}/resumed": counters["resumed"],
            f"{prefix}/prefill_s": counters["prefill_seconds"],
            f"{prefix}/decode_s": counters["decode_seconds"]}


def to_scalars(metrics: Mapping) -> dict[str, float]:
    """Flat dict of finite-or-not Python floats (arrays with one element become scalars)."""
    out = {}
    for key, value in metrics.items():
        arr = np.asarray(value)
        if arr.size != 1 or not np.issubdtype(arr.dtype, np.number) and arr.dtype != bool:
            continue
        out[key] = float(arr.reshape(()))
    return out


def summary_line(step: int, scalars: Mapping[str, float]) -> str:
    parts = [f"step {step}"]
    for key, short in SUMMARY_KEYS:
        if key in scalars:
            v = scalars[key]
            parts.append(f"{short} {v:.3g}" if abs(v) < 1e4 else f"{short} {v:.3e}")
    return " | ".join(parts)


def tensorboard_tag(name: str) -> str:
    """`name` as a TensorBoard tag (tensorboardX would rename an illegal one itself, logging a
    line each time: ~20 lines per evaluation)."""
    return re.sub(r"[^-/\w.]", "_", name.replace("@", "_at_"))


class MetricsWriter:
    """Appends each step's scalars to metrics.jsonl and TensorBoard events in `workdir`."""

    def __init__(self, workdir: str, tensorboard: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(logdir=os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: Mapping, prefix: str = "") -> dict[str, float]:
        scalars = {prefix + k: v for k, v in to_scalars(metrics).items()}
        record = {"step": int(step)}
        # JSON has no NaN/inf: write them as strings so the file stays valid JSON lines.
        record.update({k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(tensorboard_tag(k), v, global_step=int(step))
            self._tb.flush()
        return scalars

    def position(self) -> int:
        """Bytes of metrics.jsonl written so far (saved with each checkpoint)."""
        self._jsonl.flush()
        return os.path.getsize(self.jsonl_path)

    def truncate(self, position: int):
        """Drops what metrics.jsonl holds past `position` (a resumed run rewrites those steps).
        TensorBoard event files are append-only: they keep the old rows of those steps too."""
        self._jsonl.flush()
        if 0 <= position < os.path.getsize(self.jsonl_path):
            os.truncate(self.jsonl_path, position)

    def write_text(self, step: int, tag: str, text: str):
        if self._tb is not None:
            self._tb.add_text(tag, text, global_step=int(step))
            self._tb.flush()

    def close(self):
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
