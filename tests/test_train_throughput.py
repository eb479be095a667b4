"""benchmarks/train_throughput.py at a tiny shape on the CPU: one row per remat x attention x
log-prob combination, cuDNN attention reported as skipped (with why) off a GPU, MFU against both
the data-sheet peak (none on a CPU) and the matmul measured in the same run, the memory
analysis once per remat policy, and a LoRA step."""
import importlib.util
import json

import pytest

from delta_jax import models
from tests.conftest import REPO_ROOT


def _load():
    spec = importlib.util.spec_from_file_location(
        "train_throughput", REPO_ROOT / "benchmarks" / "train_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_rates_follow_the_step_time(row, record, tokens):
    """The module docstring's definitions, from the row's own step time and FLOPs: tokens/s =
    batch x seq / step; achieved TFLOP/s = model FLOPs per step / step / 1e12; MFU matmul =
    achieved / the matmul peak the same run measured (record["peak_matmul_tflops"]); the FLOPs
    the sum of their parts."""
    step_s, parts = row["step_s"], dict(row["flops_by_part"])
    total = parts.pop("total")
    assert total == sum(parts.values()) and set(parts) == {"dense", "lm_head", "attention", "lora"}
    assert row["tokens_per_s"] == pytest.approx(tokens / step_s, rel=1e-12)
    assert row["model_tflops_per_step"] == pytest.approx(total / 1e12, rel=1e-12)
    assert row["achieved_tflops"] == pytest.approx(total / step_s / 1e12, rel=1e-12)
    assert row["mfu_matmul"] == pytest.approx(
        row["achieved_tflops"] / record["peak_matmul_tflops"], rel=1e-12)


@pytest.mark.cpu   # no data-sheet peak, host-only trace, cuDNN "does not apply on cpu"
def test_sweep_rows_skipped_cudnn_and_both_mfu_peaks(tmp_path, capsys, few_executables):
    tt = _load()
    out = tmp_path / "tt.json"
    tt.main(["--preset", "tiny", "--layers", "1", "--seq", "32", "--response-len", "16",
             "--batch", "2", "--micro-batch", "1", "--dtype", "float32", "--iters", "1",
             "--warmup", "0", "--peak-matmul-size", "64", "--logprob-impls", "chunked",
             "--remat", "none", "full", "--attention", "auto", "cudnn",
             "--memory-preset", "tiny", "--memory-seq", "32", "--memory-response-len", "16",
             "--memory-batch", "2", "--memory-micro-batch", "1", "--memory-dtype", "float32",
             "--profile", str(tmp_path / "profile"), "--out", str(out)])
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())

    assert record["peak_sheet_tflops"] is None          # no data-sheet peak for a CPU
    assert record["peak_matmul_tflops"] > 0
    assert record["peak_matmul_calls"] >= 1 and "calls per sample" in record["peak_matmul_source"]
    for part in ("throughput", "memory"):
        rows = record[part]
        assert [(r["remat"], r["attention"], r["logprob"]) for r in rows] == [
            ("none", "auto", "chunked"), ("none", "cudnn", "chunked"),
            ("full", "auto", "chunked"), ("full", "cudnn", "chunked")]
        for row in rows:
            if row["attention"] == "cudnn":   # cuDNN needs an NVIDIA GPU: skipped, not timed
                assert "cudnn" in row["skipped"] and row["attention_run"] == "blockwise"
                assert "step_s" not in row and "peak_estimate_bytes" not in row
            else:                             # auto at 32 tokens: the materialised scores
                assert "skipped" not in row and row["attention_run"] == "xla"
        timed = [r for r in rows if "skipped" not in r]
        if part == "throughput":
            for row in timed:
                assert row["mfu_sheet"] is None and row["mfu_matmul"] > 0
                assert row["tokens_per_s"] > 0 and row["step_s"] > 0
                _assert_rates_follow_the_step_time(row, record, tokens=2 * 32)
                assert row["trainable_params"] == row["params"]   # full fine-tuning
                # --profile: the traced step's events (host ones on a CPU: nothing summed)
                assert row["profile"]["kernels"] and row["profile"]["device_kernel_s"] is None
        else:
            for row in timed:
                assert row["peak_estimate_bytes"] > 0 and row["plan_update_bytes"] > 0
    assert "n/a" in printed                               # the data-sheet MFU column
    assert "device time by kernel, one train step (none, auto, chunked)" in printed
    assert "skipped remat=full attention=cudnn: attention=cudnn does not apply on cpu" in printed


def test_remat_auto_rows_name_the_policy_the_plan_picks(tmp_path, capsys, on_cpu):
    """--remat auto runs what the run config's model.remat=auto would (plan.pick_remat at the
    step's shape): none where --device-memory-gb holds everything (the CPU reports no limit),
    full where nothing fits; the row says which ("auto:<policy>"), its plan that policy's."""
    tt = _load()
    got = {}
    for gb in (1000.0, 0.0):
        out = tmp_path / f"tt_{gb:g}.json"
        tt.main(["--preset", "tiny", "--layers", "1", "--dtype", "float32", "--skip-throughput",
                 "--logprob-impls", "chunked", "--remat", "auto", "--attention", "xla",
                 "--memory-preset", "tiny", "--memory-seq", "32", "--memory-response-len", "16",
                 "--memory-batch", "2", "--memory-micro-batch", "1", "--memory-dtype", "float32",
                 "--device-memory-gb", str(gb), "--out", str(out)])
        (row,) = json.loads(out.read_text())["memory"]
        got[gb] = row
    printed = capsys.readouterr().out
    assert got[1000.0]["remat"] == "auto:none" and got[0.0]["remat"] == "auto:full"
    assert got[1000.0]["plan_update_bytes"] > got[0.0]["plan_update_bytes"]
    assert "remat=auto, attention=xla -> none (planned update: none " in printed
    assert "remat=auto, attention=xla -> full (planned update: none " in printed


def test_lora_rows_train_the_adapters_and_count_their_flops(tmp_path, capsys):
    """--lora-rank: the timed step trains LoRA adapters of every projection (the trainer's
    model.lora_rank defaults) and its FLOPs count the frozen weights and LM head 4x and the
    adapters 6x per token."""
    tt = _load()
    out = tmp_path / "tt.json"
    tt.main(["--preset", "tiny", "--layers", "1", "--seq", "32", "--response-len", "16",
             "--batch", "2", "--micro-batch", "1", "--dtype", "float32", "--iters", "1",
             "--warmup", "0", "--peak-matmul-size", "64", "--logprob-impls", "chunked",
             "--remat", "none", "--attention", "xla", "--lora-rank", "4", "--skip-memory",
             "--out", str(out)])
    record = json.loads(out.read_text())
    (row,) = record["throughput"]
    cfg = tt.model_config("tiny", 1, "float32", "none", "xla", lora_rank=4)
    assert cfg.num_lora_params() > 0
    tokens = 2 * 32
    flops = row["flops_by_part"]
    assert flops["dense"] == 4 * cfg.num_params(include_embeddings=False) * tokens
    assert flops["lora"] == 6 * cfg.num_lora_params() * tokens
    assert flops["lm_head"] == 4 * cfg.hidden_size * cfg.vocab_size * 2 * 16
    assert flops["attention"] == 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 32**2 * 2
    assert row["step_s"] > 0 and row["mfu_matmul"] > 0
    _assert_rates_follow_the_step_time(row, record, tokens=tokens)
    assert cfg.lora_targets == models.LORA_TARGETS and "memory" not in record
    assert row["trainable_params"] == cfg.num_lora_params()   # the adapters alone
    assert "+ LoRA rank 4" in capsys.readouterr().out


def test_compile_for_a_gpu_takes_the_memory_analysis_only(tmp_path, capsys):
    """--compile-for compiles the memory analysis for a GPU this machine lacks (deviceless,
    benchmarks/gpu_program.py); asked for with the timed sweep, or with the memory analysis
    skipped, it is refused before anything runs."""
    tt = _load()
    for extra in ([], ["--skip-throughput", "--skip-memory"]):
        with pytest.raises(SystemExit):
            tt.main(["--compile-for", "h100", "--out", str(tmp_path / "x.json"), *extra])
        assert "--compile-for compiles the memory analysis only" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
