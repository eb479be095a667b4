"""delta_jax.train.eval_hook.evals_due: which evaluations the training loop runs at each step,
with and without validations of their own (data.val / eval.val_k), against schedules written out
by hand; and config.eval_settings / eval_metric_names for each kind."""
import pytest

from delta_jax.train.config import (EVAL, VAL, EvalSettings, default_config, eval_metric_names, eval_settings,
                                    validation_on)
from delta_jax.train.eval_hook import evals_due


def _cfg(steps=8, every=4, before=True, after=True, val="", val_k=0, eval_files="a.jsonl"):
    c = default_config()
    c.train.steps, c.train.eval_every = steps, every
    c.train.eval_before, c.train.eval_after = before, after
    c.data.eval, c.data.val, c.eval.val_k = eval_files, val, val_k
    return c


def _schedule(cfg):
    return {step: evals_due(cfg, step) for step in range(cfg.train.steps + 1)
            if evals_due(cfg, step)}


def test_without_validations_every_eval_is_data_evals():
    assert _schedule(_cfg()) == {0: (EVAL,), 4: (EVAL,), 8: (EVAL,)}
    assert _schedule(_cfg(before=False, after=False)) == {4: (EVAL,)}  # 8 is the end's
    assert _schedule(_cfg(steps=10, every=4)) == {0: (EVAL,), 4: (EVAL,), 8: (EVAL,),
                                                  10: (EVAL,)}
    assert _schedule(_cfg(every=0)) == {0: (EVAL,), 8: (EVAL,)}


def test_with_validations_the_periodic_ones_are_val_and_the_last_step_has_both():
    assert _schedule(_cfg(val="v.jsonl")) == {0: (EVAL,), 4: (VAL,), 8: (VAL, EVAL)}
    assert _schedule(_cfg(val_k=8, steps=10)) == {0: (EVAL,), 4: (VAL,), 8: (VAL,),
                                                  10: (EVAL,)}
    assert _schedule(_cfg(val="v.jsonl", after=False, before=False)) == {4: (VAL,), 8: (VAL,)}
    # validation alone, without data.eval: no EVAL at the ends
    assert _schedule(_cfg(val="v.jsonl", eval_files="")) == {4: (VAL,), 8: (VAL,)}


def test_eval_settings_and_metric_names_of_each_kind():
    c = _cfg(val="x/aime25.jsonl", val_k=8, eval_files="x/aime24.jsonl,x/hmmt.jsonl")
    c.eval.k, c.eval.pass_k = 16, "1,4,16"
    assert validation_on(c)
    assert eval_settings(c, EVAL) == EvalSettings(EVAL, "x/aime24.jsonl,x/hmmt.jsonl", 16, (1, 4, 16))
    assert eval_settings(c, VAL) == EvalSettings(VAL, "x/aime25.jsonl", 8, (1, 4))  # 16 > 8
    names = eval_metric_names(c)
    assert "eval/benchmarks/hmmt/avg@16" in names and "eval/average/pass@16" in names
    assert "val/benchmarks/aime25/avg@8" in names and "val/average/pass@4" in names
    assert not any(n.startswith("val/") and n.endswith(("@16", "aime24/avg@8")) for n in names)
    c.data.val = ""  # val_k alone: data.eval's benchmarks at val_k
    assert eval_settings(c, VAL).files == c.data.eval and eval_settings(c, VAL).k == 8
    c.eval.val_k = 0
    assert not validation_on(c) and not any(n.startswith("val/") for n in eval_metric_names(c))
    with pytest.raises(ValueError, match="kind"):
        eval_settings(c, "test")
