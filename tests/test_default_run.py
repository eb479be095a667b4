"""The README's main job (experiments/tiny.py through python -m delta_jax.main), shortened.

One real process with the default config and command-line overrides that shrink it (model, data,
batch, steps): SFT warm start, eval before, DelTA RL, eval after, plots and the printed report.
"""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.rl_fixtures import default_codegen_env

REPO = pathlib.Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

SHORT = {
    "model.hidden_size": 32, "model.intermediate_size": 64, "model.num_layers": 2,
    "model.num_heads": 2, "model.num_kv_heads": 1, "model.head_dim": 16,
    "model.logprob_chunk_tokens": 64,
    "data.synthetic_train": 200, "data.synthetic_test": 8, "data.synthetic_levels": "1",
    "rollout.batch_prompts": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 16,
    "rewards.num_workers": 1, "rewards.overlong_buffer": 4, "rl.mini_batch_prompts": 2,
    "train.steps": 2, "train.save_every": 1, "train.progress_bar": False,
    "train.rollouts_every": 1,
    "sft.steps": 3, "sft.batch_size": 4, "sft.max_len": 64,
    "eval.k": 2, "eval.pass_k": "1,2", "eval.maj_k": "2", "eval.max_new_tokens": 16,
    "eval.limit": 4,
    # A 3-step warm start solves nothing, so every group's rewards agree and the default's dynamic
    # sampling would stop the run after rl.dynamic_sampling_max_rounds rounds (by design); it is
    # tested in test_dynamic_sampling.py and test_phases.py.
    "rl.dynamic_sampling": False,
}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("default_run") / "tiny"
    cmd = [sys.executable, "-m", "delta_jax.main", "--config=experiments/tiny.py",
           f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in SHORT.items()]
    # With XLA's own CPU code generation (not the suite's faster-compiling flags): this one test
    # runs the product end to end as a user's CPU run compiles it (10-20 s more on the 2-core VM).
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=default_codegen_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return workdir, proc.stdout


def test_the_default_command_is_the_tiny_experiment():
    script = (REPO / "scripts" / "run_default.sh").read_text()
    assert "-m delta_jax.main --config=experiments/tiny.py" in script


def test_prints_held_out_accuracy_before_and_after_rl(default_run):
    workdir, stdout = default_run
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    evals = {r["step"]: r["eval/average/avg@2"] for r in rows if "eval/average/avg@2" in r}
    assert sorted(evals) == [0, 2]
    line = next(l for l in stdout.splitlines() if l.startswith("eval accuracy"))
    assert (f"on 4 held-out problems): before RL {100 * evals[0]:.1f}% (step 0) -> after RL "
            f"{100 * evals[2]:.1f}% (step 2)") in line
    passes = next(l for l in stdout.splitlines() if l.startswith("pass@k before -> after RL"))
    for k in (1, 2):
        at = {r["step"]: r[f"eval/average/pass@{k}"] for r in rows
              if f"eval/average/pass@{k}" in r}
        assert f"pass@{k} {100 * at[0]:.1f}% -> {100 * at[2]:.1f}%" in passes
    votes = next(l for l in stdout.splitlines() if l.startswith("maj@k before -> after RL"))
    at = {r["step"]: r["eval/average/maj@2"] for r in rows if "eval/average/maj@2" in r}
    assert sorted(at) == [0, 2] and f"maj@2 {100 * at[0]:.1f}% -> {100 * at[2]:.1f}%" in votes


def test_metrics_plots_and_run_assets(default_run):
    workdir, stdout = default_run
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert any("sft/loss" in r for r in rows)
    rl = [r for r in rows if "policy/loss" in r]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        assert np.isfinite(r["policy/loss"]) and 0 <= r["rollout/accuracy"] <= 1
        assert "delta/weight_mean_pos" in r
    for name in ("training.png", "delta_weights.png"):
        path = workdir / "plots" / name
        assert path.read_bytes().startswith(PNG_MAGIC), name
        assert str(path) in stdout
    # Per-step DelTA weight histograms: one record per RL step, every valid token counted.
    hists = [json.loads(line) for line in open(workdir / "delta_weights.jsonl")]
    assert [h["step"] for h in hists] == [1, 2]
    for h, r in zip(hists, rl):
        counted = sum(sum(h["counts"][s]) for s in ("pos", "neg", "zero"))
        tokens = sum(r[f"delta/tokens_{s}"] for s in ("pos", "neg", "zero"))
        assert counted == tokens
    # The task and tokenizer the project made, saved with the run; the final policy exported.
    assert (workdir / "synthetic" / "train.jsonl").is_file()
    assert (workdir / "tokenizer" / "tokenizer.json").is_file()
    assert (workdir / "final" / "config.json").is_file()
    assert (workdir / "tfds").is_dir()  # the prompts went through the tfds builder


def test_writes_what_the_policy_generated(default_run):
    """The default's train.rollouts_every and eval.save_responses (every step here): each RL
    step's 4 x 4 responses in rollouts/, each eval's 4 x 2 in eval/, with the rewards the
    metrics logged."""
    workdir, _ = default_run
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    reward = {r["step"]: r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r}
    for step in (1, 2):
        got = [json.loads(l) for l in open(workdir / "rollouts" / f"step_{step}.jsonl")]
        assert len(got) == 16 and {r["step"] for r in got} == {step}
        assert np.mean([r["reward"] for r in got]) == pytest.approx(reward[step], abs=1e-6)
    for step in (0, 2):
        got = [json.loads(l) for l in open(workdir / "eval" / f"step_{step}_responses.jsonl")]
        result = json.loads((workdir / "eval" / f"step_{step}.json").read_text())
        assert len(got) == 4 * 2
        assert sum(r["correct"] for r in got) == sum(
            q["num_correct"] for b in result["benchmarks"].values() for q in b["per_question"])
