"""delta_jax/train/rl_step.py: what prepare_batch derives from (seed, step).

delta.random_lambda draws its lambdas with a key derived from (seed, step): the same step gives
the same draws (a resumed run redoes a step exactly), the next step new ones. Checked on the keys
prepare_batch hands to phases.delta_weights (phases' own tests show equal keys give equal
weights).
"""
import jax
import numpy as np

from delta_jax.train import phases
from delta_jax.train import rl_step as rl_step_lib
from tests.rl_fixtures import build_scored_run, initial_state, tiny_rl_config


def test_random_lambda_draws_follow_the_step(tmp_path, monkeypatch):
    keys = []
    weights = phases.delta_weights

    def recording(*args, key=None, **kwargs):
        keys.append(np.asarray(jax.random.key_data(key)))
        return weights(*args, key=key, **kwargs)

    monkeypatch.setattr(phases, "delta_weights", recording)
    run = build_scored_run(tiny_rl_config("delta", delta=dict(random_lambda=True)), tmp_path)
    try:
        params = initial_state(run).params
        # Three batches (the data iterator moves on): step 1, step 1 again, step 2.
        preps = [rl_step_lib.prepare_batch(run, params, step) for step in (1, 1, 2)]
    finally:
        run.close()
    assert len(keys) == 3
    np.testing.assert_array_equal(keys[0], keys[1])
    assert not np.array_equal(keys[0], keys[2])
    w = np.asarray(jax.device_get(preps[0].batch["token_weights"]))
    valid = np.asarray(jax.device_get(preps[0].batch["response_mask"])) > 0
    assert np.std(w[valid]) > 0.01  # the draws do weight the tokens
