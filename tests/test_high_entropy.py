"""delta_jax.rl.high_entropy: the high-entropy minority against hand values and numpy."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from delta_jax.rl.high_entropy import high_entropy_mask


def test_a_hand_example():
    # 7 tokens in the mask; the 0.7 quantile of 0.1 0.2 0.5 0.9 1.5 2.0 3.0 (linear) is 1.6
    entropy = jnp.array([[0.1, 0.5, 0.9, 2.0], [1.5, 0.2, 3.0, 9.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 1, 0]])  # the 9.0 is padding: never kept
    keep, threshold = high_entropy_mask(entropy, mask, 0.3)
    assert float(threshold) == pytest.approx(1.6)
    np.testing.assert_array_equal(keep, [[0, 0, 0, 1], [0, 0, 1, 0]])
    keep, _ = high_entropy_mask(entropy, mask, 1.0)  # everything in the mask
    np.testing.assert_array_equal(keep, mask)
    keep, _ = high_entropy_mask(entropy, jnp.zeros_like(mask), 0.2)
    np.testing.assert_array_equal(keep, 0)
    with pytest.raises(ValueError, match="top_frac"):
        high_entropy_mask(entropy, mask, 0.0)


@pytest.mark.parametrize("top_frac", [0.2, 0.5])
def test_against_numpys_quantile_jitted(top_frac):
    rng = np.random.default_rng(0)
    entropy = rng.gamma(2.0, 1.0, size=(16, 40)).astype(np.float32)
    mask = (rng.random((16, 40)) < 0.7).astype(np.float32)
    keep, threshold = jax.jit(lambda e, m: high_entropy_mask(e, m, top_frac))(entropy, mask)
    want_threshold = np.quantile(entropy[mask > 0], 1 - top_frac)
    assert float(threshold) == pytest.approx(want_threshold, rel=1e-5)
    np.testing.assert_array_equal(keep, (mask > 0) & (entropy >= float(threshold)))
    assert abs(float(keep.sum()) / mask.sum() - top_frac) < 0.01
