"""delta_jax.train.loop on the tiny RL config in-process: a resumed run writes every step once,
resumes past an unreadable newest checkpoint, and eval mode reports without touching training's
eval files."""
import json
import logging
import os
import shutil
import signal
import time

import numpy as np
import pytest

from delta_jax.train import loop
from delta_jax.train import rl_step as rl_step_lib
from delta_jax.train.preemption import TrainingInterrupted
from delta_jax.train.config import validate_config
from tests.rl_fixtures import LOOP_WITHOUT_EVAL, build_scored_run, tiny_rl_config


def _config(steps, **train):
    return tiny_rl_config("dapo", train=dict(LOOP_WITHOUT_EVAL, steps=steps, keep=10, **train))


def _train(cfg, workdir):
    run = build_scored_run(cfg, workdir)
    try:
        state, run = loop.train(cfg, str(workdir), run=run)
    finally:
        run.close()
    return state


def _rl_steps(workdir):
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    return [r["step"] for r in rows if "policy/loss" in r]


def test_resume_writes_each_step_once_after_a_crash_past_the_last_checkpoint(tmp_path):
    """A crash after steps 3 and 4 were logged but before checkpoint 4 (simulated by removing
    it): the resumed run redoes steps 3 and 4 and metrics.jsonl holds each step once."""
    _train(_config(4, save_every=2), tmp_path)
    assert _rl_steps(tmp_path) == [1, 2, 3, 4]
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    _train(_config(5, save_every=2), tmp_path)
    assert _rl_steps(tmp_path) == [1, 2, 3, 4, 5]


def test_a_stop_before_the_updates_abandons_the_step_and_the_resume_redoes_it(tmp_path,
                                                                             monkeypatch):
    """SIGTERM while step 2's batch is being prepared (before any of its updates): train() saves
    checkpoint 1 with the data position from before step 2 and raises TrainingInterrupted; the
    same run resumed redoes step 2 on the same prompts and ends with the parameters of an
    uninterrupted run (a wrong data position or a half-applied step 2 would not)."""
    import jax

    ref = jax.device_get(_train(_config(3, save_every=10), tmp_path / "ref").params)
    prepare = rl_step_lib.prepare_batch

    def prepare_then_signal(run, params, step):
        out = prepare(run, params, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs at the next bytecode boundary
        return out

    monkeypatch.setattr(rl_step_lib, "prepare_batch", prepare_then_signal)
    with pytest.raises(TrainingInterrupted) as stopped:
        _train(_config(3, save_every=10), tmp_path / "cut")
    assert stopped.value.step == 1 and stopped.value.signum == signal.SIGTERM
    assert _rl_steps(tmp_path / "cut") == [1]  # step 2 wrote nothing
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["0", "1"]
    monkeypatch.undo()
    resumed = jax.device_get(_train(_config(3, save_every=10), tmp_path / "cut").params)
    assert _rl_steps(tmp_path / "cut") == [1, 2, 3]
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), ref, resumed))
    assert max(moved) <= 1e-6, max(moved)


def test_resume_from_the_older_checkpoint_when_the_newest_is_corrupt(tmp_path, caplog):
    _train(_config(2, save_every=1), tmp_path)
    state_dir = tmp_path / "checkpoints" / "2" / "state"
    biggest = max((p for p in state_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:biggest.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="delta_jax.train"):
        _train(_config(3, save_every=1), tmp_path)
    assert "skipping checkpoint 2" in caplog.text and "resuming from checkpoint 1" in caplog.text
    assert _rl_steps(tmp_path) == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "unreadable-2").is_dir()


def test_eval_mode_prints_and_keeps_trainings_eval_files(tmp_path, capsys):
    cfg = tiny_rl_config("dapo", train=dict(steps=1, eval_before=False, eval_after=True,
                                            export_final=False),
                         data=dict(eval="synthetic"), eval=dict(k=2, pass_k="1,2", limit=2,
                                                                max_new_tokens=8),
                         rewards=dict(num_workers=1))
    _train(cfg, tmp_path)
    trained = (tmp_path / "eval" / "step_1.json").read_bytes()
    rows_before = (tmp_path / "metrics.jsonl").read_bytes()
    eval_cfg = cfg.copy_and_resolve_references()
    with eval_cfg.unlocked():
        eval_cfg.mode = "eval"
    metrics = loop.eval_only(validate_config(eval_cfg), str(tmp_path))
    out = capsys.readouterr().out
    assert "eval of checkpoint 1 of" in out and "synthetic_test" in out
    assert (tmp_path / "eval" / "step_1.json").read_bytes() == trained
    assert json.loads((tmp_path / "eval" / "standalone_step_1.json").read_text())
    assert (tmp_path / "metrics.jsonl").read_bytes() == rows_before
    assert metrics and all(np.isfinite(v) for v in metrics.values())
    # A workdir without a checkpoint: the configured model itself (here a random init).
    fresh = tmp_path / "fresh"
    loop.eval_only(validate_config(eval_cfg), str(fresh))
    assert "eval of random init (tiny)" in capsys.readouterr().out
    assert json.loads((fresh / "eval" / "standalone_step_0.json").read_text())


def test_sft_mode_trains_the_warm_start_and_exports_it(tmp_path):
    """Mode sft: sft.steps steps of the warm start alone (a metrics row every 10 steps and at
    the last; no RL), exported as a Hugging Face directory (workdir/sft) that loads back to the
    returned parameters."""
    import jax
    from flax import nnx

    from delta_jax import models

    cfg = tiny_rl_config("dapo", sft=dict(steps=12, batch_size=4, max_len=32, warmup_steps=0))
    with cfg.unlocked():
        cfg.mode = "sft"
    params = jax.device_get(loop.sft_only(validate_config(cfg), str(tmp_path)))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "sft/loss" in r] == [10, 12]
    assert not any("policy/loss" in r for r in rows)
    exported = tmp_path / "sft"
    assert (exported / "config.json").is_file() and (exported / "tokenizer.json").is_file()
    loaded = nnx.state(models.from_pretrained(str(exported)), nnx.Param)
    got, want = jax.tree.leaves(loaded), jax.tree.leaves(params)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
