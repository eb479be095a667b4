"""Attention implementations: blockwise (flash-style, custom VJP) and the cuDNN path's packing
against the materialised-scores reference and an independent NumPy attention; peak memory from the
compiled program; the model with attention="blockwise" against attention="xla"."""
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax import models
from delta_jax.models import attention as A
from delta_jax.sampling.programs import abstract_decode_args
from tests.cudnn_stand_in import xla_for_cudnn


def numpy_attention(q, k, v, q_offset, kv_valid, causal=True):
  """Independent reference: loops over batch, heads and queries; float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  out = np.zeros_like(q)
  for b in range(B):
    for n in range(N):
      kv_head = n // (N // K)
      for t in range(T):
        allowed = np.asarray(kv_valid[b], bool).copy()
        if causal:
          allowed &= np.arange(S) <= q_offset + t
        if not allowed.any():
          continue  # a fully masked row gives 0
        s = k[b, allowed, kv_head] @ q[b, t, n] / np.sqrt(D)
        p = np.exp(s - s.max())
        out[b, t, n] = (p / p.sum()) @ v[b, allowed, kv_head]
  return out


def random_qkv(seed, B, T, S, N, K, D, dtype=jnp.float32):
  rng = np.random.RandomState(seed)
  return tuple(jnp.asarray(rng.randn(*shape), dtype)
               for shape in ((B, T, N, D), (B, S, K, D), (B, S, K, D)))


def padded_valid(B, S, left=(), right=(), empty=()):
  """bool [B, S]: row b loses left[b] leading and right[b] trailing slots; `empty` rows lose all."""
  valid = np.ones((B, S), bool)
  for b, n in enumerate(left):
    valid[b, :n] = False
  for b, n in enumerate(right):
    if n:
      valid[b, -n:] = False
  for b in empty:
    valid[b] = False
  return valid


def outputs_and_grads(q, k, v, q_offset, kv_valid, block_q, block_kv):
  """attend() outputs and d/d(q, k, v) of a nonlinear loss, for "xla" and "blockwise", in one
  compiled program (the offset stays a traced scalar, as in the model's cache path)."""
  cot = jnp.asarray(np.random.RandomState(9).randn(*q.shape), q.dtype)

  @jax.jit
  def run(q, k, v, q_offset, kv_valid):
    results = {}
    for impl in ("xla", "blockwise"):
      def loss(q, k, v):
        out = A.attend(q, k, v, q_offset=q_offset, kv_valid=kv_valid, impl=impl,
                       block_q=block_q, block_kv=block_kv)
        return jnp.sum(jnp.tanh(out) * cot), out
      grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
      results[impl] = (out, grads)
    return results

  return run(q, k, v, jnp.int32(q_offset), jnp.asarray(kv_valid))


def assert_blockwise_matches(q, k, v, q_offset, kv_valid, block_q=4, block_kv=5):
  res = outputs_and_grads(q, k, v, q_offset, kv_valid, block_q, block_kv)
  (out_x, g_x), (out_b, g_b) = res["xla"], res["blockwise"]
  np.testing.assert_allclose(out_b, out_x, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out_x, numpy_attention(q, k, v, q_offset, kv_valid),
                             atol=1e-5, rtol=1e-5)
  for name, a, b in zip("qkv", g_x, g_b):
    assert np.isfinite(np.asarray(b)).all(), f"d{name} not finite"
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
  return out_b


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_blockwise_causal_prefill_with_padding(groups):
  """Left padding, right padding, none; T = S = 13 is not a multiple of block_q=4 / block_kv=5."""
  K = 2
  q, k, v = random_qkv(groups, 3, 13, 13, K * groups, K, 8)
  valid = padded_valid(3, 13, left=(0, 4, 0), right=(0, 0, 3))
  out = assert_blockwise_matches(q, k, v, 0, valid)
  # Left-padded queries before the first real token see no key at all: exactly 0.
  assert np.all(np.asarray(out)[1, :4] == 0)


def test_blockwise_decode_and_chunked_prefill_with_cache_offset():
  # Decode: one query at slot 17 of a 23-slot cache, left-padded rows, unwritten slots invalid.
  q, k, v = random_qkv(1, 2, 1, 23, 4, 2, 8)
  valid = padded_valid(2, 23, left=(0, 6))
  valid[:, 18:] = False
  assert_blockwise_matches(q, k, v, 17, valid, block_q=4, block_kv=6)
  # Chunked prefill: 7 queries at slots 10..16 of a 29-slot cache.
  q, k, v = random_qkv(2, 2, 7, 29, 8, 2, 8)
  valid = padded_valid(2, 29, left=(3, 0))
  valid[:, 17:] = False
  assert_blockwise_matches(q, k, v, 10, valid, block_q=3, block_kv=4)


def test_blockwise_fully_masked_rows_are_zero():
  q, k, v = random_qkv(3, 3, 6, 11, 4, 1, 8)
  valid = padded_valid(3, 11, left=(0, 2), empty=(2,))
  out = assert_blockwise_matches(q, k, v, 0, valid, block_q=4, block_kv=4)
  assert np.all(np.asarray(out)[2] == 0)  # a row with no valid key: 0, never NaN
  assert np.all(np.asarray(out)[1, :2] == 0)  # queries before the row's first valid key: 0


def test_blockwise_bfloat16_close_to_float32_reference():
  q, k, v = random_qkv(4, 2, 20, 20, 4, 2, 16, jnp.bfloat16)
  valid = padded_valid(2, 20, left=(5, 0))
  out = A.attend(q, k, v, kv_valid=valid, impl="blockwise", block_q=8, block_kv=8)
  assert out.dtype == jnp.bfloat16
  ref = numpy_attention(q, k, v, 0, valid)
  assert np.abs(np.asarray(out, np.float32) - ref).max() < 2e-2


def test_blockwise_does_not_materialise_the_score_matrix():
  """Compiled forward + backward, inside a differentiated scan over two "layers" with the padding
  mask shared by them (as in the model, where JAX would hoist loop-invariant mask work out of the
  scan): from T = S = 1024 to 2048, XLA's temp buffers for blockwise grow far less than one
  [heads, T, S] float32 score matrix, which the xla path's do.

  The growth, not the size: XLA:GPU adds a fixed workspace to its temporaries (32 MiB for cuBLAS
  GEMMs on Hopper, with --xla_gpu_deterministic_ops as the suite sets there; H200 2026-11-26:
  blockwise 37.2 MiB at 2048 against 6.0 on XLA:CPU), which the difference cancels (there:
  blockwise +1.8 MiB, xla +200)."""
  B, N, K, D = 1, 2, 1, 16

  def temp_bytes(impl, T):
    shapes = (jax.ShapeDtypeStruct((B, T, N * D), jnp.float32),
              jax.ShapeDtypeStruct((2, N * D, (N + 2 * K) * D), jnp.float32),
              jax.ShapeDtypeStruct((B, T), jnp.bool_))

    def loss(x, weights, valid):
      def layer(x, w):
        q, k, v = jnp.split((x @ w).reshape(B, T, N + 2 * K, D), [N, N + K], axis=2)
        out = A.attend(q, k, v, kv_valid=valid, impl=impl, block_q=256, block_kv=256)
        return x + out.reshape(B, T, N * D), None
      return jnp.sum(jax.lax.scan(layer, x, weights)[0] ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  score_bytes = N * 2048 * 2048 * 4
  growth = {impl: temp_bytes(impl, 2048) - temp_bytes(impl, 1024) for impl in ("xla", "blockwise")}
  # The measurement sees the score matrix when it exists (XLA:CPU: +199 MiB, 6x score_bytes).
  assert growth["xla"] >= score_bytes / 2, growth
  assert growth["blockwise"] < score_bytes / 4, growth  # XLA:CPU: +1.9 MiB


def test_packed_causal_path_matches_reference_on_valid_queries(monkeypatch):
  """The cuDNN path's permutation + key lengths, run here through jax's own XLA kernel with the
  same arguments (xla_for_cudnn): exact on valid query slots, 0 on padding; gradients match
  too, and the backward moves the cotangents back by gathers (the inverse permutation), no
  scatter-add."""
  xla_for_cudnn(monkeypatch)
  q, k, v = random_qkv(5, 4, 10, 10, 4, 2, 8)
  valid = padded_valid(4, 10, left=(0, 3, 0), right=(0, 2, 4), empty=(3,))
  valid[0, 5] = False  # a hole in the middle
  valid_j = jnp.asarray(valid)
  mask = np.broadcast_to(valid[:, :, None, None], q.shape)

  def losses(q, k, v):
    packed = A.attend_packed_causal(q, k, v, valid_j)
    ref = A.attend(q, k, v, kv_valid=valid_j, impl="xla")
    return (jnp.sum(jnp.where(mask, jnp.tanh(packed), 0)),
            jnp.sum(jnp.where(mask, jnp.tanh(ref), 0))), (packed, ref)

  @jax.jit
  def run(q, k, v):
    grad = lambda i: jax.grad(lambda *a: losses(*a)[0][i], argnums=(0, 1, 2))(q, k, v)  # noqa
    return losses(q, k, v)[1], grad(0), grad(1)

  (packed, ref), g_packed, g_ref = run(q, k, v)
  np.testing.assert_allclose(np.where(mask, packed, 0), np.where(mask, ref, 0), atol=1e-5)
  assert np.all(np.asarray(packed)[~valid] == 0)
  for a, b in zip(g_packed, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5)
  backward = str(jax.make_jaxpr(
      jax.grad(lambda *a: losses(*a)[0][0], argnums=(0, 1, 2)))(q, k, v))
  assert "gather" in backward and "scatter-add" not in backward


def test_prefix_causal_path_matches_the_reference_at_every_slot(monkeypatch):
  """The cuDNN path for right-padded rows (attend_prefix_causal: key lengths, no permutation),
  run through jax's own XLA kernel with the same arguments (xla_for_cudnn): at every query
  slot, padding included, the independent NumPy attention's result (a slot past a row's length
  attends its valid keys; an empty row gives 0), and without lengths every token's; gradients
  as the reference's. attend(kv_lengths=) with the other implementations: as attend(kv_valid=) with
  the same mask."""
  xla_for_cudnn(monkeypatch)
  B, T, N, K, D = 4, 10, 4, 2, 8
  q, k, v = random_qkv(6, B, T, T, N, K, D)
  lengths = np.array([10, 7, 3, 0], np.int32)
  valid = np.arange(T)[None, :] < lengths[:, None]
  lengths_j, valid_j = jnp.asarray(lengths), jnp.asarray(valid)

  def losses(q, k, v):
    prefix = A.attend_prefix_causal(q, k, v, lengths_j)
    ref = A.attend(q, k, v, kv_valid=valid_j, impl="xla")
    return (jnp.sum(jnp.tanh(prefix)), jnp.sum(jnp.tanh(ref))), (prefix, ref)

  @jax.jit
  def run(q, k, v):
    grad = lambda i: jax.grad(lambda *a: losses(*a)[0][i], argnums=(0, 1, 2))(q, k, v)  # noqa
    return losses(q, k, v)[1], grad(0), grad(1)

  (prefix, ref), g_prefix, g_ref = run(q, k, v)
  np.testing.assert_allclose(prefix, numpy_attention(q, k, v, 0, valid), atol=1e-5)
  assert np.all(np.asarray(prefix)[3] == 0)
  np.testing.assert_allclose(  # no lengths: every token valid
      A.attend_prefix_causal(q, k, v, None),
      numpy_attention(q, k, v, 0, np.ones((B, T), bool)), atol=1e-5)
  for a, b in zip(g_prefix, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5)
  for impl in ("xla", "blockwise"):
    np.testing.assert_array_equal(
        A.attend(q, k, v, kv_lengths=lengths_j, impl=impl, block_q=4, block_kv=3),
        A.attend(q, k, v, kv_valid=valid_j, impl=impl, block_q=4, block_kv=3))
  with pytest.raises(ValueError, match="kv_valid or kv_lengths"):
    A.attend(q, k, v, kv_valid=valid_j, kv_lengths=lengths_j)
  with pytest.raises(ValueError, match=r"kv_lengths must be \[B\]"):
    A.attend(q, k, v, kv_lengths=lengths_j[:2])


def test_backend_checks_follow_the_default_device(monkeypatch):
  """_cuda_backend / _hopper (what picks cuDNN and the Mosaic GPU paged decode kernel) ask
  about the device a computation traced now runs on: JAX's default device where one is set (a
  device or a platform name), so CPU-placed work on a GPU machine gets the CPU's paths; else the
  first device. A stand-in Hopper GPU as the first device here."""
  class Client:
    platform_version = "PJRT C API\ncuda 12080"

  class Hopper:
    platform, client, compute_capability = "gpu", Client(), "9.0"

  devices = jax.devices
  monkeypatch.setattr(jax, "devices",
                      lambda backend=None: [Hopper()] if backend is None else devices(backend))
  assert A._cuda_backend() and A._hopper()
  with jax.default_device(devices("cpu")[0]):
    assert not A._cuda_backend() and not A._hopper()
  with jax.default_device("cpu"):
    assert not A._cuda_backend()
  assert A._cuda_backend()  # the context gone: the first device again
  for other in ("8.0", "10.0", "12.0"):  # A100, B200, RTX 5090: CUDA, not Hopper (no WGMMA)
    Hopper.compute_capability = other
    assert A._cuda_backend() and not A._hopper()
    with pytest.raises(ValueError, match=f"here the device is 'gpu' .compute capability {other}"):
      A.resolve_decode_impl("mosaic")

  # A compile-only client's device (a deviceless compile for a described GPU): its platform
  # version names no CUDA, its device kind the NVIDIA GPU. An AMD GPU is not CUDA.
  class CompileOnly:
    platform_version = "PJRT C API\nNVIDIA H100 80GB HBM3"

  Hopper.client, Hopper.compute_capability = CompileOnly(), "9.0"
  Hopper.device_kind = "NVIDIA H100 80GB HBM3"
  assert A._cuda_backend() and A._hopper()
  CompileOnly.platform_version = "PJRT C API\nrocm 60300"
  Hopper.device_kind = "AMD Instinct MI300X"
  assert not A._cuda_backend() and not A._hopper()


def test_impl_resolution_and_errors():
  on_gpu = A._cuda_backend()
  shape = (1, 4096, 8, 128)
  if not on_gpu:  # CPU (the test machine): cuDNN falls back to the memory-efficient path
    assert A.resolve_impl("cudnn", shape, jnp.bfloat16, kv_len=4096) == "blockwise"
    assert A.resolve_impl("auto", shape, jnp.bfloat16, kv_len=4096) == "blockwise"
  else:  # a CUDA GPU: cuDNN flash for bf16 causal self-attention, asked for or by "auto"
    assert A.resolve_impl("cudnn", shape, jnp.bfloat16, kv_len=4096) == "cudnn"
    assert A.resolve_impl("auto", shape, jnp.bfloat16, kv_len=4096) == "cudnn"
  assert A.resolve_impl("auto", (8, 1, 8, 128), jnp.float32, kv_len=4096) == "xla"  # decode
  assert A.resolve_impl("auto", (8, 256, 8, 128), jnp.float32, kv_len=512) == "xla"
  # A cache offset cannot be expressed by cuDNN's causal mask.
  assert A.resolve_impl("cudnn", shape, jnp.bfloat16, kv_len=4096, q_offset=3) == "blockwise"
  assert A.resolve_impl("xla", shape, jnp.float32, kv_len=4096) == "xla"
  q, k, v = random_qkv(0, 1, 3, 3, 4, 2, 8)
  with pytest.raises(ValueError, match="impl"):
    A.attend(q, k, v, impl="flash")
  with pytest.raises(ValueError, match="kv_valid"):
    A.attend(q, k, v, kv_valid=jnp.ones((1, 4), bool))
  with pytest.raises(ValueError, match="multiple"):
    A.attend(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
  with pytest.raises(ValueError, match="ModelConfig.attention"):
    models.get_preset("tiny", attention="flash")


def test_model_blockwise_matches_xla():
  """Padded forward (logits and hidden states): attention="blockwise" with blocks smaller than
  the sequence (query blocks of 4, key blocks of 3 over 11 tokens) equals attention="xla"."""
  cfg = models.get_preset("tiny", attention="xla")
  model = models.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  block_def = nnx.graphdef(models.Transformer(
      cfg.replace(attention="blockwise", attention_block_q=4, attention_block_kv=3),
      rngs=nnx.Rngs(0)))
  rng = np.random.RandomState(0)
  B, T = 3, 11
  ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (B, T)), jnp.int32)
  mask = padded_valid(B, T, left=(0, 4, 0), right=(0, 0, 2)).astype(np.int32)

  @jax.jit
  def run(state):
    outs = []
    for gd in (graphdef, block_def):
      out = nnx.merge(gd, state)(ids, attention_mask=jnp.asarray(mask))
      outs.append((out.logits, out.hidden))
    return outs

  ref, blockwise = run(state)
  for a, b in zip(ref, blockwise):
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


def test_model_gradients_blockwise_under_remat_match_xla():
  """The custom VJP inside the rematerialised layer scan gives the xla path's gradients."""
  cfg = models.get_preset("tiny", attention="xla")
  state = nnx.state(models.Transformer(cfg, rngs=nnx.Rngs(1)))
  defs = [nnx.graphdef(models.Transformer(c, rngs=nnx.Rngs(1))) for c in (
      cfg, cfg.replace(attention="blockwise", remat="full", attention_block_q=4,
                       attention_block_kv=4))]
  rng = np.random.RandomState(1)
  ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, 10)), jnp.int32)
  mask = jnp.asarray(padded_valid(2, 10, left=(3, 0), right=(0, 2)).astype(np.int32))

  @jax.jit
  def grads(state):
    def loss(state, gd):
      logits = nnx.merge(gd, state)(ids, attention_mask=mask).logits
      return jnp.sum(jnp.where(mask[..., None] > 0, jnp.tanh(logits), 0))
    return [jax.grad(loss)(state, gd) for gd in defs]

  ref, blockwise = grads(state)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(blockwise)):
    scale = float(np.abs(np.asarray(a)).max())
    np.testing.assert_allclose(b, a, atol=1e-5 * scale, rtol=0)


# ---------------------------------------------------------------------------------------------
# Paged decode


def paged_case(seed, B=4, K=2, G=2, D=16, page_size=4, pages_per_seq=8, lengths=(0, 1, 13, 32),
               dtype=jnp.float32, pages_per_block=1):
  """A pool with sequences on scrambled pages, their contiguous [B, S, K, D] view and a query
  per sequence. Table entries past a sequence's pages point at the scratch page 0 (finite
  garbage, masked), except those past the longest sequence's last block of `pages_per_block`
  pages, which point at a NaN page: any read of it would poison the output."""
  rng = np.random.RandomState(seed)
  num_pages = 2 + B * pages_per_seq
  nan_page = num_pages - 1
  k_pages = rng.randn(K, num_pages, page_size, D)
  v_pages = rng.randn(K, num_pages, page_size, D)
  k_pages[:, nan_page] = v_pages[:, nan_page] = np.nan
  tables = (1 + rng.permutation(B * pages_per_seq)).reshape(B, pages_per_seq).astype(np.int32)
  lengths = np.asarray(lengths, np.int32)
  live_pages = -(-int(lengths.max()) // (page_size * pages_per_block)) * pages_per_block
  for b in range(B):
    tables[b, -(-lengths[b] // page_size):] = 0
    tables[b, live_pages:] = nan_page
  S = pages_per_seq * page_size
  gather = lambda x: x[:, tables].reshape(K, B, S, D).transpose(1, 2, 0, 3)  # noqa: E731
  q = jnp.asarray(rng.randn(B, K * G, D), dtype)
  return (q, jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), jnp.asarray(tables),
          jnp.asarray(lengths), gather(k_pages), gather(v_pages))


@pytest.mark.parametrize("groups,pages_per_block,lengths", [
    (1, 1, (0, 1, 13, 32)), (2, 3, (0, 1, 13, 32)), (4, 8, (0, 1, 13, 32)),
    (2, 1, (0, 1, 5, 13)), (1, 3, (2, 1, 5, 11))])
def test_paged_decode_reference_matches_numpy(groups, pages_per_block, lengths):
  """Scrambled pages, lengths 0 / 1 / mid-page / a full table, blocks of 1, 3 (not dividing the
  table) and 8 pages; pages past the longest length's last block hold NaN, so a finite result
  shows they are never read."""
  q, kp, vp, tables, lengths, k, v = paged_case(groups, G=groups, lengths=lengths,
                                                pages_per_block=pages_per_block)
  got = A.paged_decode_reference(q, kp, vp, tables, lengths, pages_per_block=pages_per_block)
  valid = np.arange(k.shape[1])[None, :] < np.asarray(lengths)[:, None]
  want = numpy_attention(np.asarray(q)[:, None], np.nan_to_num(k), np.nan_to_num(v),
                         k.shape[1], valid, causal=False)[:, 0]
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  if lengths[0] == 0:
    assert np.all(np.asarray(got)[0] == 0)  # length 0: exactly 0


def test_paged_decode_names_are_checked():
  q, kp, vp, tables, lengths, _, _ = paged_case(5, G=2, page_size=16, pages_per_seq=4,
                                                lengths=(0, 1, 17, 64))
  assert A.resolve_decode_impl("reference") == "reference"
  for retired in ("flash", "pallas", "pallas_interpret"):  # pallas.ops' Triton kernel: retired
    with pytest.raises(ValueError, match="rollout.decode_attention.*must be one of"):
      A.paged_decode_attention(q, kp, vp, tables, lengths, impl=retired)


@pytest.mark.parametrize("groups,D,page_size,pages_per_block", [
    (1, 16, 4, 1),       # one query head per KV head, one page a block
    (8, 64, 8, 4),       # Qwen3-8B's 8 query heads per KV head
    (2, 128, 16, 2),     # Qwen3-0.6B's heads
])
def test_paged_decode_tpu_kernel_matches_reference(groups, D, page_size, pages_per_block, on_cpu):
  """pallas.ops' TPU paged attention through paged_decode_tpu, run by Pallas' TPU interpreter on
  the CPU, bf16 (the kernel reads K / V as bf16): the reference's numbers within bf16 rounding of
  the probabilities (which the reference rounds to bf16 for p.v and the kernel does not) on
  scrambled pages with lengths 0 / 1 / mid-page / a full table; pages past the longest length's
  last compute block hold NaN (never read); a row of length 0 gives exactly 0; a float32 pool is
  refused. on_cpu: the interpreter runs where the CPU is the default device."""
  from jax.experimental.pallas import tpu as pltpu
  dtype = jnp.bfloat16
  lengths = (0, 1, 2 * page_size + 1, 8 * page_size)
  q, kp, vp, tables, lengths, _, _ = paged_case(13, G=groups, D=D, page_size=page_size,
                                                pages_per_seq=8, lengths=lengths, dtype=dtype,
                                                pages_per_block=pages_per_block)
  with pltpu.force_tpu_interpret_mode():
    got = A.paged_decode_tpu(q, kp, vp, tables, lengths, pages_per_block=pages_per_block)
  ref = A.paged_decode_reference(q, kp, vp, tables, lengths, pages_per_block=pages_per_block)
  assert got.dtype == q.dtype and np.isfinite(np.asarray(got, np.float32)).all()
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=2e-2)
  assert np.all(np.asarray(got)[0] == 0)
  with pytest.raises(ValueError, match="bfloat16; the pools are float32"):
    A.paged_decode_tpu(q, kp.astype(jnp.float32), vp.astype(jnp.float32), tables, lengths)


def test_paged_decode_tpu_compute_block_divides_the_table(monkeypatch):
  """The kernel needs a compute block that divides the table's width: the largest divisor at
  most pages_per_block is passed (the Sampler asks for 256 keys' worth, 10 pages of 24 tokens)."""
  import jax.experimental.pallas.ops.tpu.paged_attention as tpu_ops
  seen = []
  monkeypatch.setattr(tpu_ops, "paged_attention",
                      lambda q, k, v, lengths, tables, *, pages_per_compute_block:
                      seen.append(pages_per_compute_block) or q)
  q, kp, vp, tables, lengths, _, _ = paged_case(3, pages_per_seq=8, dtype=jnp.bfloat16)
  for asked, used in ((10, 8), (3, 2), (8, 8), (1, 1)):
    A.paged_decode_tpu(q, kp, vp, tables, lengths, pages_per_block=asked)
    assert seen.pop() == used, asked


def test_paged_decode_tpu_lowers_for_a_tpu(monkeypatch):
  """One layer's write + attention with rollout.decode_attention="tpu", exported for a TPU from
  abstract shapes at Qwen3-0.6B's decode (bf16, 16 / 8 heads of 128, 32-token pages, a 64-page
  table, batch 64): Pallas lowers the kernel to one Mosaic TPU custom call."""
  from jax import export
  monkeypatch.setattr(A, "_tpu_backend", lambda: True)
  sd = jax.ShapeDtypeStruct
  B, K, G, D, page_size, pages, pages_per_seq = 64, 8, 2, 128, 32, 4096, 64
  bf16, i32 = jnp.bfloat16, jnp.int32
  pool = sd((K, pages, page_size, D), bf16)
  args = (sd((B, K, G + 2, D), bf16), pool, pool, sd((B,), i32), sd((B,), i32),
          sd((B, pages_per_seq), i32), sd((B,), i32))
  fn = jax.jit(lambda *a: A.paged_write_attend(*a, impl="tpu", pages_per_block=8))
  text = export.export(fn, platforms=["tpu"])(*args).mlir_module()
  assert text.count("tpu_custom_call") == 1


@pytest.mark.devices(2)
def test_paged_decode_tpu_lowers_per_shard_of_a_batch_mesh(monkeypatch):
  """On a mesh (the sampler's pool split over "data", as a TPU pod's rollout runs it), the
  layer's write + TPU attention exports for a TPU over two devices, the kernel lowered once,
  inside the per-shard program."""
  from jax import export
  from jax.sharding import Mesh
  from tests.decode_args import abstract_write_attend_args
  monkeypatch.setattr(A, "_tpu_backend", lambda: True)
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  args = abstract_write_attend_args(mesh)
  fn = jax.jit(lambda *a: A.paged_write_attend(*a, impl="tpu", mesh=mesh, batch_axes=("data",)))
  exported = export.export(fn, platforms=["tpu"])(*args)
  assert exported.nr_devices == 2
  assert exported.mlir_module().count("tpu_custom_call") == 1


def test_auto_decode_attention_is_the_reader_without_a_hopper_gpu(monkeypatch):
  """Off CUDA "auto" is the jnp page reader, silently. On a CUDA GPU that is not a Hopper (an
  A100, or a Blackwell: 10.x has no WGMMA) it is the reader too, with a warning that names what
  the Mosaic kernel needs; no deprecated Triton kernel on any GPU."""
  if not A._cuda_backend():
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert A.resolve_decode_impl("auto") == "reference"
  monkeypatch.setattr(A, "_cuda_backend", lambda: True)
  monkeypatch.setattr(A, "_hopper", lambda: False)
  bf16 = dict(dtype=jnp.bfloat16, head_dim=128, page_size=32, group=2)
  for problem in ({}, bf16):
    with pytest.warns(RuntimeWarning, match="jnp page reader.*Hopper GPU"):
      assert A.resolve_decode_impl("auto", **problem) == "reference"
  for name in ("mosaic", "mosaic_fused"):
    with pytest.raises(ValueError, match=f"'{name}' .*Hopper GPUs"):
      A.resolve_decode_impl(name, **bf16)
  with pytest.raises(ValueError, match="'tpu' .*Mosaic TPU kernel"):
    A.resolve_decode_impl("tpu", **bf16)


def test_tpu_decode_attention_is_by_name_on_a_tpu(monkeypatch):
  """On a TPU "auto" stays the jnp page reader (the TPU kernel was never measured against it)
  and "tpu" is taken by name; the Mosaic GPU kernel is refused there."""
  monkeypatch.setattr(A, "_tpu_backend", lambda: True)
  monkeypatch.setattr(A, "_cuda_backend", lambda: False)
  bf16 = dict(dtype=jnp.bfloat16, head_dim=128, page_size=32, group=2)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert A.resolve_decode_impl("auto", **bf16) == "reference"
  assert A.resolve_decode_impl("tpu", **bf16) == "tpu"
  with pytest.raises(ValueError, match="'tpu' .*bfloat16; the model computes in float32"):
    A.resolve_decode_impl("tpu", **{**bf16, "dtype": jnp.float32})
  with pytest.raises(ValueError, match="'mosaic'"):
    A.resolve_decode_impl("mosaic", **bf16)


def test_auto_decode_attention_on_hopper_is_the_mosaic_kernel_where_it_runs(monkeypatch):
  """On a Hopper GPU "auto" is the Mosaic GPU kernel for every problem paged_decode.config_problem
  accepts, and the jnp page reader for the rest (a float32 model, a head_dim that is no multiple
  of 64, 16-token pages with its 2-page blocks) or when the problem is not given."""
  monkeypatch.setattr(A, "_cuda_backend", lambda: True)
  monkeypatch.setattr(A, "_hopper", lambda: True)
  bf16 = dict(dtype=jnp.bfloat16, head_dim=128, page_size=32, group=2)
  assert A.resolve_decode_impl("auto", **bf16) == "mosaic"
  assert A.resolve_decode_impl("auto", **{**bf16, "dtype": jnp.float16, "group": 8}) == "mosaic"
  with pytest.warns(RuntimeWarning, match="jnp page reader"):
    for other in (dict(dtype=jnp.float32), dict(head_dim=96), dict(page_size=16),
                  dict(group=None)):
      assert A.resolve_decode_impl("auto", **{**bf16, **other}) == "reference", other
  assert A.resolve_decode_impl("reference", **bf16) == "reference"  # a name is kept
  assert A.resolve_decode_impl("mosaic", **bf16) == "mosaic"
  assert A.resolve_decode_impl("mosaic_fused", **bf16) == "mosaic_fused"   # by name only


@pytest.mark.gpu
def test_cudnn_attention_matches_reference_with_padding():
  """cuDNN flash attention (bf16, through attend's "auto" choice) on left/right padded rows and
  an all-padding row: outputs on valid queries and d/d(q, k, v) within bf16 rounding of the
  materialised-scores path on the same bf16 inputs."""
  B, T, N, K, D = 4, 128, 8, 2, 64
  q, k, v = random_qkv(8, B, T, T, N, K, D, dtype=jnp.bfloat16)
  valid = padded_valid(B, T, left=(0, 17, 0), right=(0, 5, 60), empty=(3,))
  valid_j = jnp.asarray(valid)
  assert A.resolve_impl("auto", q.shape, q.dtype, kv_len=T) == "cudnn"
  mask = np.broadcast_to(valid[:, :, None, None], q.shape)

  def loss(impl):
    def f(q, k, v):
      out = A.attend(q, k, v, kv_valid=valid_j, impl=impl)
      return jnp.sum(jnp.where(mask, jnp.tanh(out.astype(jnp.float32)), 0)), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

  (_, got), g_got = loss("auto")(q, k, v)
  (_, ref), g_ref = loss("xla")(q, k, v)
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  np.testing.assert_allclose(np.where(mask, f32(got), 0), np.where(mask, f32(ref), 0),
                             atol=2e-2, rtol=2e-2)
  assert np.all(f32(got)[~valid] == 0)
  for a, b in zip(g_got, g_ref):
    scale = np.max(np.abs(f32(b)))
    np.testing.assert_allclose(f32(a), f32(b), atol=2e-2 * scale, rtol=0)


@pytest.mark.gpu
def test_cudnn_attention_with_key_lengths_matches_reference():
  """cuDNN flash attention over right-padded rows given as key lengths (the rollout prefill's
  attend_prefix_causal, through attend's "auto" choice), bf16, one row empty: outputs at every
  query slot within bf16 rounding of the materialised-scores path on the same inputs, the
  empty row exactly 0; the same without a mask."""
  B, T, N, K, D = 4, 128, 8, 2, 64
  q, k, v = random_qkv(9, B, T, T, N, K, D, dtype=jnp.bfloat16)
  lengths = jnp.asarray([128, 77, 5, 0], jnp.int32)
  assert A.resolve_impl("auto", q.shape, q.dtype, kv_len=T) == "cudnn"
  run = jax.jit(lambda q, k, v, lengths, impl: A.attend(q, k, v, kv_lengths=lengths, impl=impl),
                static_argnums=4)
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  got, ref = f32(run(q, k, v, lengths, "auto")), f32(run(q, k, v, lengths, "xla"))
  np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)
  assert np.all(got[3] == 0)
  got, ref = f32(run(q, k, v, None, "auto")), f32(run(q, k, v, None, "xla"))  # no mask
  np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)


def test_paged_decode_bfloat16_and_bad_input():
  q, kp, vp, tables, lengths, k, v = paged_case(6, dtype=jnp.bfloat16)
  kp, vp = jnp.nan_to_num(kp), jnp.nan_to_num(vp)
  out = A.paged_decode_reference(q, kp, vp, tables, lengths)
  assert out.dtype == jnp.bfloat16
  valid = np.arange(k.shape[1])[None, :] < np.asarray(lengths)[:, None]
  ref = numpy_attention(np.asarray(q, np.float32)[:, None], np.nan_to_num(k), np.nan_to_num(v),
                        k.shape[1], valid, causal=False)[:, 0]
  assert np.abs(np.asarray(out, np.float32) - ref).max() < 3e-2
  with pytest.raises(ValueError, match="block_tables"):
    A.paged_decode_reference(q, kp, vp, tables[:2], lengths)
  with pytest.raises(ValueError, match="k_pages"):
    A.paged_decode_reference(q, kp[:, :, :, :8], vp, tables, lengths)


def _op(result: str) -> str:
  """The op name of an HLO instruction's right-hand side ("f32[2]{0} scatter(...)" -> scatter)."""
  match = re.search(r"\s([a-z][\w\-.]*)\(", " " + result)
  return match.group(1) if match else ""


def materialised_results(hlo: str) -> list[str]:
  """Result descriptions of the compiled HLO instructions that get buffers of their own: those
  outside fused computations (whose insides are computed in place), leaving out parameters,
  tuple elements, tuples and bitcasts (no new data). A fusion's description ends with its fused
  computation's root op (" root=<op>")."""
  roots, results, fused, comp = {}, [], False, ""
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      comp = line.split("(")[0].split()[-1].lstrip("%")
      fused = "fused" in comp or "wrapped" in comp
    elif " = " in line:
      result = line.split(" = ", 1)[1]
      if fused:
        if line.lstrip().startswith("ROOT"):
          roots[comp] = _op(result)
      elif _op(result) not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
        results.append(result)
  out = []
  for result in results:
    if _op(result) == "fusion" and "calls=" in result:
      callee = result.split("calls=", 1)[1].split(",")[0].split()[0].strip("%")
      result += f" root={roots.get(callee, '?')}"
    out.append(result)
  return out


def cache_sized(hlo: str, shapes) -> list[str]:
  """Materialised results of one of `shapes` (e.g. "f32[2,41,4,32]") that are not in-place
  updates of the cache (a scatter or dynamic-update-slice, or a fusion rooted in one)."""
  in_place = ("scatter", "dynamic-update-slice")
  bad = []
  for result in materialised_results(hlo):
    if not result.startswith(tuple(shapes)):
      continue
    if _op(result) in in_place + ("while",) or any(f"root={r}" in result for r in in_place):
      continue
    bad.append(result[:200])
  return bad


def test_paged_decode_program_copies_no_cache(on_cpu):
  """The compiled decode program of the rollout engine (the while loop over decode steps, every
  layer writing and reading its own page pool) materialises no copy, transpose, slice or gather
  of a layer's pool (or of anything as large) per step or at entry: the only pool-sized buffers
  are the in-place scatters of the new keys/values. The pool is donated (aliased to the
  output). XLA:CPU's program, on any machine (on_cpu: the HLO parsed here is XLA:CPU's text)."""
  from delta_jax.sampling import programs

  cfg = models.get_preset("tiny")
  K, D, L = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
  S, page_size, pages_per_seq = 3, 4, 16  # 3 slots: no weight has a pool-like shape
  num_pages = 1 + S * pages_per_seq
  pool = f"f32[{K},{num_pages},{page_size},{D}]"
  # What a sequence-major view of the slots' caches would look like (a gather of all pages).
  gathered = (f"f32[{K},{S},{pages_per_seq},{page_size},{D}]",
              f"f32[{K},{S},{pages_per_seq * page_size},{D}]",
              f"f32[{S},{pages_per_seq * page_size},{K},{D}]")

  # The check sees a pool copy where there is one.
  pool_twice = jax.jit(lambda p: jnp.swapaxes(p, 1, 2) * 2).lower(
      jnp.zeros((K, num_pages, page_size, D))).compile().as_text()
  assert cache_sized(pool_twice, [f"f32[{K},{page_size},{num_pages},{D}]"])

  graphdef, state = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
  cache = jax.eval_shape(lambda: models.init_paged_cache(cfg, num_pages, page_size))
  compiled = programs.decode.lower(
      *abstract_decode_args(graphdef, state, cache, S, pages_per_seq), num_steps=8, top_k=-1,
      use_top_p=False, greedy=False, attention_impl="reference", pages_per_block=2).compile()
  hlo = compiled.as_text()
  assert cache_sized(hlo, [pool] + list(gathered)) == []
  # Every layer's K and V pool is aliased input -> output (updated in place, never copied).
  header = next(line for line in hlo.splitlines() if line.startswith("HloModule"))
  assert header.count("-alias)") >= 2 * L, header


@pytest.mark.parametrize("impl", ["reference", "tpu"])
def test_rollout_programs_compiled_for_a_tpu_copy_no_cache(impl, tmp_path):
  """The rollout engine's programs compiled for a TPU (v5p, without one: tests/tpu_compile.py)
  keep every page pool where and as it is: the decode program (rollout.decode_attention
  "reference", auto's pick on a TPU, and "tpu", pallas.ops' kernel), the prefill and the page
  copy materialise no pool-sized buffer but the in-place writes, and decode's pools are aliased
  input -> output. Until 2026-11-28 the TPU compiler laid each pool out with its page axis
  major for the scatter of the new tokens' keys / values ([K, D] windows at (page, offset)):
  every pool was copied into that layout when a call began and back at every step, with either
  attention (10.75 GiB of temporaries for Qwen3-0.6B at 64 slots). attention.write_pages now indexes
  (head, page, offset) and writes rows of D. The "tpu" case compiles under the suite's
  jax_default_matmul_precision=highest, which pallas.ops' kernel refused until paged_decode_tpu
  traced it at the default precision."""
  from tests import tpu_compile

  hlo = tpu_compile.compiled_for_a_tpu(tmp_path, "--impl", impl)
  cfg = tpu_compile.tpu_model()
  pool = (f"bf16[{cfg.num_kv_heads},{1 + tpu_compile.SLOTS * tpu_compile.PAGES_PER_SEQ},"
          f"{tpu_compile.PAGE_SIZE},{cfg.head_dim}]")
  # The check sees the relayout where there is one: the write with [K, D] windows in a loop that
  # also reads the pool; attention.write_pages in the same loop makes none.
  assert cache_sized(hlo["window_write"], [pool])
  assert cache_sized(hlo["write_pages"], [pool]) == []
  assert (tmp_path / "auto.txt").read_text().strip() == "reference"   # auto's pick on a TPU
  for name in ("decode", "prefill", "copy_pages"):
    assert cache_sized(hlo[name], [pool]) == [], name
  header = next(line for line in hlo["decode"].splitlines() if line.startswith("HloModule"))
  assert header.count("-alias)") >= 2 * cfg.num_layers, header
  assert ("tpu_custom_call" in hlo["decode"]) == (impl == "tpu")


@pytest.mark.parametrize("impl", ["reference", "tpu"])
def test_sharded_decode_program_compiled_for_a_tpu_slice_copies_no_cache(impl, tmp_path):
  """The decode program over a mesh of the 4 chips of a v5p slice (data = 4, compiled without
  one: tests/tpu_compile.py), the page pools split over the chips (attention.pool_specs) and
  each chip writing and reading its own pages (shard_map): no pool-sized or shard-pool-sized
  buffer but the in-place writes (21-22 of them per program before write_pages indexed
  (head, page, offset): the same relayout as on one chip, per shard)."""
  from tests import tpu_compile

  hlo = tpu_compile.compiled_for_a_tpu(tmp_path, "--impl", impl, "--sharded")["decode"]
  cfg = tpu_compile.tpu_model()
  local_pages = 1 + tpu_compile.SLOTS_PER_CHIP * tpu_compile.PAGES_PER_SEQ
  pools = [f"bf16[{cfg.num_kv_heads},{n},{tpu_compile.PAGE_SIZE},{cfg.head_dim}]"
           for n in (4 * local_pages, local_pages)]
  assert cache_sized(hlo, pools) == []
  header = next(line for line in hlo.splitlines() if line.startswith("HloModule"))
  assert header.count("-alias)") >= 2 * cfg.num_layers, header


def _decode_hlo(cfg, cache, num_slots, pages_per_seq, *, batch_spec=None, row_sharding=None):
  from delta_jax.sampling import programs

  graphdef, state = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
  return programs.decode.lower(
      *abstract_decode_args(graphdef, state, cache, num_slots, pages_per_seq,
                            row_sharding=row_sharding), num_steps=8, top_k=-1, use_top_p=False,
      greedy=False, attention_impl="reference", pages_per_block=2,
      batch_spec=batch_spec).compile().as_text()


def while_body_results(hlo: str) -> list[str]:
  """materialised_results of the compiled while loops' bodies (what runs at every iteration)."""
  comps, name = {}, None
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      name = line.split("(")[0].split()[-1].lstrip("%")
      comps[name] = [line]
    elif name is not None:
      comps[name].append(line)
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  return [r for body in sorted(bodies) for r in materialised_results("\n".join(comps[body]))]


def test_paged_decode_program_copies_no_layer_weight(on_cpu):
  """The decode program takes each layer's weights as arrays of their own
  (programs.decode_layers, made once per generate()) and makes no buffer of a layer weight's
  size, neither inside its step loop (XLA:GPU copied each matrix sliced there before its gemm, 7
  copies per layer per step, 14% of a decode step at batch 64 on an H100; XLA:CPU does the same,
  which this test sees: compiled for the CPU on any machine, on_cpu) nor once per call before it
  (slicing the stacked weights there cost ~200 copies a call on an H200)."""
  cfg = models.get_preset("tiny")
  S, page_size, pages_per_seq = 3, 4, 16  # 3 slots: no activation has a weight's size
  graphdef, state = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
  layer_weights = [v for path, v in nnx.to_flat_state(state) if "layers" in map(str, path)
                   and v.ndim >= 3]
  assert len(layer_weights) == 7, [w.shape for w in layer_weights]  # q k v o gate up down
  sizes = {math.prod(w.shape[1:]) for w in layer_weights}
  # decode_layers' qkv_proj, q / k / v projections as one array
  sizes.add(cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)

  def weight_sized(results):
    out = []
    for result in results:
      dims = re.match(r"\w+\[([\d,]*)\]", result)
      if dims and dims.group(1) and math.prod(map(int, dims.group(1).split(","))) in sizes:
        out.append(result[:160])
    return out

  # The check sees per-step slices where there are: the same layers, sliced inside a loop.
  def layers_in_loop(w, x):
    def step(i, x):
      for l in range(w.shape[0]):
        x = jnp.tanh(x @ w[l]) @ w[l].T
      return x
    return jax.lax.fori_loop(0, 4, step, x)

  sliced_in_loop = jax.jit(layers_in_loop).lower(
      jnp.zeros((cfg.num_layers, 64, 128)), jnp.zeros((S, 64))).compile().as_text()
  assert weight_sized(while_body_results(sliced_in_loop))
  # ... and copies made once, outside any loop: decode_layers' own program is such copies.
  from delta_jax.sampling import programs
  sliced = programs.decode_layers.lower(graphdef, state).compile().as_text()
  assert len(weight_sized(materialised_results(sliced))) >= 5 * cfg.num_layers  # qkv o gate up down

  cache = jax.eval_shape(lambda: models.init_paged_cache(cfg, 1 + S * pages_per_seq, page_size))
  hlo = _decode_hlo(cfg, cache, S, pages_per_seq)
  assert while_body_results(hlo), "no while loop found in the decode program"
  assert weight_sized(while_body_results(hlo)) == []
  assert weight_sized(materialised_results(hlo)) == []


COLLECTIVES = ("all-gather", "collective-permute", "all-to-all", "all-reduce", "reduce-scatter")


@pytest.mark.devices(8)
def test_sharded_paged_decode_program_keeps_pages_on_their_shard():
  """On an 8-device (data=4, fsdp=2) mesh the rollout engine's page pool is split over the 8
  batch shards (each device holds 1/8 of every layer's pool: its shard's pages), and the compiled
  decode program reads and writes each shard's pages where they are: no all-gather,
  collective-permute or copy of a pool-sized or shard-pool-sized buffer (or of a sequence-major
  gather of the slots' pages), the pools aliased input -> output."""
  from jax.sharding import NamedSharding, PartitionSpec
  from delta_jax import sharding as sharding_lib
  from delta_jax.sampling import Sampler

  cfg = models.get_preset("tiny")
  K, D, L = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
  mesh = jax.make_mesh((4, 2, 1), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  shards, per_shard, page_size, pages_per_seq = 8, 3, 4, 16
  num_slots = shards * per_shard
  local_pages = 1 + per_shard * pages_per_seq   # the shard's scratch page + its slots' pages
  num_pages = shards * local_pages
  sampler = Sampler(models.Transformer(cfg, rngs=nnx.Rngs(0)), max_batch_size=num_slots,
                    mesh=mesh)
  pool_sharding = sampler._pool_sharding()
  cache = models.init_paged_cache(cfg, num_pages, page_size, sharding=pool_sharding)
  for pool in cache.k + cache.v:
    assert pool.sharding.shard_shape(pool.shape) == (K, num_pages // 8, page_size, D)
    assert {s.data.shape for s in pool.addressable_shards} == {(K, local_pages, page_size, D)}
  cache = jax.eval_shape(lambda: cache)
  cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=pool_sharding),
                       cache)
  rows = sharding_lib.batch_sharding((num_slots,), mesh)
  assert rows.spec == PartitionSpec(("data", "fsdp"))
  hlo = _decode_hlo(cfg, cache, num_slots, pages_per_seq, batch_spec=sampler._batch_spec,
                    row_sharding=rows)
  pools = [f"f32[{K},{n},{page_size},{D}]" for n in (num_pages, local_pages)]
  gathered = [f"f32[{K},{s},{pages_per_seq},{page_size},{D}]" for s in (num_slots, per_shard)] \
      + [f"f32[{K},{s},{pages_per_seq * page_size},{D}]" for s in (num_slots, per_shard)] \
      + [f"f32[{s},{pages_per_seq * page_size},{K},{D}]" for s in (num_slots, per_shard)]
  assert cache_sized(hlo, pools + gathered) == []
  # No collective moves pages: none has a result of (or containing) a pool-like shape.
  moved = [r for r in materialised_results(hlo) if _op(r).split(".")[0] in COLLECTIVES
           and (any(p in r for p in pools + gathered) or f",{page_size},{D}]" in r)]
  assert moved == []
  header = next(line for line in hlo.splitlines() if line.startswith("HloModule"))
  assert header.count("-alias)") >= 2 * L, header
  # The check sees a pool all-gather where there is one (a replicated pool read by rows).
  spread = jax.jit(lambda p: p * 2, out_shardings=NamedSharding(mesh, PartitionSpec())).lower(
      jax.ShapeDtypeStruct((K, num_pages, page_size, D), jnp.float32, sharding=pool_sharding)
  ).compile().as_text()
  assert [r for r in materialised_results(spread) if _op(r).split(".")[0] in COLLECTIVES
          and any(p in r for p in pools)]
