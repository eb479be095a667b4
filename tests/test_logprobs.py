"""Chunked token log-probs / entropy vs the full-logits path and a numpy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax import models

B, T, H, V = 2, 11, 16, 50


def _numpy_reference(hidden, weight, labels, temperature):
  z = (hidden.astype(np.float64) @ weight.astype(np.float64)) / temperature
  z = z - z.max(-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
  logp = np.take_along_axis(logp_all, labels[..., None], -1)[..., 0]
  entropy = -(np.exp(logp_all) * logp_all).sum(-1)
  return logp, entropy


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.RandomState(0)
  hidden = rng.randn(B, T, H).astype(np.float32)
  weight = rng.randn(H, V).astype(np.float32)
  labels = rng.randint(0, V, (B, T))
  return hidden, weight, labels


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_matches_reference_and_full_path(inputs, temperature):
  hidden, weight, labels = inputs
  ref_logp, ref_ent = _numpy_reference(hidden, weight, labels, temperature)
  full_logits = jnp.einsum("bth,hv->btv", hidden, weight)
  full_logp, full_ent = models.logprobs_from_logits(full_logits, jnp.asarray(labels), temperature)
  np.testing.assert_allclose(full_logp, ref_logp, atol=1e-4)
  np.testing.assert_allclose(full_ent, ref_ent, atol=1e-4)
  # chunk 4 does not divide T=11 (padding path); chunk > T is one chunk.
  for chunk in (4, 64):
    logp, ent = models.token_logprobs(jnp.asarray(weight), jnp.asarray(hidden),
                                      jnp.asarray(labels), temperature=temperature,
                                      chunk_size=chunk)
    assert logp.shape == (B, T) and logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, full_logp, atol=1e-5)
    np.testing.assert_allclose(ent, full_ent, atol=1e-5)


def test_gradients_match_full_path_under_jit(inputs):
  hidden, weight, labels = inputs
  h, w, y = jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels)

  def chunked(h, w, temp):
    logp, ent = models.token_logprobs(w, h, y, temperature=temp, chunk_size=3)
    return jnp.sum(logp) + 0.1 * jnp.sum(ent)

  def full(h, w, temp):
    logp, ent = models.logprobs_from_logits(jnp.einsum("bth,hv->btv", h, w), y, temp)
    return jnp.sum(logp) + 0.1 * jnp.sum(ent)

  # Temperature is traced (an array), as in a jitted train step.
  got = jax.jit(jax.grad(chunked, argnums=(0, 1)))(h, w, jnp.float32(0.8))
  want = jax.grad(full, argnums=(0, 1))(h, w, jnp.float32(0.8))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_accepts_model_and_matches_model_logits():
  cfg = models.get_preset("tiny", num_layers=1, tie_word_embeddings=True)
  model = models.Transformer(cfg, rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 6)), jnp.int32)
  out = model(ids)
  labels = jnp.roll(ids, -1, axis=1)
  logp, ent = models.token_logprobs(model, out.hidden, labels, chunk_size=4)
  want_logp, want_ent = models.logprobs_from_logits(out.logits, labels)
  np.testing.assert_allclose(logp, want_logp, atol=1e-5)
  np.testing.assert_allclose(ent, want_ent, atol=1e-5)


def test_label_shape_mismatch_is_an_error(inputs):
  hidden, weight, labels = inputs
  with pytest.raises(ValueError, match="labels shape"):
    models.token_logprobs(jnp.asarray(weight), jnp.asarray(hidden), jnp.asarray(labels[:, :-1]))
