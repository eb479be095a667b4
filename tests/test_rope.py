"""models/rope.py: RoPE in the half-split layout, checked by its defining properties and a
hand-computed case."""
import jax.numpy as jnp
import numpy as np

from delta_jax.models.rope import apply_rope, rope_cos_sin


def test_cos_sin_known_values():
  """head_dim 4, theta 100: frequencies 1 and 1/10, each repeated for the two halves."""
  cos, sin = rope_cos_sin(jnp.asarray([[0, 3]]), 4, 100.0)
  assert cos.shape == sin.shape == (1, 2, 4) and cos.dtype == jnp.float32
  np.testing.assert_allclose(cos[0, 0], [1, 1, 1, 1])
  np.testing.assert_allclose(sin[0, 0], [0, 0, 0, 0])
  np.testing.assert_allclose(cos[0, 1], np.cos([3, 0.3, 3, 0.3]), rtol=1e-6)
  np.testing.assert_allclose(sin[0, 1], np.sin([3, 0.3, 3, 0.3]), rtol=1e-6)


def test_rotation_by_hand_and_its_invariants():
  """Pair (x_i, x_{i + D/2}) turns by angle p * f_i: by hand for D 2; for D 64 the norm of each
  pair is kept, position 0 is the identity, and scores depend on the positions' difference
  only (the point of RoPE)."""
  x = jnp.asarray([[[[1.0, 2.0]]]])                       # [B, T, heads, D]: (x1, x2) = (1, 2)
  cos, sin = rope_cos_sin(jnp.asarray([[1]]), 2, 10.0)    # angle 1
  got = apply_rope(x, cos, sin)[0, 0, 0]
  np.testing.assert_allclose(got, [np.cos(1) - 2 * np.sin(1), 2 * np.cos(1) + np.sin(1)],
                             rtol=1e-6)

  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.standard_normal((1, 1, 3, 64)), jnp.float32) for _ in range(2))

  def at(x, p):
    c, s = rope_cos_sin(jnp.asarray([[p]]), 64, 1e4)
    return apply_rope(x, c, s)

  pairs = lambda x: np.hypot(x[..., :32], x[..., 32:])  # noqa: E731
  np.testing.assert_allclose(pairs(at(q, 37)), pairs(q), rtol=1e-5)
  np.testing.assert_array_equal(at(q, 0), q)
  score = lambda m, n: np.einsum("...d,...d->...", at(q, m), at(k, n))  # noqa: E731
  np.testing.assert_allclose(score(10, 3), score(107, 100), rtol=1e-4, atol=1e-4)
  assert not np.allclose(score(10, 3), score(10, 4), atol=1e-3)


def test_dtype_and_decode_shapes():
  """bf16 in, bf16 out (the rotation in float32); the decode step's [B, heads, D] with cos /
  sin [B, D] rotates each row by its own position."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.bfloat16)
  cos, sin = rope_cos_sin(jnp.asarray([5, 9]), 8, 1e4)
  got = apply_rope(x, cos, sin)
  assert got.dtype == jnp.bfloat16 and got.shape == x.shape
  for b, p in enumerate((5, 9)):
    c, s = rope_cos_sin(jnp.asarray([[p]]), 8, 1e4)
    np.testing.assert_array_equal(got[b], apply_rope(x[b][None, None], c, s)[0, 0])
