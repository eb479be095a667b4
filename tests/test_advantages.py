"""Advantage estimators vs hand-computed examples and a NumPy transcription."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from delta_jax.rl.advantages import ADVANTAGE_FNS, compute_advantages, group_stats


def test_hand_examples():
    # One group: rewards 1, 0, 1, 1 -> mean 0.75, ddof=1 std sqrt((3 * 0.25^2 + 0.75^2) / 3) = 0.5.
    r = jnp.array([1.0, 0.0, 1.0, 1.0])
    np.testing.assert_allclose(compute_advantages(r, method="grpo", group_size=4),
                               np.array([0.25, -0.75, 0.25, 0.25]) / (0.5 + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(compute_advantages(r, method="drgrpo", group_size=4),
                               [0.25, -0.75, 0.25, 0.25], rtol=1e-6)
    # Leave-one-out: 1 - (0 + 1 + 1)/3 = 1/3; 0 - (1 + 1 + 1)/3 = -1.
    np.testing.assert_allclose(compute_advantages(r, method="rloo", group_size=4),
                               [1 / 3, -1.0, 1 / 3, 1 / 3], rtol=1e-6)
    # Two groups of two; the second has equal rewards -> 0 for every estimator.
    r = jnp.array([2.0, 0.0, 3.0, 3.0])
    np.testing.assert_allclose(compute_advantages(r, method="grpo", group_size=2),
                               [1 / (np.sqrt(2) + 1e-6), -1 / (np.sqrt(2) + 1e-6), 0, 0], rtol=1e-6)
    np.testing.assert_allclose(compute_advantages(r, method="rloo", group_size=2), [2, -2, 0, 0])
    # Group mean, batch std: two groups of four (means 0.75, 0.25); the batch's eight rewards,
    # half of them 1, have mean 0.5 and ddof=1 std sqrt(8 * 0.25 / 7).
    r = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    centred = np.array([0.25, -0.75, 0.25, 0.25, -0.25, -0.25, -0.25, 0.75])
    np.testing.assert_allclose(compute_advantages(r, method="batch_std", group_size=4),
                               centred / (np.sqrt(2 / 7) + 1e-6), rtol=1e-6)


def _numpy_reference(rewards, ids, method, eps=1e-6):
    out = np.zeros(len(rewards))
    for i, gid in enumerate(ids):
        group = rewards[ids == gid]
        n = len(group)
        if n == 1:
            continue
        if method == "grpo":
            out[i] = (rewards[i] - group.mean()) / (group.std(ddof=1) + eps)
        elif method == "drgrpo":
            out[i] = rewards[i] - group.mean()
        elif method == "batch_std":
            out[i] = (rewards[i] - group.mean()) / (rewards.std(ddof=1) + eps)
        else:
            out[i] = rewards[i] - (group.sum() - rewards[i]) / (n - 1)
    return out


@pytest.mark.parametrize("method", sorted(ADVANTAGE_FNS))
def test_against_numpy_reference(method):
    rng = np.random.default_rng(0)
    n, g = 24, 4
    rewards = rng.normal(size=n).astype(np.float32)
    rewards[4:8] = 1.0  # a zero-variance group
    blocks = np.repeat(np.arange(n // g), g)
    want = _numpy_reference(rewards.astype(np.float64), blocks, method)
    got = jax.jit(lambda r: compute_advantages(r, method=method, group_size=g))(rewards)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[4:8], 0.0)  # equal rewards: no signal


def test_group_stats_singleton_and_bad_input():
    stats = group_stats(jnp.array([1.0, 2.0, 3.0]), group_size=1)
    np.testing.assert_array_equal(stats.std, 0.0)
    np.testing.assert_array_equal(compute_advantages(jnp.array([1.0, 2.0]), group_size=1), 0.0)
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(jnp.ones(6), group_size=4)
    with pytest.raises(ValueError, match="unknown method"):
        compute_advantages(jnp.ones(4), method="ppo", group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(jnp.ones(4), group_size=0)
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(jnp.ones((2, 2)), group_size=2)
