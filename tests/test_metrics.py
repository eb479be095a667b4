"""Metrics: metrics.jsonl lines, TensorBoard event files readable back, console summary."""
import glob

import numpy as np

from delta_jax.train.metrics import (MetricsWriter, device_memory_metrics, read_jsonl,
                                     summary_line, to_scalars)


def test_jsonl_and_tensorboard(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.write(1, {"rollout/reward_mean": np.float32(0.5), "policy/loss": 1.25, "skip": "text",
                "vec": np.ones(3), "bad": float("nan")})
    w.write(2, {"rollout/reward_mean": 0.75, "eval/aime 24/pass@4": 0.5})
    w.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert rows[0]["step"] == 1 and rows[0]["rollout/reward_mean"] == 0.5
    assert rows[0]["policy/loss"] == 1.25 and rows[0]["bad"] == "nan"
    assert "skip" not in rows[0] and "vec" not in rows[0]
    assert rows[1] == {"step": 2, "rollout/reward_mean": 0.75, "eval/aime 24/pass@4": 0.5}

    events = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    assert events
    from tensorboardX.proto import event_pb2  # read the records back independently
    import struct
    values = {}
    with open(events[0], "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        payload = data[pos + 12:pos + 12 + length]
        pos += 12 + length + 4
        ev = event_pb2.Event.FromString(payload)
        for v in ev.summary.value:
            values[(v.tag, ev.step)] = v.simple_value
    assert values[("rollout/reward_mean", 1)] == 0.5
    assert values[("rollout/reward_mean", 2)] == 0.75
    assert values[("eval/aime_24/pass_at_4", 2)] == 0.5  # TensorBoard's tag characters only


def test_summary_line_and_scalars():
    s = to_scalars({"a": np.array([2.0]), "b": True, "c": [1, 2]})
    assert s == {"a": 2.0, "b": 1.0}
    line = summary_line(3, {"rollout/reward_mean": 0.25, "policy/grad_norm": 1.5})
    assert line.startswith("step 3") and "reward 0.25" in line and "gnorm 1.5" in line


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_device_memory_metrics_takes_the_fullest_device_and_the_smallest_limit():
    """Across the devices that report (a backend without statistics returns None or raises):
    the largest peak and in-use bytes and the smallest limit, in GB of 1e9 bytes; {} where none
    reports (the CPU), and an allocator without a peak figure reports its in-use bytes."""
    devices = [_Device({"bytes_in_use": 3e9, "peak_bytes_in_use": 9e9, "bytes_limit": 60e9}),
               _Device(None), _Device(RuntimeError("no statistics")),
               _Device({"bytes_in_use": 5e9, "peak_bytes_in_use": 7e9, "bytes_limit": 59e9})]
    assert device_memory_metrics(devices) == {"memory/peak_gb": 9.0, "memory/in_use_gb": 5.0,
                                              "memory/limit_gb": 59.0}
    assert device_memory_metrics([_Device(None), _Device(RuntimeError("x"))]) == {}
    assert device_memory_metrics([_Device({"bytes_in_use": 2e9})]) == {
        "memory/peak_gb": 2.0, "memory/in_use_gb": 2.0}
