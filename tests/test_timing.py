"""kernels.timing's profile summary (the compiled-memory helpers are tested in test_plan.py)."""
import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest

from delta_jax.kernels import timing


def _write_trace(folder, events):
    path = folder / "plugins" / "profile" / "run" / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_trace_summary_sums_device_kernels_by_name(tmp_path):
    """Known answer: complete events of the device process summed by name, largest first; host
    events, metadata and other phases left out; share over the device time."""
    meta = lambda pid, name: {"ph": "M", "name": "process_name", "pid": pid,  # noqa: E731
                              "args": {"name": name}}
    x = lambda pid, name, dur: {"ph": "X", "pid": pid, "name": name, "dur": dur, "ts": 0}  # noqa
    _write_trace(tmp_path, [
        meta(1, "/device:GPU:0"), meta(2, "/host:CPU"),
        x(1, "attention", 30.0), x(1, "memcpy", 5.0), x(1, "attention", 40.0), x(1, "gemm", 25.0),
        x(2, "attention", 1000.0), {"ph": "i", "pid": 1, "name": "marker", "ts": 3}])
    rows = timing.trace_summary(tmp_path)
    assert [(r["process"], r["name"], r["total_us"], r["count"]) for r in rows] == [
        ("/device:GPU:0", "attention", 70.0, 2), ("/device:GPU:0", "gemm", 25.0, 1),
        ("/device:GPU:0", "memcpy", 5.0, 1)]
    assert [r["share"] for r in rows] == pytest.approx([0.7, 0.25, 0.05])
    assert len(timing.trace_summary(tmp_path, top=1)) == 1


def test_trace_summary_reads_what_jax_profiler_writes(tmp_path):
    """On a real trace (no device process on the CPU: every process counts) the jitted
    program's events are found; an empty folder is an error naming it."""
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    a = jnp.ones((64, 64))
    f(a).block_until_ready()
    with jax.profiler.trace(str(tmp_path / "t"), create_perfetto_trace=True):
        f(a).block_until_ready()
    rows = timing.trace_summary(tmp_path / "t", top=1000)
    assert rows and all(r["total_us"] >= 0 and r["count"] >= 1 for r in rows)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="empty"):
        timing.trace_summary(tmp_path / "empty")
