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


# ----------------------------------------------------------------------------- impl="fused"

def _fused_inputs(vocab=300):
  """Realistically scaled fp32 inputs (logits of order 1) with a vocabulary of several tiles."""
  rng = np.random.RandomState(3)
  hidden = jnp.asarray(rng.randn(B, T, H), jnp.float32)
  weight = jnp.asarray(rng.randn(H, vocab) / np.sqrt(H), jnp.float32)
  labels = jnp.asarray(rng.randint(0, vocab, (B, T)), jnp.int32)
  return hidden, weight, labels


def _objective(impl, labels, temperature, **kw):
  """A scalar touching both outputs with non-uniform weights (so every cotangent differs)."""
  def f(h, w):
    logp, ent = models.token_logprobs(w, h, labels, temperature=temperature, chunk_size=4,
                                      impl=impl, **kw)
    return jnp.sum(logp * jnp.linspace(-1.0, 2.0, T)) + 0.3 * jnp.sum(ent)
  return f


def _assert_rel(got, want, rtol):
  got, want = np.asarray(got), np.asarray(want)
  scale = np.max(np.abs(want))
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_matches_chunked_values_and_gradients(temperature):
  """On CPU impl="fused" is the kernels' vocab-tiled jnp reference with its custom VJP."""
  h, w, y = _fused_inputs()
  for out_f, out_c in zip(
      models.token_logprobs(w, h, y, temperature, chunk_size=4, impl="fused"),
      models.token_logprobs(w, h, y, temperature, chunk_size=4, impl="chunked")):
    assert out_f.shape == (B, T) and out_f.dtype == jnp.float32
    _assert_rel(out_f, out_c, 1e-5)
  got = jax.jit(jax.grad(_objective("fused", y, temperature), argnums=(0, 1)))(h, w)
  want = jax.jit(jax.grad(_objective("chunked", y, temperature), argnums=(0, 1)))(h, w)
  for a, b in zip(got, want):  # d/d hidden, d/d head weight
    _assert_rel(a, b, 1e-5)


def test_fused_traced_temperature():
  """A traced temperature (folded into the hidden states) gives the chunked path's values and
  gradients."""
  h, w, y = _fused_inputs()
  t = jnp.float32(0.8)
  want = jax.grad(_objective("chunked", y, t), argnums=(0, 1))(h, w)
  got = jax.jit(jax.grad(_objective("fused", y, t), argnums=(0, 1)))(h, w)
  for a, b in zip(got, want):
    _assert_rel(a, b, 1e-5)
  logp, ent = jax.jit(lambda h, w, t: models.token_logprobs(w, h, y, t, chunk_size=4,
                                                            impl="fused"))(h, w, t)
  want_logp, want_ent = models.token_logprobs(w, h, y, 0.8, chunk_size=4)
  _assert_rel(logp, want_logp, 1e-5)
  _assert_rel(ent, want_ent, 1e-5)


@pytest.mark.devices(2)
def test_fused_under_a_batch_mesh():
  """Hidden states and labels sharded over the batch axis of a mesh: XLA partitions the fused
  path's scans and custom VJP; values and gradients (the head's summed over shards) equal the
  unsharded chunked path."""
  from jax.sharding import NamedSharding, PartitionSpec

  from delta_jax import sharding as sharding_lib

  mesh = sharding_lib.make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:2])
  h, w, y = _fused_inputs(vocab=200)
  rows = NamedSharding(mesh, PartitionSpec("data"))
  f = _objective("fused", jax.device_put(y, rows), 1.0)
  got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(jax.device_put(h, rows), w)
  want = jax.value_and_grad(_objective("chunked", y, 1.0), argnums=(0, 1))(h, w)
  _assert_rel(got[0], want[0], 1e-5)
  for a, b in zip(got[1], want[1]):
    _assert_rel(a, b, 1e-5)


def test_fused_gradient_never_materialises_the_logits():
  """XLA's buffer assignment for jit(grad) under remat, from a vocabulary of 8192 to 16384 (the
  logits grow by one [N, 8192] fp32 array, 8 MiB): the fused path's temporaries grow by a small
  fraction of that, while the chunked path's with one chunk grow by a large part of it, so the
  measurement does see logits-sized buffers. XLA:CPU: fused +0.25 MiB, chunked +8; XLA:GPU fuses
  part of the softmax: +0.27 and +4.0 on an H200, 2026-11-26.
  The growth, not the size: XLA:GPU's temporaries include a fixed cuBLAS workspace (32 MiB on
  Hopper under the suite's --xla_gpu_deterministic_ops; H200 2026-11-26), which it cancels."""
  n_rows, t_len, hid = 4, 64, 32
  logits_bytes = n_rows * t_len * 8192 * 4   # N * V * 4 bytes = 8 MiB, what V's doubling adds

  def temp_bytes(impl, chunk, vocab):
    h = jax.ShapeDtypeStruct((n_rows, t_len, hid), jnp.float32)
    w = jax.ShapeDtypeStruct((hid, vocab), jnp.float32)
    y = jax.ShapeDtypeStruct((n_rows, t_len), jnp.int32)

    @jax.checkpoint
    def loss(h, w, y):
      logp, ent = models.token_logprobs(w, h, y, chunk_size=chunk, impl=impl)
      return jnp.sum(logp) + jnp.sum(ent)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w, y).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  def growth(impl, chunk):
    return temp_bytes(impl, chunk, 16384) - temp_bytes(impl, chunk, 8192)

  fused = growth("fused", 4)        # vocabulary tile 4 * V / T columns (XLA:CPU: +0.25 MiB)
  whole = growth("chunked", t_len)  # one sequence chunk = all the logits (XLA:CPU: +8 MiB)
  assert whole >= logits_bytes * 3 / 8, (whole, logits_bytes)
  assert fused < logits_bytes / 8, (fused, logits_bytes)


def test_unknown_impl_is_an_error(inputs):
  hidden, weight, labels = inputs
  with pytest.raises(ValueError, match="model.logprob_impl"):
    models.token_logprobs(jnp.asarray(weight), jnp.asarray(hidden), jnp.asarray(labels),
                          impl="flash")


@pytest.mark.parametrize("chunk_size", [1, 4, 11, 64])
def test_map_sequence_chunks_equals_the_unchunked_function(chunk_size):
  # T = 11 is no multiple of 4: the zero-padded tail must be cut off, and every output (a pytree
  # of arrays with trailing axes) must land at its own position.
  rng = np.random.RandomState(1)
  x = jnp.asarray(rng.randn(B, T, 3).astype(np.float32))
  y = jnp.asarray(rng.randint(0, 9, (B, T)))
  seen_lengths = []

  def fn(args):
    a, b = args
    seen_lengths.append(a.shape[1])
    return {"sum": a.sum(-1) + b, "outer": a[..., :, None] * b[..., None, None]}

  got = models.map_sequence_chunks(fn, (x, y), chunk_size)
  np.testing.assert_allclose(got["sum"], x.sum(-1) + y, rtol=1e-6)
  np.testing.assert_allclose(got["outer"], x[..., :, None] * y[..., None, None], rtol=1e-6)
  assert got["outer"].shape == (B, T, 3, 1)
  assert seen_lengths == [min(chunk_size, T)]  # one traced chunk, never the whole sequence


@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_logit_memory_is_a_token_budget_whatever_the_rows(impl):
  """chunk_size is a budget in tokens (rows x positions): from 8 to 64 rows the compiled
  fwd+bwd's temporaries grow by less than a few chunks of [chunk_size, V] fp32 logits (XLA:CPU:
  chunked +1.8 MiB, fused +8.2; a chunk of chunk_size POSITIONS would grow by 56 x 256 x V x 4 B =
  224 MiB). The growth, not the size: XLA:GPU's temporaries include a fixed cuBLAS workspace
  (32 MiB on Hopper under the suite's --xla_gpu_deterministic_ops; H200 2026-11-26: 40 MiB at 8
  rows for either path, 16 and 8 on XLA:CPU), which it cancels (there: chunked +0.9 MiB, fused
  +8.1)."""
  V, H, T, budget = 4096, 16, 256, 256
  w = jnp.zeros((H, V), jnp.float32)
  chunk_bytes = budget * V * 4

  def temp_bytes(rows):
    h = jax.ShapeDtypeStruct((rows, T, H), jnp.float32)
    y = jax.ShapeDtypeStruct((rows, T), jnp.int32)

    def loss(h, w, y):
      logp, ent = models.token_logprobs(w, h, y, chunk_size=budget, impl=impl)
      return jnp.sum(logp) + jnp.sum(ent)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        h, jax.ShapeDtypeStruct(w.shape, w.dtype), y).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(8), temp_bytes(64)
  assert large - small < 4 * chunk_bytes, (small / 2**20, large / 2**20, chunk_bytes / 2**20)
