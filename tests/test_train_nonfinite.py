"""The non-finite stop path of the RL loop: rl.max_nonfinite consecutive steps with skipped
(non-finite) updates -> a checkpoint of the unchanged state + a clear NonFiniteError; the run then
resumes from that checkpoint.

A NaN is injected into the loss by wrapping the run's jitted train step so that every mini-batch
carries NaN advantages (the real step then reports skipped = 1 and leaves the state unchanged).
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.train import loop
from delta_jax.train import run as run_lib
from delta_jax.train.checkpoint import Checkpointer
from tests.rl_fixtures import LOOP_WITHOUT_EVAL, build_scored_run, tiny_rl_config


def make_config():
    return tiny_rl_config(
        "dapo",
        model=dict(num_layers=1),
        rl=dict(max_nonfinite=1),        # stop at the 2nd consecutive step with skipped updates
        train=dict(steps=4, save_every=1, keep=5, **LOOP_WITHOUT_EVAL))


def _leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_nonfinite_stop_checkpoints_and_resumes(tmp_path):
    cfg = make_config()
    run = build_scored_run(cfg, tmp_path)
    good_step = run.train_step

    def nan_step(state, batch):  # the same compiled step, fed a NaN advantage
        return good_step(state, dict(batch, advantages=batch["advantages"] * jnp.nan))

    try:
        run.train_step = nan_step
        with pytest.raises(loop.NonFiniteError, match=r"step 2: 2 consecutive .*"
                                                      r"rl.max_nonfinite=1"):
            loop.train(cfg, str(tmp_path), run=run)
        rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        rl_rows = [r for r in rows if "policy/loss" in r]
        assert [r["step"] for r in rl_rows] == [1, 2]
        assert [r["policy/skipped_updates"] for r in rl_rows] == [1.0, 1.0]
        assert [r["policy/nonfinite_streak"] for r in rl_rows] == [1.0, 2.0]
        assert rl_rows[0]["policy/loss"] == "nan"  # metrics.jsonl writes NaN as a string

        # The last checkpoint (step 2) is usable: it holds the untouched initial state.
        ckpt = Checkpointer(str(tmp_path / "checkpoints"))
        assert ckpt.latest_step() == 2 and ckpt.all_steps() == [0, 1, 2]
        template = run_lib.abstract_state(run)  # (the run handed its initial arrays over)
        first, _, _ = ckpt.restore(0, template)
        last, _, meta = ckpt.restore(2, template)
        ckpt.close()
        assert meta["step"] == 2 and meta["nonfinite_streak"] == 2
        assert int(last.step) == 0
        assert _leaves_equal(last, first)
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(last.params))

        # Resume with a healthy step: training continues from step 3 and really updates.
        run.train_step = good_step
        state, run = loop.train(cfg, str(tmp_path), run=run)
        rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        rl_rows = [r for r in rows if "policy/loss" in r]
        assert [r["step"] for r in rl_rows] == [1, 2, 3, 4]
        for r in rl_rows[2:]:
            assert r["policy/skipped_updates"] == 0.0 and r["policy/nonfinite_streak"] == 0.0
            assert isinstance(r["policy/loss"], float) and np.isfinite(r["policy/loss"])
        assert int(state.step) == 2
        assert not _leaves_equal(state.params, first.params)
    finally:
        run.close()
