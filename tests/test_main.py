"""End to end on CPU: `python -m delta_jax.main` with a tiny model for grpo / dapo / delta.

One module-scoped set of runs (kept small: a 2-layer width-32 model, 4 prompts x 4 samples,
16 new tokens) serves every test:
  * delta, 6 steps in-process (checkpoint every 3, SFT warm start, eval after);
  * dapo and grpo, 2 steps in-process;
  * delta again as real processes: killed with SIGKILL by the test as soon as the step-3
    checkpoint is on disk, then resumed to step 6; its parameters must equal the uninterrupted
    in-process run's.
"""
import glob
import json
import os
import pathlib
import shutil
import subprocess
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax.rl.delta import delta_coefficients
from delta_jax.train import loop
from delta_jax.train import metrics as metrics_lib
from delta_jax.train import run as run_lib
from delta_jax.train.checkpoint import Checkpointer
from delta_jax.train.config import validate_config
from tests.rl_fixtures import LOOP_WITHOUT_EVAL, TINY_MODEL, StepRecorder, count_calls

REPO = pathlib.Path(__file__).resolve().parents[1]
# experiments/tiny.py (the default job) shrunk: the shared tiny model, 4 prompts x 4 samples,
# 16 new tokens, 2 updates per step, 6 steps checkpointed every 3, a 2-step SFT warm start.
TEST_OVERRIDES = {
    "model": dict(TINY_MODEL, logprob_chunk_tokens=64),
    "data": dict(synthetic_train=200, synthetic_test=8, synthetic_levels="1"),
    "rollout": dict(batch_prompts=4, group_size=4, max_new_tokens=16),
    "rewards": dict(num_workers=1, overlong_buffer=4),
    # dynamic sampling off: a 2-step warm start solves nothing, so it could never fill a batch.
    "rl": dict(mini_batch_prompts=2, dynamic_sampling=False),
    "optim": dict(lr=1e-3),
    "train": dict(steps=6, save_every=3, keep=5, progress_bar=False, **LOOP_WITHOUT_EVAL),
    "sft": dict(steps=2, batch_size=4, max_len=64),
    "eval": dict(k=2, pass_k="1,2", maj_k="2", max_new_tokens=16, limit=2),
}
# A config file (the subprocess runs read it too): self-contained, the overrides as a literal.
TEST_CONFIG = f'''
import importlib.util

def get_config():
    spec = importlib.util.spec_from_file_location("tiny_exp", {str(REPO / "experiments" / "tiny.py")!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    for section, fields in {TEST_OVERRIDES!r}.items():
        for field, value in fields.items():
            c[section][field] = value
    return c
'''


def load_config(path, **overrides):
    import importlib.util
    spec = importlib.util.spec_from_file_location("test_main_cfg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    for dotted, value in overrides.items():
        node, *path = dotted.split("__")
        if path:
            cfg[node][path[0]] = value
        else:
            cfg[node] = value
    return cfg


def run_in_process(config_path, workdir, steps, **overrides):
    """(cfg, final state, run, StepRecorder of every step, program call counts)."""
    cfg = validate_config(load_config(config_path, **overrides))
    run = run_lib.build_run(cfg, str(workdir))
    calls = count_calls(run)
    record = StepRecorder()
    state, run = loop.train(cfg, str(workdir), run=run,
                            step_hooks=(*loop.DEFAULT_STEP_HOOKS, record))
    run.close()
    return cfg, state, run, record, calls


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    config_path = base / "test_config.py"
    config_path.write_text(TEST_CONFIG)
    out = {"config": config_path, "base": base}
    out["delta"] = run_in_process(config_path, base / "delta", 6, method="delta",
                                  train__eval_after=True, train__export_final=True)
    for method in ("dapo", "grpo"):
        out[method] = run_in_process(config_path, base / method, 2, method=method,
                                     train__steps=2, sft__steps=0)
    return out


def test_artifacts(runs):
    for method, steps in (("delta", 6), ("dapo", 2), ("grpo", 2)):
        workdir = runs["base"] / method
        rows = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
        rl_rows = [r for r in rows if "policy/loss" in r]
        assert [r["step"] for r in rl_rows] == list(range(1, steps + 1)), method
        for r in rl_rows:
            for key in ("rollout/reward_mean", "rollout/accuracy", "rollout/response_len_mean",
                        "rollout/response_len_max", "rollout/truncation_rate", "policy/entropy",
                        "policy/clip_frac", "policy/approx_kl", "policy/grad_norm",
                        "optim/learning_rate", "time/rollout_s", "time/reward_s",
                        "time/old_policy_s", "time/delta_s", "time/update_s",
                        "perf/tokens_per_s"):
                assert key in r, (method, key)
            assert np.isfinite(r["policy/loss"]) and r["policy/skipped_updates"] == 0
            # The old-policy pass reproduces the sampler's log-probs (same policy, same T).
            assert r["rollout/sampler_logp_abs_diff_max"] < 1e-3
            assert ("delta/disc_accuracy" in r) == (method == "delta")
            # the allocator's figures where the devices report them (a GPU; not the CPU)
            assert ({k for k in r if k.startswith("memory/")}
                    == set(metrics_lib.device_memory_metrics())), (method, r)
        assert glob.glob(str(workdir / "tensorboard" / "events.out.tfevents.*")), method
        steps_saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                             if p.name.isdigit())
        assert steps_saved == ([0, 3, 6] if method == "delta" else [0, 2]), method
    # SFT metrics and the eval after training were written too; the final policy was exported.
    rows = [json.loads(l) for l in open(runs["base"] / "delta" / "metrics.jsonl")]
    assert any("sft/loss" in r for r in rows)
    assert any(k.startswith("eval/") for r in rows for k in r)
    assert (runs["base"] / "delta" / "final" / "config.json").is_file()


def test_method_settings_reach_the_loss(runs):
    assert runs["grpo"][0].rl.eps_high == 0.2 and runs["grpo"][0].rl.dual_clip == 0.0
    assert runs["dapo"][0].rl.eps_high == 0.28 and runs["dapo"][0].rewards.overlong
    # Without DelTA every valid token has weight 1; with it they vary around mean 1.
    for method in ("dapo", "grpo"):
        b = runs[method][3].batches[2]
        np.testing.assert_array_equal(b["token_weights"], b["response_mask"])
    b = runs["delta"][3].batches[6]
    mask = b["response_mask"] > 0
    assert np.std(b["token_weights"][mask]) > 0
    np.testing.assert_allclose(b["token_weights"][mask].mean(), 1.0, atol=1e-5)


def test_delta_weights_equal_coefficients_of_a_separate_forward_pass(runs):
    cfg, _, run, record, _ = runs["delta"]
    b = record.batches[6]  # trained with the parameters after step 5
    model = nnx.merge(run.graphdef, jax.tree.map(jnp.asarray, record.params_after[5]), run.rest)
    out = model(jnp.asarray(b["input_ids"]), attention_mask=jnp.asarray(b["attention_mask"]))
    R = b["response_mask"].shape[1]
    logits = out.logits[:, -R - 1:-1] / cfg.rollout.temperature
    labels = jnp.asarray(b["input_ids"])[:, -R:]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1)[..., 0]
    hidden = out.hidden[:, -R - 1:-1].astype(jnp.bfloat16)  # the cache keeps h in bf16
    weights, _ = delta_coefficients(hidden, jnp.exp(logp), jnp.asarray(b["advantages"]),
                                    jnp.asarray(b["response_mask"]),
                                    num_refine=cfg.delta.num_refine, lam_min=cfg.delta.lam_min,
                                    lam_max=cfg.delta.lam_max)
    np.testing.assert_allclose(np.asarray(weights), b["token_weights"], atol=2e-3)
    m = b["response_mask"]
    np.testing.assert_allclose(np.asarray(logp) * m, b["old_logp"] * m, atol=1e-4)


def test_delta_adds_no_forward_pass(runs):
    per_step = {}
    for method, steps in (("delta", 6), ("dapo", 2), ("grpo", 2)):
        calls = runs[method][4]
        per_step[method] = {k: v / steps for k, v in calls.items()}
    assert per_step["delta"] == per_step["dapo"] == per_step["grpo"]
    assert per_step["delta"]["old_pass"] == 1  # 16 rows fit one chunk
    assert per_step["delta"]["train_step"] == 2  # 4 prompts in mini-batches of 2
    assert "hidden_pass" not in per_step["delta"]


def test_resume_after_sigkill_is_exact(runs):
    workdir = runs["base"] / "killed"
    cmd = [sys.executable, "-m", "delta_jax.main", f"--config={runs['config']}",
           f"--workdir={workdir}"]
    env = dict(os.environ)
    # A real crash: SIGKILL as soon as checkpoint 3 is complete (Orbax renames a finished
    # checkpoint into checkpoints/3; the next one is due at step 6).
    log_path = runs["base"] / "killed.log"
    with open(log_path, "w") as log:
        first = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        done = workdir / "checkpoints" / "3"
        deadline = time.monotonic() + 900
        while not done.is_dir() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert first.returncode == -9, log_path.read_text()[-3000:]
    ckpt = Checkpointer(str(workdir / "checkpoints"))
    assert ckpt.latest_step() == 3
    ckpt.close()
    second = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    rows = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows if "policy/loss" in r] == [1, 2, 3, 4, 5, 6]

    reference = runs["delta"][1]
    ckpt = Checkpointer(str(workdir / "checkpoints"))
    resumed, _, meta = ckpt.restore(6, reference)
    ckpt.close()
    assert meta["step"] == 6
    diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(reference.params))]
    assert max(diffs) <= 1e-6, max(diffs)
    assert int(resumed.step) == int(reference.step)


def _main(args, **kw):
    return subprocess.run([sys.executable, "-m", "delta_jax.main", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, **kw)


def test_config_errors_are_one_short_message(tmp_path):
    tiny = f"--config={REPO / 'experiments' / 'tiny.py'}"
    bad_file = tmp_path / "bad.py"
    bad_file.write_text("def get_config(:\n")
    cases = [
        ([tiny, "--config.rl.epochz=1"], r"--config\.rl\.epochz: unknown config field"),
        ([tiny, "--config.foo=1"], r"--config\.foo: unknown config field"),
        ([f"--config={bad_file}"], r"SyntaxError: .*bad\.py, line 1"),
        ([f"--config={tmp_path / 'missing.py'}"], r"No such file or directory"),
        ([tiny, "--config.train.log_every=0"], r"train\.log_every: must be >= 1"),
        # what only the model or the device rules out, at start-up before any work: off Hopper
        # the device refuses 'mosaic'; on a Hopper GPU the tiny model's float32 does
        ([tiny, "--config.rollout.decode_attention=mosaic"],
         r"'mosaic' \(rollout\.decode_attention\) (is a Mosaic GPU kernel|cannot run this "
         r"model / rollout\.page_size: q dtype float32)"),
    ]
    import re
    for args, pattern in cases:
        out = _main([*args, f"--workdir={tmp_path / 'w'}"])
        assert out.returncode == 2, (args, out.stderr[-2000:])
        lines = out.stderr.strip().splitlines()
        assert "Traceback" not in out.stderr, (args, out.stderr[-2000:])
        # The error is one line; the later errors follow the start-up log's lines (absl's
        # "I1202 01:58:48.378741 ..." records: the devices, the data's conversion,
        # model.remat=auto's choice).
        errors = [line for line in lines if not re.match(r"[IW]\d{4} \d\d:\d\d:\d\d", line)]
        assert len(errors) == 1 and len(lines) <= 4, (args, lines)
        assert re.search(pattern, errors[0]), (args, lines)


def test_a_bad_input_is_one_line_naming_field_and_file(tmp_path):
    missing = tmp_path / "missing.jsonl"
    out = _main([f"--config={REPO / 'experiments' / 'tiny.py'}", f"--workdir={tmp_path / 'w'}",
                 f"--config.data.train={missing}"])
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: data.train: {missing}: no such file, directory or glob")


def test_a_halted_run_is_one_line_with_exit_1(tmp_path):
    """A run that cannot go on as configured (errors.RunHalted: here tiny.py's dynamic sampling
    with no SFT warm start, whose random-init policy solves nothing, so no group has reward
    signal) prints one error line naming the fields and the checkpoint, not a traceback, and
    exits 1. Started as from a user's shell, without the suite's JAX_PLATFORMS, it logs the
    devices it runs on, and not the backends jax tried and could not start (a TPU's, here)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = _main([f"--config={REPO / 'experiments' / 'tiny.py'}", f"--workdir={tmp_path / 'w'}",
                 "--config.sft.steps=0", "--config.train.eval_before=False",
                 "--config.rl.dynamic_sampling_max_rounds=1", "--config.rollout.batch_prompts=4",
                 "--config.rollout.group_size=2", "--config.rl.mini_batch_prompts=4",
                 "--config.rollout.max_new_tokens=8", "--config.rewards.overlong=False",
                 "--config.train.progress_bar=False"], env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith("error: step 1: dynamic sampling: only 0 of 4 groups"), errors
    assert "rl.dynamic_sampling_on_max_rounds=pad" in errors[0]
    assert "checkpoint 0 saved in" in errors[0]
    import re
    assert re.search(rf"devices: {jax.device_count()} x \S.* \({jax.default_backend()} "
                     r"backend\), 1 process", out.stderr), out.stderr[-3000:]
    assert "Unable to initialize backend" not in out.stderr, out.stderr[-3000:]


def test_a_workdir_whose_checkpoints_do_not_read_back_is_one_error(tmp_path):
    """A run directory whose only checkpoint holds another state (here a one-layer stand-in, as a
    checkpoint of other settings would: another model.lora_rank, say) stops the run with one
    error naming the checkpoint and what to do, exit 1, no traceback; the checkpoint is left as
    it was (not set aside)."""
    import flax.nnx as nnx
    import optax

    from delta_jax.train.checkpoint import Checkpointer
    from delta_jax.train.state import init_train_state, make_optimizer, split_model

    workdir = tmp_path / "w"
    _, params, _ = split_model(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    ckpt = Checkpointer(str(workdir / "checkpoints"))
    ckpt.save(1, init_train_state(params, make_optimizer(optax.constant_schedule(1e-2))),
              {"iter": 1}, {"step": 1}, force=True)
    ckpt.close()
    out = _main([f"--config={REPO / 'experiments' / 'tiny.py'}", f"--workdir={workdir}",
                 "--config.sft.steps=0", "--config.train.progress_bar=False"])
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    text = out.stderr[out.stderr.index("error: "):]
    assert text.startswith(f"error: no checkpoint in {workdir / 'checkpoints'} reads back:"), text
    assert f"{workdir / 'checkpoints' / '1'}: does not read back" in text
    assert "use another --workdir" in text
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]


def test_a_second_process_on_the_same_workdir_is_refused(tmp_path):
    from delta_jax.train.workdir_lock import WorkdirLock

    workdir = tmp_path / "w"
    with WorkdirLock(str(workdir)):  # this process holds it, as a running trainer would
        out = _main([f"--config={REPO / 'experiments' / 'tiny.py'}", f"--workdir={workdir}"])
    assert out.returncode == 1
    assert f"is in use by another run (pid {os.getpid()} on" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_resume_with_a_changed_config_lists_the_changes(tmp_path):
    from delta_jax import main as main_lib
    from delta_jax.train.config import ConfigError

    cfg = load_config(REPO / "experiments" / "tiny.py")
    cfg = validate_config(cfg)
    workdir = tmp_path / "w"
    (workdir / "checkpoints" / "3").mkdir(parents=True)  # a run that has checkpoints
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict()))
    main_lib.check_resume_config(cfg, str(workdir))  # same config: fine
    changed = cfg.copy_and_resolve_references()
    with changed.unlocked():
        changed.optim.lr = 3e-3
        changed.train.steps = 500
    with pytest.raises(ConfigError, match=r"(?s)^train\.allow_config_change: .*optim\.lr: "
                                          r"0\.0001 -> 0\.003"):
        main_lib.check_resume_config(changed, str(workdir))
    with changed.unlocked():
        changed.train.allow_config_change = True
    main_lib.check_resume_config(changed, str(workdir))  # explicitly allowed
    # A warm start stopped before RL checkpoint 0 leaves SFT checkpoints alone: they resume
    # too, so they are checked the same way (sft.lr changed here).
    sft_only_dir = tmp_path / "sft_only"
    (sft_only_dir / "sft_checkpoints" / "5").mkdir(parents=True)
    (sft_only_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    main_lib.check_resume_config(cfg, str(sft_only_dir))
    sft_changed = cfg.copy_and_resolve_references()
    with sft_changed.unlocked():
        sft_changed.sft.lr = 1.0
    with pytest.raises(ConfigError, match=r"(?s)^train\.allow_config_change: .*sft\.lr: "):
        main_lib.check_resume_config(sft_changed, str(sft_only_dir))


def test_a_resume_with_changed_fields_keeps_the_old_config(runs, tmp_path):
    """Resuming with a results-changing field changed (train.allow_config_change): a start that
    fails before its checkpoint reads back (here another model.lora_rank) leaves config.json as
    it was, so a rerun with the old config is not refused; a resume that goes on replaces it once
    the checkpoint has read back, keeping the old one as config.until_step_<N>.json. (Before,
    config.json was replaced at start-up, even by a start that then failed.)"""
    from delta_jax import main as main_lib
    from delta_jax.train.checkpoint import CheckpointError

    workdir = tmp_path / "w"
    shutil.copytree(runs["base"] / "delta", workdir)  # checkpoints 0, 3 and 6 of 6 steps
    cfg = runs["delta"][0]
    main_lib.write_config(cfg, str(workdir))
    before = (workdir / "config.json").read_text()

    def changed(**fields):
        new = cfg.copy_and_resolve_references()
        with new.unlocked():
            new.train.allow_config_change = True
            new.train.eval_after = new.train.export_final = False
            for dotted, value in fields.items():
                section, field = dotted.split("__")
                new[section][field] = value
        return new

    with pytest.raises(CheckpointError, match="does not read back"):
        main_lib.run(changed(model__lora_rank=4), str(workdir))
    assert (workdir / "config.json").read_text() == before
    assert sorted(p.name for p in workdir.glob("config*")) == ["config.json"]
    main_lib.check_resume_config(cfg, str(workdir))  # the old config still resumes

    main_lib.run(changed(optim__lr=2e-3, train__steps=7), str(workdir))
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["optim"]["lr"] == 2e-3 and saved["train"]["steps"] == 7
    assert (workdir / "config.until_step_6.json").read_text() == before
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows if "policy/approx_kl" in r][-2:] == [6, 7]


def test_config_json_is_replaced_whole(tmp_path, monkeypatch):
    """config.json is never seen half-written (the other processes of a multi-host run read it
    while process 0 writes it): a write that fails midway leaves the old file and no temporary."""
    from delta_jax import main as main_lib

    cfg = validate_config(load_config(REPO / "experiments" / "tiny.py"))
    main_lib.write_config(cfg, str(tmp_path))
    old = (tmp_path / "config.json").read_text()
    assert json.loads(old) == cfg.to_dict()

    def replace_fails(src, dst):  # the new config is written, then the swap fails
        assert json.loads(open(src).read()) == cfg.to_dict()
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", replace_fails)
    with pytest.raises(OSError, match="disk full"):
        main_lib.write_config(cfg, str(tmp_path))
    assert (tmp_path / "config.json").read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_a_baseline_with_delta_hyperparameters_warns_at_start(monkeypatch, caplog):
    """main.run of a dapo train run with delta.lam_max changed logs, before anything starts, that
    the field changes nothing it trains (config.unused_delta_fields); the delta run of the same
    config does not. The run is stopped right after (at xla_env's flags) by the test."""
    from delta_jax import main as main_lib
    from delta_jax import xla_env

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    monkeypatch.setattr(xla_env, "apply_default_flags", stop)
    for method, warned in (("dapo", True), ("delta", False)):
        caplog.clear()
        cfg = load_config(REPO / "experiments" / "tiny.py", method=method,
                          delta__lam_max=1.5)
        with caplog.at_level("WARNING", logger="delta_jax"), pytest.raises(Stop):
            main_lib.run(cfg, "/nonexistent-workdir")
        text = caplog.text
        assert ("method='dapo' trains without DelTA weights: delta.lam_max=1.5 change nothing"
                in text) == warned, text
