"""benchmarks/decode_gemm.py: its split-K form computes the same product as one dot, and a tiny
run times every group and variant, each checked against a float64 NumPy product, and records
them."""
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_gemm  # noqa: E402
from tests.fake_trace import fake_traced_kernels  # noqa: E402


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_split_k_dot_is_the_dot(parts):
  rng = np.random.RandomState(parts)
  x = rng.randn(5, 32).astype(np.float32)
  w = rng.randn(32, 7).astype(np.float32)
  got = decode_gemm.dot(jnp.asarray(x), jnp.asarray(w), parts)
  np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_gemm_configs_reads_triton_and_cublas_choices():
  """The two forms XLA:GPU's compiled text gives a GEMM's configuration (a legacy Triton GEMM
  fusion's triton_gemm_config, the generic emitter's output tiles), and cuBLAS calls; other
  lines (a loop fusion) are skipped."""
  text = ('%f = bf16[64,4096] fusion(...), kind=kCustom, backend_config={"fusion_backend_config":'
          '{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"64","block_n":"128",'
          '"block_k":"64","split_k":"4","num_stages":"3","num_warps":"4","num_ctas":"1"}}}\n'
          '%n = bf16[64,1024] fusion(...), kind=kCustom, backend_config={"fusion_backend_config":'
          '{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"output_tiles":'
          '[{"sizes":["16","64"]}],"num_warps":"4","num_ctas":1,"num_stages":2}}}\n'
          '%l = bf16[64,1024] fusion(...), kind=kLoop, calls=%fused_add\n'
          '%g = (bf16[64,1024], s8[0]) custom-call(...), custom_call_target="__cublas$gemm"\n')
  assert decode_gemm.gemm_configs(text) == [
      "__triton_gemm block_m=64 block_n=128 block_k=64 split_k=4 num_stages=3 num_warps=4",
      "__triton_nested_gemm_fusion num_stages=2 num_warps=4 tiles=16,64",
      "cublas"]


def test_a_tiny_run_records_every_group_and_variant(tmp_path, few_executables):
  out = tmp_path / "gemm.json"
  rows = decode_gemm.main(["--preset", "tiny", "--dtype", "float32", "--batch", "4",
                           "--split-k", "2", "--iters", "1", "--warmup", "1", "--calls", "1",
                           "--trace-calls", "2", "--trace-dir", str(tmp_path / "trace"),
                           "--copy-mib", "4", "--out", str(out)])
  seen = {(r["group"], r["variant"]) for r in rows}
  assert seen == {(g, v) for g in decode_gemm.GROUPS for v in ("xla", "splitk2")} | {
      ("qkv", "concat"), ("gate_up", "concat")}
  # every variant, "xla" included, against a float64 NumPy product: float32 at the suite's
  # "highest" matmul precision is ~1e-6 off for these O(1) outputs
  assert all(r["ok"] and r["us"] > 0 and r["max_abs_error"] < 1e-5 for r in rows), rows
  # XLA:CPU's trace has no device events: the rates come from the wall time; a GPU's has them,
  # and the rates come from the device time
  on_cpu = jax.default_backend() == "cpu"
  for r in rows:
    assert r["rate_from"] == ("wall" if on_cpu else "device"), r
    assert (r["device_us"] is None) == on_cpu, r
    per_call_us = r["us"] if on_cpu else r["device_us"]
    assert r["gb_s"] == pytest.approx(r["weight_bytes"] / per_call_us / 1e3), r
  record = json.loads(out.read_text())
  assert record["copy_bandwidth_gb_s"] > 0 and len(record["results"]) == len(rows)
  for r in rows:  # each program's compiled memory analysis, from the backend it ran on
    memory = r["compiled_memory"]
    assert memory["backend"] == jax.default_backend() and memory["argument_bytes"] > 0
  # split-K holds its float32 partial sums: 2 x the 4 x 64 float32 down projection's output
  # (on XLA:CPU the plain dot needs none; a GPU adds its GEMM workspace to both)
  down = {r["variant"]: r["compiled_memory"]["temp_bytes"] for r in rows if r["group"] == "down"}
  assert down["splitk2"] >= 2 * 4 * 64 * 4, down


def test_rates_come_from_the_device_time_where_a_trace_has_one(tmp_path, monkeypatch):
  """Where the profiler reports device time (a GPU), each call's device time is the traced
  device time over the calls run under the trace, and the rates come from it, not from the wall
  time (dispatch-bound for a few-microsecond matmul)."""
  runs = []  # 2 ms of device time a trace, as a GPU's would report it
  monkeypatch.setattr(decode_gemm.timing, "traced_kernels", fake_traced_kernels(2e-3, runs))
  rows = decode_gemm.main(["--preset", "tiny", "--dtype", "float32", "--batch", "4",
                           "--groups", "down", "--split-k", "2", "--iters", "1", "--warmup", "1",
                           "--calls", "1", "--trace-calls", "8", "--copy-mib", "4",
                           "--out", str(tmp_path / "gemm.json")])
  assert runs == [8, 8]  # xla, splitk2: 8 calls each under the trace
  for r in rows:
    assert r["rate_from"] == "device" and r["device_us"] == pytest.approx(250.0)
    assert r["gb_s"] == pytest.approx(r["weight_bytes"] / 250e-6 / 1e9)
