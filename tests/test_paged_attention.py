"""benchmarks/paged_attention.py: the sweep runs the product's paged decode attention, checks every
configuration against the jnp reference, skips configurations the kernel would clip to one already
listed, and writes its records."""
import json
import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import paged_attention as bench  # noqa: E402
from tests import mosaic_interpret  # noqa: E402

needs_interpreter = pytest.mark.skipif(mosaic_interpret.available() is not None,
                                       reason=str(mosaic_interpret.available()))


def test_mosaic_configurations_respect_the_kernel_limits():
    """The Mosaic kernel's points: a step must hold a multiple of 64 keys (1 page of 32 does
    not), a split's share bounds the block (2 pages of 64 in 32 splits), and shared memory
    bounds stages x pages (4 pages x 4 stages and 8 pages need over 227 KiB)."""
    args = bench.parse_args(["--pages-per-seq", "64", "--k-splits", "1", "32",
                             "--pages-per-block", "1", "2", "4", "8", "--num-stages", "2", "4",
                             "--impls", "mosaic"])
    got = [kw for _, impl, kw in bench.configurations(args)]
    assert got == [{"k_splits": 1, "pages_per_block": 2, "stages": 2, "rows_per_block": 1},
                   {"k_splits": 1, "pages_per_block": 2, "stages": 4, "rows_per_block": 1},
                   {"k_splits": 1, "pages_per_block": 4, "stages": 2, "rows_per_block": 1},
                   {"k_splits": 32, "pages_per_block": 2, "stages": 2, "rows_per_block": 1},
                   {"k_splits": 32, "pages_per_block": 2, "stages": 4, "rows_per_block": 1}]
    # --rows-per-block: each point once per value (1 a block by default)
    args = bench.parse_args(["--pages-per-seq", "64", "--k-splits", "1", "--pages-per-block",
                             "2", "--num-stages", "2", "--rows-per-block", "1", "2",
                             "--impls", "mosaic"])
    assert [label for label, _, _ in bench.configurations(args)] == [
        "mosaic k_splits=1 ppb=2 stages=2 rows=1", "mosaic k_splits=1 ppb=2 stages=2 rows=2"]


def test_tpu_configurations_divide_the_table():
    """The TPU kernel's compute blocks: only those that divide the table's width."""
    args = bench.parse_args(["--pages-per-seq", "8", "--length", "64", "--pages-per-block", "2",
                             "3", "8", "16", "--impls", "tpu"])
    assert [(label, kw) for label, _, kw in bench.configurations(args)] == [
        ("tpu ppb=2", {"pages_per_block": 2}), ("tpu ppb=8", {"pages_per_block": 8})]


def test_tpu_sweep_runs_under_the_interpreter(tmp_path, on_cpu):
    """The TPU kernel's sweep rows (run by Pallas' TPU interpreter here), checked against the
    reference like every other row."""
    from jax.experimental.pallas import tpu as pltpu
    out = tmp_path / "pa_tpu.json"
    with pltpu.force_tpu_interpret_mode():
        bench.main(["--batch", "2", "--length", "40", "--pages-per-seq", "4", "--page-size", "16",
                    "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32", "--dtype",
                    "bfloat16", "--impls", "tpu", "--pages-per-block", "2", "--iters", "1",
                    "--warmup", "0", "--copy-mib", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["config"] == "tpu ppb=2" and row["ok"] and row["max_abs_error"] < 2e-2


def test_bad_shapes_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--pages-per-seq", "6"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--pages-per-seq", "4", "--page-size", "16", "--length", "100"])


@needs_interpreter
def test_sweep_runs_and_records(tmp_path, capsys):
    """A small sweep of the jnp reader and the Mosaic kernel (run by Mosaic GPU's interpreter
    here: the benchmark's own code path, not the kernel's speed; both rows in one block) against
    the reference."""
    out = tmp_path / "pa.json"
    with mosaic_interpret.interpreting():
        bench.main(["--batch", "2", "--length", "40", "--ragged", "--pages-per-seq", "4",
                    "--page-size", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                    "--dtype", "bfloat16", "--impls", "reference", "mosaic",
                    "--reference-ppb", "1", "3", "--k-splits", "2", "--pages-per-block", "2",
                    "--num-stages", "2", "--rows-per-block", "2", "--iters", "1", "--warmup", "0",
                    "--copy-mib", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["config"] for r in rows] == [
        "reference ppb=1", "reference ppb=3", "mosaic k_splits=2 ppb=2 stages=2 rows=2"]
    for r in rows:
        assert r["ok"] and r["max_abs_error"] < 2e-2 and r["us"] > 0
        assert r["calls_per_sample"] >= 1   # --calls 0: picked per configuration
        assert r["compiled_memory"]["backend"] == jax.default_backend()   # where it ran
        assert r["compiled_memory"]["argument_bytes"] > 0
        assert r["kv_bytes"] == rows[0]["kv_bytes"] > 0
    assert "best configuration" in capsys.readouterr().out


def test_live_fraction_leaves_free_rows_empty():
    """--live-fraction 0.5: half the rows (scattered) have length 0, the others the --length they
    would have had; the bytes the sweep counts come from these lengths."""
    args = bench.parse_args(["--batch", "8", "--length", "64", "--pages-per-seq", "4",
                             "--page-size", "16", "--live-fraction", "0.5", "--head-dim", "8",
                             "--q-heads", "4", "--kv-heads", "2", "--dtype", "float32"])
    lengths = bench.make_case(args, 8)[4].tolist()
    assert sorted(lengths) == [0] * 4 + [64] * 4
    assert lengths != [64] * 4 + [0] * 4  # scattered (a fixed seed), not the last rows
    with pytest.raises(SystemExit):
        bench.parse_args(["--live-fraction", "0"])



@needs_interpreter
def test_fused_sweep_runs_and_records(tmp_path, monkeypatch):
    """--fused: a layer's whole decode step as each decode attention runs it (the Mosaic GPU
    kernels in their interpreter: the fused kernel at two rows a block, and XLA's norms, RoPE and
    scatters before the attention kernel; XLA's step with the jnp reader), timed as chains of
    calls carrying the pools: each row's output matches the reference step's, and the bytes
    leave out the new tokens (read from qkv, not the pages)."""
    from tests.test_paged_decode import allow_mosaic_here
    allow_mosaic_here(monkeypatch)
    out = tmp_path / "pa.json"
    common = ["--batch", "2", "--length", "40", "--pages-per-seq", "4", "--page-size", "32",
              "--q-heads", "4", "--kv-heads", "2", "--head-dim", "128", "--dtype", "bfloat16",
              "--iters", "1", "--warmup", "0", "--copy-mib", "1"]
    with mosaic_interpret.interpreting():
        bench.main(common + ["--fused", "--fused-calls", "1", "--impls", "reference", "mosaic",
                             "--reference-ppb", "2", "--k-splits", "1", "--pages-per-block", "2",
                             "--num-stages", "2", "--rows-per-block", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["config"], r["impl"]) for r in rows] == [
        ("reference ppb=2", "reference"), ("mosaic (unfused step, kernel defaults)", "mosaic"),
        ("mosaic_fused k_splits=1 ppb=2 stages=2 rows=2", "mosaic_fused")]
    for r in rows:
        assert r["fused"] and r["ok"] and r["max_abs_error"] < 2e-2, r
        assert r["calls_per_sample"] == 1
        assert r["kv_bytes"] == 2 * 39 * 2 * 2 * 128 * 2   # rows x old tokens x K/V x heads x D x 2 B
    assert bench.parse_args(common + ["--head-dim", "64"]).head_dim == 64
    with pytest.raises(SystemExit):   # the fused kernel needs head_dim 128 in bf16
        bench.parse_args(common + ["--head-dim", "64", "--fused"])
