"""rl/rollout_correction.py: the sampler-vs-trainer importance weights and mismatch metrics.

* Known answers per mode (ratios 1, 1.5, 3, 0.5 and padding, cap 2), the metrics against numpy.
* Properties: equal log-probs give the mask and zero mismatch; the weights carry no gradient;
  extreme log-ratios stay finite; bad input names what is wrong.
* In an RL step (prepare_batch) with the sampler holding other weights than the trainer: the
  batch's token_weights are mask x min(pi_old / pi_rollout, cap), recomputed here from the batch's
  own old_logp and the sampler's log-probs; "none" leaves the mask and still logs the metrics;
  with DelTA ("mis") they are the DelTA weights x the masked ratio.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.rl import rollout_correction
from delta_jax.rl.rollout_correction import MODES, rollout_is_weights
from delta_jax.train import rl_step as rl_step_lib
from delta_jax.train.config import ConfigError
from tests.rl_fixtures import build_scored_run, initial_state, tiny_rl_config

RATIOS = np.asarray([[1.0, 1.5, 3.0, 0.5, 7.0]])
MASK = np.asarray([[1.0, 1.0, 1.0, 1.0, 0.0]], np.float32)  # the last token is padding


def _case():
    rollout = np.asarray([[-1.0, -2.0, -0.5, -3.0, -1.0]], np.float32)
    old = (rollout + np.log(RATIOS)).astype(np.float32)
    return jnp.asarray(old), jnp.asarray(rollout), jnp.asarray(MASK)


@pytest.mark.parametrize("mode,expected", [
    ("none", [1.0, 1.0, 1.0, 1.0, 0.0]),
    ("tis", [1.0, 1.5, 2.0, 0.5, 0.0]),
    ("mis", [1.0, 1.5, 0.0, 0.5, 0.0]),
])
def test_weights_and_metrics_known_answers(mode, expected):
    w, m = rollout_is_weights(*_case(), mode=mode, cap=2.0)
    np.testing.assert_allclose(np.asarray(w)[0], expected, rtol=1e-6, atol=1e-7)
    r, d = RATIOS[0, :4], np.log(RATIOS[0, :4])
    np.testing.assert_allclose(float(m["rollout/is_ratio_mean"]), r.mean(), rtol=1e-6)
    assert float(m["rollout/is_beyond_cap_fraction"]) == pytest.approx(0.25)
    np.testing.assert_allclose(float(m["rollout/mismatch_k3"]), np.mean(r - 1 - d), rtol=1e-5)
    np.testing.assert_allclose(float(m["rollout/sampler_logp_abs_diff_mean"]),
                               np.abs(d).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["rollout/sampler_logp_abs_diff_max"]), math.log(3.0),
                               rtol=1e-5)


def test_agreement_gives_the_mask_and_no_mismatch():
    logp = jnp.asarray(np.random.default_rng(0).normal(-2.0, 1.0, (3, 7)), jnp.float32)
    mask = jnp.asarray(np.random.default_rng(1).uniform(size=(3, 7)) > 0.3, jnp.float32)
    for mode in MODES:
        w, m = rollout_is_weights(logp, logp, mask, mode=mode, cap=1.0)
        np.testing.assert_array_equal(np.asarray(w), np.asarray(mask))
        assert float(m["rollout/mismatch_k3"]) == 0.0
        assert float(m["rollout/is_ratio_mean"]) == pytest.approx(1.0)
        assert float(m["rollout/is_beyond_cap_fraction"]) == 0.0
    # Near agreement (fp32 rounding, what a CPU run sees): the KL estimate is its second-order
    # value mean(d^2 / 2) (r - 1 - d in fp32 cancels to 0 or below there).
    tiny = logp + jnp.asarray(np.random.default_rng(2).normal(0.0, 1e-5, (3, 7)), jnp.float32)
    _, m = rollout_is_weights(tiny, logp, mask, mode="none")
    d = np.asarray(tiny - logp, np.float64)[np.asarray(mask) > 0]
    np.testing.assert_allclose(float(m["rollout/mismatch_k3"]), np.mean(d * d / 2), rtol=0.05)


def test_weights_are_constants_of_the_loss():
    old, rollout, mask = _case()
    for mode in ("tis", "mis"):
        g = jax.grad(lambda o: jnp.sum(rollout_is_weights(o, rollout, mask, mode=mode)[0]))(old)
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_extreme_log_ratios_stay_finite():
    old = jnp.asarray([[0.0, -200.0, 0.0]])
    rollout = jnp.asarray([[-200.0, 0.0, 0.0]])
    mask = jnp.ones((1, 3))
    tis, m = rollout_is_weights(old, rollout, mask, mode="tis", cap=2.0)
    mis, _ = rollout_is_weights(old, rollout, mask, mode="mis", cap=2.0)
    assert np.all(np.isfinite(np.asarray(tis))) and np.all(np.isfinite(np.asarray(mis)))
    assert np.asarray(tis)[0, 0] == 2.0 and np.asarray(mis)[0, 0] == 0.0
    assert np.asarray(tis)[0, 1] < 1e-8  # the trainer finds it e^-200 less likely: clamped e^-20
    assert all(np.isfinite(float(v)) for v in m.values())
    assert float(m["rollout/sampler_logp_abs_diff_max"]) == 200.0  # reported unclamped


def test_bad_input_names_the_problem():
    old, rollout, mask = _case()
    with pytest.raises(ValueError, match="mode must be one of"):
        rollout_is_weights(old, rollout, mask, mode="clip")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        rollout_is_weights(old, rollout, mask, mode="tis", cap=0.5)
    with pytest.raises(ValueError, match="one shape"):
        rollout_is_weights(old, rollout[:, :3], mask, mode="tis")
    with pytest.raises(ConfigError, match="rl.rollout_is_cap"):
        tiny_rl_config("dapo", rl=dict(rollout_is_cap=0.9))
    with pytest.raises(ConfigError, match="rl.rollout_is"):
        tiny_rl_config("dapo", rl=dict(rollout_is="sequence"))


def _prepared(tmp_path, mode, method="dapo"):
    """prepare_batch of a tiny run whose sampler keeps the initial weights while the trainer's
    are perturbed (a stale or numerically different sampler)."""
    run = build_scored_run(tiny_rl_config(method, rl=dict(rollout_is=mode, rollout_is_cap=1.2)),
                           tmp_path / f"{method}_{mode}")
    try:
        params = initial_state(run).params
        run.sampler.update_params(run.model(params))
        run.sampler.update_params = lambda *_: None  # the sampler keeps the initial weights
        keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(params))))
        trainer = jax.tree.map(
            lambda x: x + 1.0 * jnp.std(x) * jax.random.normal(next(keys), x.shape, x.dtype),
            params)
        prep = rl_step_lib.prepare_batch(run, trainer, 1)
        return {k: np.asarray(jax.device_get(v)) for k, v in prep.batch.items()}, prep
    finally:
        run.close()


def test_prepare_batch_weights_tokens_by_the_truncated_ratio(tmp_path):
    batch, prep = _prepared(tmp_path, "tis")
    mask, old = batch["response_mask"], batch["old_logp"]
    ratio = np.exp(old - prep.packed.sampler_logp)
    expected = mask * np.minimum(ratio, 1.2)
    np.testing.assert_allclose(batch["token_weights"], expected, rtol=1e-5, atol=1e-6)
    valid = mask > 0
    # The perturbation makes the correction do something in both directions.
    assert np.mean(ratio[valid] > 1.2) > 0.05 and np.mean(ratio[valid] < 0.9) > 0.05
    assert prep.metrics["rollout/is_beyond_cap_fraction"] == pytest.approx(
        np.mean(ratio[valid] > 1.2), abs=1e-6)
    assert prep.metrics["rollout/mismatch_k3"] == pytest.approx(_k3(old, prep), rel=1e-4)
    assert _k3(old, prep) > 1e-3

    plain, plain_prep = _prepared(tmp_path, "none")
    np.testing.assert_array_equal(plain["token_weights"], plain["response_mask"])
    # logged whatever the mode
    assert plain_prep.metrics["rollout/mismatch_k3"] == pytest.approx(
        _k3(plain["old_logp"], plain_prep), rel=1e-4)


def _k3(old_logp, prep):
    """The batch's mean k3 (r - 1 - log r, r = pi_old / pi_sampler) over its response tokens, in
    float64 from the two log-probs (the clamp the correction applies to log r included)."""
    mask = prep.batch["response_mask"] > 0
    d = np.clip(np.asarray(old_logp, np.float64) - np.asarray(prep.packed.sampler_logp, np.float64),
                -rollout_correction._LOG_RATIO_CLAMP, rollout_correction._LOG_RATIO_CLAMP)
    return float(np.mean((np.expm1(d) - d)[np.asarray(mask)]))


def test_with_delta_the_importance_and_delta_weights_multiply(tmp_path):
    batch, prep = _prepared(tmp_path, "mis", method="delta")
    ratio = np.exp(batch["old_logp"] - prep.packed.sampler_logp)
    delta = np.asarray(jax.device_get(prep.delta_weights))
    expected = delta * np.where(ratio > 1.2, 0.0, ratio) * batch["response_mask"]
    np.testing.assert_allclose(batch["token_weights"], expected, rtol=1e-5, atol=1e-6)
    valid = batch["response_mask"] > 0
    assert np.std(delta[valid]) > 0.01 and np.mean(ratio[valid] > 1.2) > 0.05  # both act
