"""Transformer behaviour: presets, axis names, KV-cache decoding, masking, dtype, remat, LoRA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax import models
from delta_jax.models import attention
from tests.cudnn_stand_in import as_on_a_cuda_gpu

CFG = models.get_preset("tiny")  # GQA 2:1, head_dim 32 != 64 / 4, untied, qk-norm


@pytest.fixture(scope="module")
def model():
  m = models.Transformer(CFG, rngs=nnx.Rngs(0))
  # Non-trivial norm scales so that every parameter matters.
  key = jax.random.key(1)
  for name in ("input_norm", "post_attn_norm", "q_norm", "k_norm"):
    var = getattr(m.layers, name)
    key, sub = jax.random.split(key)
    var.set_value(1.0 + 0.3 * jax.random.normal(sub, var.shape))
  return m


@pytest.fixture(scope="module")
def lora_model(model):
  """`model` with LoRA adapters (rank 3, alpha 6) on every projection, B non-zero (a fresh
  adapter changes nothing)."""
  m = nnx.clone(model).add_lora(3, 6.0, seed=2)
  key = jax.random.key(3)
  for name in m.layers.lora_names():
    if name.endswith("_lora_b"):
      var = getattr(m.layers, name)
      key, sub = jax.random.split(key)
      var.set_value(0.2 * jax.random.normal(sub, var.shape))
  return m


def test_presets_match_published_qwen3_configs():
  c8 = models.get_preset("qwen3-8b")
  assert (c8.vocab_size, c8.hidden_size, c8.intermediate_size, c8.num_layers, c8.num_heads,
          c8.num_kv_heads, c8.head_dim) == (151936, 4096, 12288, 36, 32, 8, 128)
  assert c8.rope_theta == 1e6 and not c8.tie_word_embeddings and c8.qk_norm
  assert models.get_preset("qwen3-0.6b").tie_word_embeddings
  assert models.get_preset("qwen3-4b").tie_word_embeddings
  assert not models.get_preset("qwen3-14b").tie_word_embeddings
  # Model-card parameter counts (total, non-embedding), in billions.
  published = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6),
               "qwen3-8b": (8.2, 6.95), "qwen3-14b": (14.8, 13.2)}
  for name, (total, non_embedding) in published.items():
    cfg = models.get_preset(name)
    assert cfg.num_params() / 1e9 == pytest.approx(total, abs=0.05)
    assert cfg.num_params(include_embeddings=False) / 1e9 == pytest.approx(non_embedding, abs=0.05)
  with pytest.raises(ValueError, match="Unknown model preset"):
    models.get_preset("qwen3-1000b")


def test_num_params_counts_the_built_model(model):
  assert CFG.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  tied = CFG.replace(tie_word_embeddings=True, qk_norm=False, num_layers=1)
  abstract = nnx.eval_shape(lambda: models.Transformer(tied, rngs=nnx.Rngs(0)))
  assert tied.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))


def test_config_validation():
  with pytest.raises(ValueError, match="num_kv_heads"):
    CFG.replace(num_heads=6, num_kv_heads=4)
  with pytest.raises(ValueError, match="remat"):
    CFG.replace(remat="sometimes")
  with pytest.raises(ValueError, match="hidden_size"):
    CFG.replace(hidden_size=0)


def test_parameters_carry_logical_axis_names(model):
  specs = nnx.get_partition_spec(nnx.state(model))
  assert tuple(specs["layers"]["q_proj"].get_value()) == ("layers", "embed", "q_heads", "head_dim")
  assert tuple(specs["layers"]["o_proj"].get_value()) == ("layers", "q_heads", "head_dim", "embed")
  assert tuple(specs["layers"]["gate_proj"].get_value()) == ("layers", "embed", "mlp")
  assert tuple(specs["embed"].get_value()) == ("vocab", "embed")
  assert tuple(specs["lm_head"].get_value()) == ("embed", "vocab")
  for path, var in nnx.to_flat_state(nnx.state(model)):
    axes = var.get_metadata()["out_sharding"]
    assert len(axes) == var.get_value().ndim, path


def test_lm_head_weight_tied_is_transposed_embedding():
  tied = models.Transformer(CFG.replace(tie_word_embeddings=True, num_layers=1), rngs=nnx.Rngs(0))
  assert not hasattr(tied, "lm_head")
  np.testing.assert_array_equal(tied.lm_head_weight(), tied.embed[...].T)


def _reference_forward(m, ids):
  """Naive single-sequence forward (no padding): python loop over layers, explicit heads."""
  cfg = m.cfg
  eps = cfg.rms_norm_eps

  def norm(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

  T = len(ids)
  x = np.asarray(m.embed[...])[ids]
  inv = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
  ang = np.arange(T)[:, None] * inv
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

  def rope(v):  # [T, heads, D]
    half = v.shape[-1] // 2
    rot = np.concatenate([-v[..., half:], v[..., :half]], -1)
    return v * cos[:, None] + rot * sin[:, None]

  p = {k: np.asarray(v) for k, v in m.layers.arrays().items()}
  for name in [k for k in p if k.endswith("_lora_a")]:  # W + (alpha / r) A B, layer by layer
    target = name[:-len("_lora_a")]
    a, b = p.pop(name), p.pop(f"{target}_lora_b")
    p[target] = p[target] + cfg.lora_alpha / cfg.lora_rank * np.stack(
        [np.tensordot(a[i], b[i], axes=1) for i in range(cfg.num_layers)])
  for layer in range(cfg.num_layers):
    h = norm(x, p["input_norm"][layer])
    q = np.einsum("th,hnd->tnd", h, p["q_proj"][layer])
    k = np.einsum("th,hkd->tkd", h, p["k_proj"][layer])
    v = np.einsum("th,hkd->tkd", h, p["v_proj"][layer])
    q, k = norm(q, p["q_norm"][layer]), norm(k, p["k_norm"][layer])
    q, k = rope(q), rope(k)
    heads = []
    for n in range(cfg.num_heads):
      kv = n // cfg.num_groups
      s = q[:, n] @ k[:, kv].T / np.sqrt(cfg.head_dim)
      s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      heads.append((w / w.sum(-1, keepdims=True)) @ v[:, kv])
    x = x + np.einsum("tnd,ndh->th", np.stack(heads, 1), p["o_proj"][layer])
    h = norm(x, p["post_attn_norm"][layer])
    g, u = h @ p["gate_proj"][layer], h @ p["up_proj"][layer]
    x = x + (g / (1 + np.exp(-g)) * u) @ p["down_proj"][layer]
  hidden = norm(x, np.asarray(m.final_norm[...]))
  return hidden @ np.asarray(m.lm_head_weight()), hidden


@pytest.mark.parametrize("which", ["model", "lora_model"])
def test_forward_matches_naive_reference(request, which):
  """The layer scan (with LoRA: W x + scale (x A) B, never merged) against a numpy forward
  (with LoRA: on the merged W + scale A B)."""
  model = request.getfixturevalue(which)
  ids = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 7))
  out = model(jnp.asarray(ids, jnp.int32))
  for b in range(2):
    logits, hidden = _reference_forward(model, ids[b])
    np.testing.assert_allclose(out.logits[b], logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out.hidden[b], hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cudnn_path", [False, True])
def test_padding_is_invisible_and_fully_masked_rows_are_finite(model, monkeypatch, cudnn_path):
  """Left- and right-padded rows and an all-padding row: the unpadded logits at the real
  tokens, everything finite. cudnn_path (the unpadded pass too): as a CUDA GPU runs the pass
  (each row's real tokens moved to its front for the whole pass, attention by key lengths, the
  hidden states moved back): the same, and the gradients of a loss over the real tokens'
  logits are the masked pass's."""
  ids = np.random.RandomState(1).randint(0, CFG.vocab_size, (1, 6))
  filler = np.full((1, 3), 7)
  left = np.concatenate([filler, ids], 1)
  right = np.concatenate([ids, filler], 1)
  batch = jnp.asarray(np.concatenate([left, right, np.zeros_like(left)], 0), jnp.int32)
  mask = jnp.asarray([[0] * 3 + [1] * 6, [1] * 6 + [0] * 3, [0] * 9])
  graphdef, state = nnx.split(model)
  weights = jnp.asarray(np.random.RandomState(2).randn(3, 9, 1), jnp.float32)

  def loss(state):
    out = nnx.merge(graphdef, state)(batch, attention_mask=mask)
    real = (mask > 0)[:, :, None]
    return jnp.sum(jnp.where(real, jnp.tanh(out.logits) * weights, 0.0)), out

  masked_grads = jax.grad(lambda st: loss(st)[0])(state)
  with monkeypatch.context() as patch:
    if cudnn_path:
      as_on_a_cuda_gpu(patch)
    plain = model(jnp.asarray(ids, jnp.int32)).logits[0]  # no mask: no permutation either
    grads, out = jax.grad(loss, has_aux=True)(state)
  np.testing.assert_allclose(out.logits[0, 3:], plain, atol=1e-5)
  np.testing.assert_allclose(out.logits[1, :6], plain, atol=1e-5)
  assert np.isfinite(np.asarray(out.logits)).all() and np.isfinite(np.asarray(out.hidden)).all()
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(masked_grads)):
    # float32 sums over the tokens in another order: within 1e-5 of each gradient's scale
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("which,cudnn_path", [("model", False), ("lora_model", False),
                                              ("model", True)])
def test_paged_decoding_matches_full_forward(request, monkeypatch, which, cudnn_path):
  """The prompts prefilled into scrambled pages of a per-layer pool by prefill_paged (all rows in
  one call, right-padded: padding writes nothing), then decoded token by token with
  decode_paged (rows of different lengths, padding rows with write page -1): the logits of a
  full forward pass, and padding writes nothing (the scratch page 0, which no table entry of a
  live row names, stays zero). With LoRA prefill and decode run the merged weights
  (DecoderLayers.unstacked), the full pass the unmerged adapters. cudnn_path: the prefill's
  attention as a CUDA GPU resolves it, cuDNN over the rows' key lengths
  (attention.attend_prefix_causal, run here by jax's XLA kernel), never the permuting path."""
  model = request.getfixturevalue(which)
  rng = np.random.RandomState(5)
  B, G, page_size, pages_per_seq = 3, 6, 4, 4
  prompt_lens = [5, 2, 7]
  seqs = [rng.randint(0, CFG.vocab_size, n + G).tolist() for n in prompt_lens]
  graphdef, state = nnx.split(model)
  num_pages = 1 + B * pages_per_seq
  tables = (1 + rng.permutation(B * pages_per_seq)).reshape(B, pages_per_seq).astype(np.int32)
  cache = models.init_paged_cache(CFG, num_pages, page_size)

  @jax.jit
  def step(state, cache, tokens, positions, lengths, page, offset):
    m = nnx.merge(graphdef, state)
    return m.decode_paged(tokens, positions, cache, jnp.asarray(tables), lengths, page, offset)

  # Prefill every prompt but its last token (the engine's convention), all rows in one call.
  T = max(prompt_lens) - 1
  ids, valid = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
  page, offset = np.full((B, T), -1, np.int32), np.zeros((B, T), np.int32)
  for b, n in enumerate(prompt_lens):
    t = np.arange(n - 1)
    ids[b, :n - 1], valid[b, :n - 1] = seqs[b][:n - 1], 1
    page[b, :n - 1], offset[b, :n - 1] = tables[b, t // page_size], t % page_size
  with monkeypatch.context() as patch:
    if cudnn_path:
      as_on_a_cuda_gpu(patch)
    cache = jax.jit(lambda state, cache, *a: nnx.merge(graphdef, state).prefill_paged(
        *a[:3], cache, *a[3:]))(
        state, cache, jnp.asarray(ids), jnp.asarray(np.maximum(np.cumsum(valid, 1) - 1, 0)),
        jnp.asarray(valid), jnp.asarray(page), jnp.asarray(offset))
  for pool in cache.k + cache.v:  # padding wrote nothing: the scratch page is all zeros
    assert not np.asarray(pool[:, 0]).any()
  fulls = [np.asarray(model(jnp.asarray([s], jnp.int32)).logits[0]) for s in seqs]
  for g in range(G + 1):
    pos = np.asarray([n - 1 + g for n in prompt_lens], np.int32)
    tokens = np.asarray([s[p] for s, p in zip(seqs, pos)], np.int32)
    page = tables[np.arange(B), pos // page_size]
    active = pos < np.asarray([len(s) for s in seqs])
    pad = ~active | (np.arange(B) == 1) & (g % 2 == 1)  # row 1 idles every other step
    logits, new_cache = step(state, cache, jnp.asarray(np.where(pad, 0, tokens)),
                             jnp.asarray(pos), jnp.asarray(np.where(pad, 0, pos + 1)),
                             jnp.asarray(np.where(pad, -1, page)),
                             jnp.asarray(np.where(pad, 0, pos % page_size)))
    cache = new_cache
    for b in range(B):
      if not pad[b]:
        np.testing.assert_allclose(logits[b], fulls[b][pos[b]], atol=1e-5)
      elif b == 1 and active[b]:  # repeat the idle step for real
        logits1, cache = step(state, cache, jnp.asarray(tokens), jnp.asarray(pos),
                              jnp.asarray(np.where(np.arange(B) == 1, pos + 1, 0)),
                              jnp.asarray(np.where(np.arange(B) == 1, page, -1)),
                              jnp.asarray(np.where(np.arange(B) == 1, pos % page_size, 0)))
        np.testing.assert_allclose(logits1[1], fulls[1][pos[1]], atol=1e-5)
  assert len(cache.k) == CFG.num_layers and cache.k[0].shape == (
      CFG.num_kv_heads, num_pages, page_size, CFG.head_dim)
  assert not any(np.asarray(pool[:, 0]).any() for pool in cache.k + cache.v)


@pytest.mark.devices(4)
def test_cudnn_pass_under_a_batch_mesh_matches_one_device(model, monkeypatch):
  """The model's pass over padded rows as a CUDA GPU runs it (each row's real tokens moved to its
  front, attention by key lengths; the stand-in of as_on_a_cuda_gpu) with the batch split over
  a 4-device mesh: the one-device logits at the real tokens (a row's permutation stays on its
  shard)."""
  from jax.sharding import NamedSharding, PartitionSpec
  from delta_jax import sharding
  as_on_a_cuda_gpu(monkeypatch)
  rng = np.random.RandomState(6)
  ids = jnp.asarray(rng.randint(0, CFG.vocab_size, (8, 12)), jnp.int32)
  starts, ends = rng.randint(0, 5, (8, 1)), rng.randint(7, 13, (8, 1))
  mask = jnp.asarray((np.arange(12) >= starts) & (np.arange(12) < ends), jnp.int32)
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda st, i, m: nnx.merge(graphdef, st)(i, attention_mask=m).logits)
  one = run(state, ids, mask)
  mesh = sharding.make_mesh(data=4, devices=jax.devices()[:4])
  rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
  got = run(jax.device_put(state, NamedSharding(mesh, PartitionSpec())),
            jax.device_put(ids, rows), jax.device_put(mask, rows))
  assert got.sharding.spec[0] is not None  # the rows stayed split
  real = np.asarray(mask)[:, :, None] > 0
  np.testing.assert_allclose(np.where(real, got, 0), np.where(real, one, 0), atol=1e-5)


@pytest.mark.gpu
def test_cudnn_pass_on_padded_rows_matches_xla(model):
  """On a CUDA GPU, a bf16 forward over left- and right-padded rows with cuDNN attention (the
  model's pass: real tokens moved to each row's front once, attention by key lengths, hidden
  states moved back) against the same model with the materialised-scores attention: logits at
  real tokens and the gradients of a loss over them within bf16 rounding."""
  cfg = CFG.replace(dtype=jnp.bfloat16)
  assert attention.resolve_impl("auto", (3, 40, cfg.num_heads, cfg.head_dim), cfg.dtype,
                                kv_len=40) == "cudnn"
  rng = np.random.RandomState(4)
  batch = jnp.asarray(rng.randint(0, cfg.vocab_size, (3, 40)), jnp.int32)
  mask = jnp.asarray(np.arange(40)[None, :] >= np.array([[0], [13], [40]]), jnp.int32)
  mask = mask * jnp.asarray(np.arange(40)[None, :] < np.array([[31], [40], [40]]), jnp.int32)
  real = (mask > 0)[:, :, None]
  weights = jnp.asarray(rng.randn(3, 40, 1), jnp.float32)

  def run(impl):
    m = models.Transformer(cfg.replace(attention=impl), rngs=nnx.Rngs(0))
    nnx.update(m, nnx.state(model))
    graphdef, state = nnx.split(m)

    def loss(state):
      out = nnx.merge(graphdef, state)(batch, attention_mask=mask)
      return jnp.sum(jnp.where(real, jnp.tanh(out.logits) * weights, 0.0)), out.logits
    return jax.jit(jax.grad(loss, has_aux=True))(state)

  (grads, logits), (ref_grads, ref_logits) = run("auto"), run("xla")
  real = np.asarray(real)
  np.testing.assert_allclose(np.where(real, logits, 0), np.where(real, ref_logits, 0),
                             atol=5e-2 * np.abs(np.asarray(ref_logits)).max(), rtol=0)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    scale = max(1e-6, float(np.abs(np.asarray(want, np.float32)).max()))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=5e-2 * scale, rtol=0)


def test_bfloat16_policy_close_to_float32(model):
  bf16 = models.Transformer(CFG.replace(dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
  nnx.update(bf16, nnx.state(model))
  ids = jnp.asarray(np.random.RandomState(3).randint(0, CFG.vocab_size, (2, 6)), jnp.int32)
  out = bf16(ids)
  assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
  ref = model(ids).logits
  assert np.abs(np.asarray(out.logits) - np.asarray(ref)).max() < 0.05 * np.abs(ref).max()


def test_remat_gives_same_gradients(model):
  ids = jnp.asarray(np.random.RandomState(4).randint(0, CFG.vocab_size, (2, 5)), jnp.int32)
  policies = ("none", "full", "dots_saveable")
  graphdefs = [nnx.graphdef(models.Transformer(CFG.replace(remat=r), rngs=nnx.Rngs(0)))
               for r in policies]
  state = nnx.state(model)

  @jax.jit  # one program for all three gradients keeps the test cheap
  def grads(state):
    def loss(state, graphdef):
      return jnp.mean(nnx.merge(graphdef, state)(ids).logits ** 2)
    return [jax.grad(loss)(state, g) for g in graphdefs]

  g_ref, *g_remat = grads(state)
  for g in g_remat:
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_layer_residuals_without_remat_are_the_inputs_of_norms_and_swiglu(monkeypatch):
  """remat="none" in bfloat16: what the layer scan keeps for the backward (its layer-stacked
  residuals, [L, B, T, ...]) is all bfloat16, and of the MLP's width three arrays a layer
  (gate, up and their SwiGLU product, down_proj's input): the norms and the SwiGLU product keep
  their inputs and recompute the rest (models.norm, transformer._swiglu). With both written as
  plain formulas (the check sees what they would keep) the scan keeps float32 copies of the
  hidden states and of q and k, and six MLP-wide arrays a layer."""
  from delta_jax.models import transformer
  from tests.test_norm import formula

  # intermediate_size apart from heads x head_dim (128), the o_proj input's width
  cfg = CFG.replace(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, remat="none",
                    intermediate_size=160)
  graphdef, state = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
  B, T = 2, 8
  ids = jnp.asarray(np.random.RandomState(5).randint(0, cfg.vocab_size, (B, T)), jnp.int32)

  def stacked_residuals():
    _, pullback = jax.vjp(lambda s: nnx.merge(graphdef, s)(ids).logits, state)
    return [r for r in jax.tree_util.tree_leaves(pullback)
            if r.ndim >= 4 and r.shape[:3] == (cfg.num_layers, B, T)]

  def mlp_wide(kept):
    return sum(r.shape[3:] == (cfg.intermediate_size,) for r in kept)

  kept = stacked_residuals()
  assert kept and all(r.dtype == jnp.bfloat16 for r in kept), \
      sorted({(r.dtype.name, r.shape[3:]) for r in kept})
  assert mlp_wide(kept) == 3
  monkeypatch.setattr(transformer, "rms_norm", formula)
  monkeypatch.setattr(transformer, "_swiglu", lambda gate, up: jax.nn.silu(gate) * up)
  plain = stacked_residuals()
  widths = {r.shape[3:] for r in plain if r.dtype == jnp.float32}
  assert {(cfg.hidden_size,), (cfg.num_heads, cfg.head_dim),
          (cfg.num_kv_heads, cfg.head_dim)} <= widths, widths
  assert mlp_wide(plain) == 6


def test_return_logits_false(model):
  ids = jnp.zeros((1, 3), jnp.int32)
  out = model(ids, return_logits=False)
  assert out.logits is None and out.hidden.shape == (1, 3, CFG.hidden_size)


def test_lora_adapters(model, lora_model):
  """A fresh adapter leaves the outputs as they were (B = 0); the factors are LoRAParam
  variables of the documented shapes and logical axes (the rank axis unsharded); the adapted
  model differs; bad settings are refused naming the field."""
  ids = jnp.asarray(np.random.RandomState(7).randint(0, CFG.vocab_size, (2, 6)), jnp.int32)
  fresh = nnx.clone(model).add_lora(4, 8.0, targets=("q_proj", "down_proj"), seed=0)
  # Bit for bit on XLA:CPU. XLA:GPU compiles the adapted projection differently (the added
  # x A B term changes its GEMM fusions), so the base products round differently in the last
  # bits: 1.5e-7 at most on an H200, 2026-11-26, in fp32 logits of order 0.1.
  atol = 0.0 if jax.default_backend() == "cpu" else 1e-6
  np.testing.assert_allclose(fresh(ids).logits, model(ids).logits, rtol=0, atol=atol)
  assert fresh.cfg.lora_rank == 4 and fresh.cfg.lora_scale == 2.0
  assert fresh.layers.lora_names() == ("q_proj_lora_a", "q_proj_lora_b", "down_proj_lora_a",
                                       "down_proj_lora_b")
  L, H, I, N, D = CFG.num_layers, CFG.hidden_size, CFG.intermediate_size, CFG.num_heads, CFG.head_dim
  shapes = {"q_proj_lora_a": (L, H, 3), "q_proj_lora_b": (L, 3, N, D),
            "o_proj_lora_a": (L, N, D, 3), "o_proj_lora_b": (L, 3, H),
            "down_proj_lora_a": (L, I, 3), "down_proj_lora_b": (L, 3, H)}
  for name, shape in shapes.items():
    var = getattr(lora_model.layers, name)
    assert isinstance(var, models.LoRAParam) and var.shape == shape, name
    axes = var.get_metadata()["out_sharding"]
    base = models.LAYER_AXES[name.split("_lora_")[0]]
    assert None in axes and set(axes) - {None} <= set(base), (name, axes)
  a = np.asarray(lora_model.layers.q_proj_lora_a[...])
  assert abs(a.std() * np.sqrt(H) - 1) < 0.2  # N(0, 1 / fan-in)
  assert lora_model.cfg.num_lora_params() == sum(
      int(np.prod(getattr(lora_model.layers, n).shape)) for n in lora_model.layers.lora_names())
  assert np.abs(np.asarray(lora_model(ids).logits - model(ids).logits)).max() > 1e-2
  with pytest.raises(ValueError, match="already has LoRA"):
    nnx.clone(lora_model).add_lora(2)
  with pytest.raises(ValueError, match="lora_targets"):
    CFG.replace(lora_rank=2, lora_targets=("qkv",))
  with pytest.raises(ValueError, match="lora_alpha"):
    CFG.replace(lora_rank=2, lora_targets=("q_proj",), lora_alpha=0.0)
