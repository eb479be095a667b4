"""models.norm.rms_norm: its values against float64, its gradient against autodiff of the same
formula, and what its backward keeps (the norm's inputs only)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.models.norm import rms_norm

EPS = 1e-6


def formula(x, weight, eps):
  """RMSNorm written out, differentiated by plain autodiff (the model's before 2026-11-28)."""
  xf = x.astype(jnp.float32)
  normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def _inputs(dtype, shape=(3, 5, 64)):
  rng = np.random.RandomState(0)
  x = rng.normal(scale=2.0, size=shape)
  w = 1.0 + 0.3 * rng.normal(size=shape[-1:])
  return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2 ** -8)])
def test_values_match_float64(dtype, tol):
  x, w = _inputs(dtype)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + EPS) * w64
  got = rms_norm(x, w, EPS)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


def test_gradient_equals_autodiff_of_the_formula():
  """The backward recomputes the norm's float32 internals from its inputs: the same operations
  as differentiating the formula, so the same gradients (float32, both inputs)."""
  x, w = _inputs(jnp.float32)
  g = jnp.asarray(np.random.RandomState(1).normal(size=x.shape), jnp.float32)

  def grads(f):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w, EPS) * g), argnums=(0, 1)))(x, w)

  for got, want in zip(grads(rms_norm), grads(formula)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_backward_keeps_only_the_inputs():
  """In bfloat16 the formula's autodiff keeps float32 copies of x (its upcast and the normalised
  value: 4 bytes an element each, 4x the input); rms_norm keeps x and the weight as they are and
  recomputes the rest in the backward."""
  x, w = _inputs(jnp.bfloat16, (4, 16, 256))

  def residuals(f):
    _, pullback = jax.vjp(lambda x, w: f(x, w, EPS), x, w)
    return jax.tree_util.tree_leaves(pullback)

  kept = residuals(rms_norm)
  assert sorted((r.dtype.name, r.shape) for r in kept) == [("bfloat16", (4, 16, 256)),
                                                          ("bfloat16", (256,))]
  autodiff = residuals(formula)  # what the check would see without the recompute
  assert sum(r.nbytes for r in autodiff if r.dtype == jnp.float32 and r.shape == x.shape) \
      == 2 * 4 * x.size
