"""benchmarks/sampling_draw.py: a tiny run times both draws, checks their tokens and records them;
where a trace has device time, that is the per-call figure."""
import json
import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import sampling_draw  # noqa: E402
from tests.fake_trace import fake_traced_kernels  # noqa: E402


def test_a_tiny_run_records_both_draws(tmp_path, few_executables):
    out = tmp_path / "draw.json"
    rows = sampling_draw.main(["--rows", "3", "--vocab", "300", "--iters", "1", "--warmup", "1",
                               "--trace-calls", "2", "--trace-dir", str(tmp_path / "trace"),
                               "--out", str(out)])
    assert {r["draw"] for r in rows} == set(sampling_draw.DRAWS)
    on_cpu = jax.default_backend() == "cpu"
    for r in rows:
        assert r["tokens_in_range"] and r["us"] > 0 and r["rows"] == 3 and r["vocab"] == 300
        assert (r["device_us"] is None) == on_cpu, r
        assert r["compiled_memory"]["backend"] == jax.default_backend()
    assert len(json.loads(out.read_text())["results"]) == len(rows)


def test_device_time_per_call_where_a_trace_has_one(tmp_path, monkeypatch):
    runs = []  # 1 ms of device time a trace, as a GPU's would report it
    monkeypatch.setattr(sampling_draw.timing, "traced_kernels", fake_traced_kernels(1e-3, runs))
    rows = sampling_draw.main(["--rows", "2", "--vocab", "50", "--draws", "inverse_cdf",
                               "--iters", "1", "--warmup", "1", "--trace-calls", "4",
                               "--out", str(tmp_path / "draw.json")])
    assert runs == [4] and rows[0]["device_us"] == pytest.approx(250.0)
