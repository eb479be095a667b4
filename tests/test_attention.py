"""Attention implementations: blockwise (flash-style, custom VJP) and the cuDNN path's packing
against the materialised-scores reference and an independent NumPy attention; peak memory from the
compiled program; the model with attention="blockwise" against attention="xla"."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax import models
from delta_jax.models import attention as A


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


def outputs_and_grads(q, k, v, q_offset, kv_valid, causal, block_q, block_kv):
  """attend() outputs and d/d(q, k, v) of a nonlinear loss, for "xla" and "blockwise", in one
  compiled program (the offset stays a traced scalar, as in the model's cache path)."""
  cot = jnp.asarray(np.random.RandomState(9).randn(*q.shape), q.dtype)

  @jax.jit
  def run(q, k, v, q_offset, kv_valid):
    results = {}
    for impl in ("xla", "blockwise"):
      def loss(q, k, v):
        out = A.attend(q, k, v, q_offset=q_offset, kv_valid=kv_valid, causal=causal, impl=impl,
                       block_q=block_q, block_kv=block_kv)
        return jnp.sum(jnp.tanh(out) * cot), out
      grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
      results[impl] = (out, grads)
    return results

  return run(q, k, v, jnp.int32(q_offset), jnp.asarray(kv_valid))


def assert_blockwise_matches(q, k, v, q_offset, kv_valid, causal=True, block_q=4, block_kv=5):
  res = outputs_and_grads(q, k, v, q_offset, kv_valid, causal, block_q, block_kv)
  (out_x, g_x), (out_b, g_b) = res["xla"], res["blockwise"]
  np.testing.assert_allclose(out_b, out_x, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out_x, numpy_attention(q, k, v, q_offset, kv_valid, causal),
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


def test_blockwise_fully_masked_rows_and_non_causal():
  q, k, v = random_qkv(3, 3, 6, 11, 4, 1, 8)
  valid = padded_valid(3, 11, left=(0, 2), empty=(2,))
  out = assert_blockwise_matches(q, k, v, 0, valid, causal=False, block_q=4, block_kv=4)
  assert np.all(np.asarray(out)[2] == 0)  # a row with no valid key: 0, never NaN


def test_blockwise_bfloat16_close_to_float32_reference():
  q, k, v = random_qkv(4, 2, 20, 20, 4, 2, 16, jnp.bfloat16)
  valid = padded_valid(2, 20, left=(5, 0))
  out = A.attend(q, k, v, kv_valid=valid, impl="blockwise", block_q=8, block_kv=8)
  assert out.dtype == jnp.bfloat16
  ref = numpy_attention(q, k, v, 0, valid)
  assert np.abs(np.asarray(out, np.float32) - ref).max() < 2e-2


def test_blockwise_does_not_materialise_the_score_matrix():
  """Compiled forward + backward at T = S = 2048, inside a differentiated scan over two "layers"
  with the padding mask shared by them (as in the model, where JAX would hoist loop-invariant
  mask work out of the scan): XLA's temp buffers for blockwise stay far below one [heads, T, S]
  float32 score matrix, which the xla path does need."""
  B, T, N, K, D = 1, 2048, 2, 1, 16
  shapes = (jax.ShapeDtypeStruct((B, T, N * D), jnp.float32),
            jax.ShapeDtypeStruct((2, N * D, (N + 2 * K) * D), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.bool_))
  score_bytes = N * T * T * 4

  def temp_bytes(impl):
    def loss(x, weights, valid):
      def layer(x, w):
        q, k, v = jnp.split((x @ w).reshape(B, T, N + 2 * K, D), [N, N + K], axis=2)
        out = A.attend(q, k, v, kv_valid=valid, impl=impl, block_q=256, block_kv=256)
        return x + out.reshape(B, T, N * D), None
      return jnp.sum(jax.lax.scan(layer, x, weights)[0] ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes("xla") >= score_bytes  # the measurement sees the score matrix when it exists
  assert temp_bytes("blockwise") < score_bytes / 4


def test_packed_causal_path_matches_reference_on_valid_queries():
  """The cuDNN path's permutation + key lengths, run here through jax's own XLA kernel with the
  same arguments: exact on valid query slots, 0 on padding; gradients match too."""
  q, k, v = random_qkv(5, 4, 10, 10, 4, 2, 8)
  valid = padded_valid(4, 10, left=(0, 3, 0), right=(0, 2, 4), empty=(3,))
  valid[0, 5] = False  # a hole in the middle
  valid_j = jnp.asarray(valid)
  mask = np.broadcast_to(valid[:, :, None, None], q.shape)

  def losses(q, k, v):
    packed = A.attend_packed_causal(q, k, v, valid_j, implementation="xla")
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


def test_impl_resolution_and_errors():
  on_gpu = A._cuda_backend()
  shape = (1, 4096, 8, 128)
  if not on_gpu:  # CPU (the test machine): cuDNN falls back to the memory-efficient path
    assert A.resolve_impl("cudnn", shape, jnp.bfloat16, kv_len=4096) == "blockwise"
    assert A.resolve_impl("auto", shape, jnp.bfloat16, kv_len=4096) == "blockwise"
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
  """Padded forward (logits) and a cache prefill + decode step: attention="blockwise" with
  blocks smaller than the sequence equals attention="xla". The 11-token prefill and the decode
  step run the live-prefix path with key blocks of 3 over a 16-slot cache; "xla" attends the
  whole cache."""
  cfg = models.get_preset("tiny", attention="xla")
  model = models.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  block_def = nnx.graphdef(models.Transformer(
      cfg.replace(attention="blockwise", attention_block_q=4, attention_block_kv=3),
      rngs=nnx.Rngs(0)))
  rng = np.random.RandomState(0)
  B, T, S = 3, 11, 16
  ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (B, T)), jnp.int32)
  mask = padded_valid(B, T, left=(0, 4, 0), right=(0, 0, 2)).astype(np.int32)
  kv_mask = np.zeros((B, S), bool)
  kv_mask[:, :T] = mask.astype(bool)
  kv_mask[:, T] = True

  @jax.jit
  def run(state):
    outs = []
    for gd in (graphdef, block_def):
      m = nnx.merge(gd, state)
      full = m(ids, attention_mask=jnp.asarray(mask)).logits
      cache = models.init_cache(cfg, B, S)
      prefill = m(ids, cache=cache, cache_index=0, kv_mask=jnp.asarray(kv_mask[:, :S]) &
                  (jnp.arange(S) < T)[None])
      step = m(ids[:, -1:], positions=jnp.full((B, 1), T, jnp.int32), cache=prefill.cache,
               cache_index=jnp.int32(T), kv_mask=jnp.asarray(kv_mask))
      outs.append((full, prefill.logits, step.logits))
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
# Live-prefix decode


def full_cache_reference(q, k, v, q_offset, kv_valid):
  """attend_xla over the whole cache with the decode mask (the path the live prefix replaces)."""
  return A.attend_xla(q, k, v, A.attention_mask(q.shape[1], jnp.asarray(kv_valid), q_offset))


@pytest.mark.parametrize("groups,S", [(1, 32), (2, 29), (4, 32)])
def test_live_prefix_decode_matches_full_cache_reference(groups, S):
  """One- and three-token queries at live lengths 1, block, block + 1, 2 blocks + 1 and S (S = 29
  is not a multiple of the block of 8), from a layer-stacked cache; rows with left padding in the
  prompt slots, a hole, and a row with no valid slot at all."""
  B, K, D, L, block = 4, 2, 8, 3, 8
  rng = np.random.RandomState(groups)
  k = jnp.asarray(rng.randn(L, B, S, K, D), jnp.float32)
  v = jnp.asarray(rng.randn(L, B, S, K, D), jnp.float32)
  valid = padded_valid(B, S, left=(0, 5, 9), empty=(3,))
  valid[0, 3] = False

  @jax.jit
  def live(q, q_offset, valid):
    return A.attend_live_prefix(q, k, v, layer=jnp.int32(1), q_offset=q_offset, kv_valid=valid,
                                block_kv=block)

  for T in (1, 3):
    for live_len in sorted({T, block, block + 1, 2 * block + 1, S}):
      if live_len < T:
        continue
      q_offset = live_len - T
      q = jnp.asarray(rng.randn(B, T, K * groups, D), jnp.float32)
      got = live(q, jnp.int32(q_offset), jnp.asarray(valid))
      want = full_cache_reference(q, k[1], v[1], q_offset, valid)
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5,
                                 err_msg=f"T={T} live={live_len}")
      assert np.all(np.asarray(got)[3] == 0)  # no valid key: exactly 0
  np.testing.assert_allclose(  # and the independent float64 reference, once
      got, numpy_attention(q, k[1], v[1], q_offset, valid), atol=1e-5, rtol=1e-5)


def test_live_prefix_never_reads_the_dead_tail():
  """Values past the last live block are NaN: any read of them would poison the output (0 * NaN
  is NaN), so a finite result equal to the reference shows those blocks are never read. The
  unstacked [B, S, K, D] form and a static offset take the same path."""
  B, S, K, G, D, block = 2, 40, 1, 2, 8, 8
  q, k, v = random_qkv(7, B, 1, S, K * G, K, D)
  valid = padded_valid(B, S, left=(0, 3))
  for q_offset in (0, 9, 15, 23):
    live_end = -(-(q_offset + 1) // block) * block
    poisoned_k = k.at[:, live_end:].set(jnp.nan)
    poisoned_v = v.at[:, live_end:].set(jnp.nan)
    got = A.attend_live_prefix(q, poisoned_k, poisoned_v, q_offset=q_offset,
                               kv_valid=jnp.asarray(valid), block_kv=block)
    assert np.isfinite(np.asarray(got)).all(), f"q_offset={q_offset}"
    np.testing.assert_allclose(got, full_cache_reference(q, k, v, q_offset, valid), atol=1e-5)


def test_live_prefix_bfloat16_cache_and_bad_input():
  q, k, v = random_qkv(8, 2, 1, 24, 4, 2, 16, jnp.bfloat16)
  valid = padded_valid(2, 24, left=(4, 0))
  out = A.attend_live_prefix(q, k, v, q_offset=jnp.int32(17), kv_valid=jnp.asarray(valid),
                             block_kv=8)
  assert out.dtype == jnp.bfloat16
  ref = numpy_attention(q, k, v, 17, valid)
  assert np.abs(np.asarray(out, np.float32) - ref).max() < 2e-2
  with pytest.raises(ValueError, match="layer"):
    A.attend_live_prefix(q, k[None], v[None], q_offset=0)  # stacked cache without layer=
  with pytest.raises(ValueError, match="kv_valid"):
    A.attend_live_prefix(q, k, v, q_offset=0, kv_valid=jnp.ones((2, 5), bool))
  assert A.decode_uses_live_prefix("auto", 1) and A.decode_uses_live_prefix("blockwise", 1)
  assert not A.decode_uses_live_prefix("xla", 1)  # the full-cache reference path
  assert not A.decode_uses_live_prefix("auto", A.DECODE_MAX_QUERIES + 1)  # prefill


def materialised_results(hlo: str) -> list[str]:
  """Result descriptions of the compiled HLO instructions that get buffers of their own: those
  outside fused computations (whose insides are computed in place), leaving out parameters,
  tuple elements and bitcasts (no new data)."""
  results, fused = [], False
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      name = line.split("(")[0]
      fused = "fused" in name or "wrapped" in name
    elif " = " in line and not fused:
      result = line.split(" = ", 1)[1]
      if not any(f" {op}(" in result for op in ("parameter", "get-tuple-element", "bitcast")):
        results.append(result)
  return results


def test_model_decode_step_copies_no_layer_of_the_cache():
  """The compiled decode step of the live path materialises no [B, S, K, D] slice of a cache
  layer and no copy of the cache, with several key blocks (S = 512) or one (S = 64). (A one-block
  while loop did: XLA hoisted the loop-invariant layer slice out of it.)"""
  cfg = models.get_preset("tiny")
  B, K, D = 3, cfg.num_kv_heads, cfg.head_dim  # B = 3: no weight has a cache-like shape

  def cache_buffers(hlo, S):
    return [r for r in materialised_results(hlo)
            if r.startswith((f"f32[{B},{S},{K},{D}]", f"f32[1,{B},{S},{K},{D}]"))
            or (r.startswith(f"f32[{cfg.num_layers},{B},{S},{K},{D}]") and " copy(" in r)]

  # The check sees a materialised layer where there is one.
  layer_twice = jax.jit(lambda k, i: k[i] * 2).lower(
      models.init_cache(cfg, B, 64).k, jnp.int32(1)).compile().as_text()
  assert cache_buffers(layer_twice, 64)

  graphdef, state = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))

  def step(state, cache, token, index, kv_mask):
    return nnx.merge(graphdef, state)(token, cache=cache, cache_index=index,
                                      kv_mask=kv_mask).cache

  for S in (512, 64):
    hlo = jax.jit(step, donate_argnums=1).lower(
        state, models.init_cache(cfg, B, S), jnp.zeros((B, 1), jnp.int32), jnp.int32(5),
        jnp.ones((B, S), bool)).compile().as_text()
    assert cache_buffers(hlo, S) == [], f"S={S}"
