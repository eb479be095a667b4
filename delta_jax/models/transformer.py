"""Decoder-only transformer (Qwen3 dense / Llama family) in flax.nnx.

Layers are stored stacked along a leading "layers" axis and run with lax.scan, so compile
time does not grow with depth; each layer can be rematerialised (cfg.remat).

Logical axis names of the parameters (metadata key `out_sharding`, read with
`nnx.get_partition_spec` or `nnx.spmd.get_var_pspec`; a sharding rules table maps them to mesh
axes). Shapes use L=layers, V=vocab, H=hidden, N=heads, K=kv heads, D=head_dim, I=intermediate:

    embed                     [V, H]        ("vocab", "embed")
    lm_head (untied only)     [H, V]        ("embed", "vocab")
    final_norm                [H]           ("norm",)
    layers.input_norm         [L, H]        ("layers", "norm")
    layers.post_attn_norm     [L, H]        ("layers", "norm")
    layers.q_proj             [L, H, N, D]  ("layers", "embed", "q_heads", "head_dim")
    layers.k_proj, v_proj     [L, H, K, D]  ("layers", "embed", "kv_heads", "head_dim")
    layers.o_proj             [L, N, D, H]  ("layers", "q_heads", "head_dim", "embed")
    layers.q_norm, k_norm     [L, D]        ("layers", "head_dim")   (qk_norm models only)
    layers.gate_proj, up_proj [L, H, I]     ("layers", "embed", "mlp")
    layers.down_proj          [L, I, H]     ("layers", "mlp", "embed")

Numerics: RMSNorm, RoPE and softmax in float32; matmuls in cfg.dtype with float32 accumulation
for the scores and logits; logits are returned in float32. Attention runs through
delta_jax.models.attention.attend with cfg.attention ("auto" never materialises the [T, S] scores
of long sequences).

LoRA (cfg.lora_rank > 0, or add_lora on a built model): each target projection W of every layer
gets float32 factors A ("<name>_lora_a", [L, *fan-in dims, r]) and B ("<name>_lora_b",
[L, r, *fan-out dims]) of type LoRAParam; the layer scan computes W x + scale (x A) B with
scale = alpha / r, so nothing of W's size is built and no gradient of W is needed, while the
decode step (and the Hugging Face export) uses the merged W + scale A B of each layer, made once
per call (DecoderLayers.unstacked, merge_lora). A starts N(0, 1 / fan-in), B at zero: a fresh
adapter leaves the model as it was.

Decoding: prefill_paged(...) runs prompts into a PagedKVCache (one page pool per layer), each
layer writing its keys and values into the pages as it computes them; decode_paged(...) is the
decode step over it (each pool read in place by attention.paged_decode_attention): what the
rollout engine (delta_jax.sampling) runs. Both run the layers as a Python loop on decode_layers()
(each layer's own arrays), so every layer's pool is its own array (a scan would carry a
layer-stacked cache and slice it per layer, or stack every layer's keys and values).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax import sharding as sharding_lib
from delta_jax.models import attention
from delta_jax.models.cache import PagedKVCache
from delta_jax.models.config import LORA_TARGETS, ModelConfig
from delta_jax.models.norm import rms_norm
from delta_jax.models.rope import apply_rope, rope_cos_sin

LAYER_AXES = {
    "input_norm": ("layers", "norm"),
    "post_attn_norm": ("layers", "norm"),
    "q_proj": ("layers", "embed", "q_heads", "head_dim"),
    "k_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "v_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "o_proj": ("layers", "q_heads", "head_dim", "embed"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "gate_proj": ("layers", "embed", "mlp"),
    "up_proj": ("layers", "embed", "mlp"),
    "down_proj": ("layers", "mlp", "embed"),
}
NORM_NAMES = ("input_norm", "post_attn_norm", "q_norm", "k_norm")
# Weight dimensions (after the layer axis) a LoRA A factor contracts: o_proj's (heads, head_dim).
_LORA_FAN_IN_DIMS = {"o_proj": 2}


class LoRAParam(nnx.Param):
  """A LoRA factor: with adapters, the only parameters training updates (train.state)."""


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Shapes of the stacked per-layer parameters (leading axis = layers)."""
  L, H, N, K, D, I = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim, cfg.intermediate_size)
  shapes = {
      "input_norm": (L, H), "post_attn_norm": (L, H),
      "q_proj": (L, H, N, D), "k_proj": (L, H, K, D), "v_proj": (L, H, K, D),
      "o_proj": (L, N, D, H),
      "gate_proj": (L, H, I), "up_proj": (L, H, I), "down_proj": (L, I, H),
  }
  if cfg.qk_norm:
    shapes["q_norm"] = (L, D)
    shapes["k_norm"] = (L, D)
  return shapes


def lora_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Shapes of the stacked LoRA factors, {"<target>_lora_a": [L, *in, r], "_lora_b": [L, r,
  *out]} ({} without adapters)."""
  shapes = layer_param_shapes(cfg)
  out = {}
  for target in cfg.lora_targets if cfg.lora_rank else ():
    n_in, shape = _LORA_FAN_IN_DIMS.get(target, 1), shapes[target]
    out[f"{target}_lora_a"] = (shape[0], *shape[1:1 + n_in], cfg.lora_rank)
    out[f"{target}_lora_b"] = (shape[0], cfg.lora_rank, *shape[1 + n_in:])
  return out


def _lora_axes(name: str) -> tuple:
  """Logical axes of a LoRA factor: its weight's, with the rank axis unsharded (None)."""
  target, factor = name.rsplit("_lora_", 1)
  axes, n_in = LAYER_AXES[target], _LORA_FAN_IN_DIMS.get(target, 1)
  return (axes[0], *axes[1:1 + n_in], None) if factor == "a" else (axes[0], None,
                                                                    *axes[1 + n_in:])


def init_lora_arrays(cfg: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
  """Fresh float32 LoRA factors: A ~ N(0, 1 / fan-in), B = 0."""
  shapes = lora_param_shapes(cfg)
  keys = iter(jax.random.split(key, max(len(shapes), 1)))
  out = {}
  for name, shape in shapes.items():
    if name.endswith("_lora_a"):
      fan_in = math.prod(shape[1:-1])
      out[name] = jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)
    else:
      out[name] = jnp.zeros(shape, jnp.float32)
  return out


def merge_lora(scale: float, p: dict) -> dict:
  """One layer's weights with each LoRA pair folded into its projection: W + scale A B
  (A [*in, r], B [r, *out]), computed in float32 and stored in W's dtype; the factors dropped."""
  out = {k: v for k, v in p.items() if "_lora_" not in k}
  for name, w in out.items():
    if f"{name}_lora_a" in p:
      delta = jnp.tensordot(p[f"{name}_lora_a"].astype(jnp.float32),
                            p[f"{name}_lora_b"].astype(jnp.float32), axes=1)
      out[name] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
  return out


def _lora(cfg: ModelConfig, p: dict, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """y (= x W of projection `name`, x [..., *in]) plus scale (x A) B when the projection has an
  adapter in p; y itself otherwise (the program without adapters is unchanged)."""
  a = p.get(f"{name}_lora_a")
  if a is None:
    return y
  xa = jnp.tensordot(x, a.astype(x.dtype), axes=a.ndim - 1)
  return y + (cfg.lora_scale * jnp.tensordot(xa, p[f"{name}_lora_b"].astype(x.dtype), axes=1)
              ).astype(y.dtype)


@flax.struct.dataclass
class ModelOutput:
  logits: Optional[jax.Array]  # float32 [B, T, V], or None when return_logits=False
  hidden: jax.Array            # [B, T, H], after the final RMSNorm


def _param(value, axes):
  # eager_sharding=False: names are only metadata here; placement is the sharding module's job.
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _attend(cfg: ModelConfig, q, k, v, kv_valid=None, kv_lengths=None) -> jax.Array:
  """Causal grouped-query attention with the configured implementation (models.attention)."""
  return attention.attend(q, k, v, kv_valid=kv_valid, kv_lengths=kv_lengths, impl=cfg.attention,
                          block_q=cfg.attention_block_q, block_kv=cfg.attention_block_kv)


def _project_qkv(cfg: ModelConfig, p: dict, x: jax.Array):
  """Pre-norm, q/k/v projections, optional per-head q/k RMSNorm; q and k not yet rotated
  (RoPE: rope.apply_rope, by the caller)."""
  h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
  q = _lora(cfg, p, "q_proj", h, jnp.einsum("bth,hnd->btnd", h, p["q_proj"]))
  k = _lora(cfg, p, "k_proj", h, jnp.einsum("bth,hkd->btkd", h, p["k_proj"]))
  v = _lora(cfg, p, "v_proj", h, jnp.einsum("bth,hkd->btkd", h, p["v_proj"]))
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  return q, k, v


@functools.partial(jax.checkpoint, prevent_cse=False)  # prevent_cse: as models.norm's
def _swiglu(gate, up):
  """silu(gate) * up. Differentiated, it keeps gate and up and recomputes the rest in the
  backward: plain autodiff keeps three more [.., I] arrays (silu's sigmoid and output, the
  product's other factor), the widest residuals of a layer; without them the Qwen3-1.7B train step
  without remat compiles at 62.97 instead of 70.84 GiB for a v5p (BENCHMARKS.md, 2026-11-28)."""
  return jax.nn.silu(gate) * up


def _finish_layer(cfg: ModelConfig, p: dict, x: jax.Array, attn: jax.Array) -> jax.Array:
  """Output projection + residual, then the SwiGLU MLP block + residual."""
  # One [B, T, N*D] x [N*D, H] matmul: both reshapes are free views, and XLA otherwise
  # transposes the [N, D, H] weight in every layer of every decode step.
  b, t, n, d = attn.shape
  o_proj = p["o_proj"].reshape(n * d, -1)
  x = x + _lora(cfg, p, "o_proj", attn,
                jnp.einsum("btf,fh->bth", attn.reshape(b, t, n * d), o_proj))
  h = rms_norm(x, p["post_attn_norm"], cfg.rms_norm_eps)
  gate = _lora(cfg, p, "gate_proj", h, jnp.einsum("bth,hi->bti", h, p["gate_proj"]))
  up = _lora(cfg, p, "up_proj", h, jnp.einsum("bth,hi->bti", h, p["up_proj"]))
  act = _swiglu(gate, up)
  return x + _lora(cfg, p, "down_proj", act, jnp.einsum("bti,ih->bth", act, p["down_proj"]))


def _cast_layer(cfg: ModelConfig, p: dict) -> dict:
  """Matmul weights to the compute dtype; norm weights stay as stored (used in float32)."""
  return {name: w if name in NORM_NAMES else w.astype(cfg.dtype) for name, w in p.items()}


def _maybe_remat(cfg: ModelConfig, fn):
  policy = cfg.remat_policy
  if policy == "none":
    return fn
  if policy == "full":
    return jax.checkpoint(fn, prevent_cse=False)
  return jax.checkpoint(fn, policy=getattr(jax.checkpoint_policies, policy), prevent_cse=False)


# Below this many weights, init draws one flat normal vector and slices it: XLA:CPU compiles
# one RNG op in well under a second but ~15 of them take many seconds (tests, smoke runs).
_FLAT_INIT_MAX = 2**26


@functools.partial(jax.jit, static_argnums=0)
def init_arrays(cfg: ModelConfig, key: jax.Array) -> dict:
  """Initial parameter arrays {"embed", "final_norm", "lm_head"?, "layers.<name>"}:
  N(0, 0.02) weights and unit norm scales, in cfg.param_dtype."""
  shapes = {"embed": (cfg.vocab_size, cfg.hidden_size)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
  layer_shapes = layer_param_shapes(cfg)
  shapes.update({f"layers.{n}": s for n, s in layer_shapes.items() if n not in NORM_NAMES})
  sizes = [math.prod(s) for s in shapes.values()]
  if sum(sizes) <= _FLAT_INIT_MAX:
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    offsets = np.cumsum([0] + sizes)
    draws = [flat[a:b].reshape(s) for a, b, s in zip(offsets[:-1], offsets[1:], shapes.values())]
  else:
    keys = jax.random.split(key, len(shapes))
    draws = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes.values())]
  out = {name: (0.02 * d).astype(cfg.param_dtype) for name, d in zip(shapes, draws)}
  out["final_norm"] = jnp.ones((cfg.hidden_size,), cfg.param_dtype)
  for name in NORM_NAMES:
    if name in layer_shapes:
      out[f"layers.{name}"] = jnp.ones(layer_shapes[name], cfg.param_dtype)
  return out


class DecoderLayers(nnx.Module):
  """All decoder layers' parameters, stacked along a leading "layers" axis."""

  def __init__(self, cfg: ModelConfig, arrays: dict):
    for name in layer_param_shapes(cfg):
      setattr(self, name, _param(arrays[f"layers.{name}"], LAYER_AXES[name]))
    self.set_lora(cfg, {k[len("layers."):]: v for k, v in arrays.items() if "_lora_" in k})

  def set_lora(self, cfg: ModelConfig, arrays: dict) -> None:
    """Adds (or replaces) the LoRA factors {"<target>_lora_a"/"_b": stacked array}."""
    self.lora_scale = cfg.lora_scale
    for name, value in arrays.items():
      setattr(self, name, LoRAParam(value, out_sharding=_lora_axes(name), eager_sharding=False))

  def lora_names(self) -> tuple[str, ...]:
    return tuple(n for n in vars(self) if "_lora_" in n)

  def arrays(self) -> dict[str, jax.Array]:
    """The stacked parameters by name, LoRA factors included."""
    names = [n for n in LAYER_AXES if hasattr(self, n)] + list(self.lora_names())
    return {name: getattr(self, name)[...] for name in names}

  def unstacked(self) -> tuple[dict[str, jax.Array], ...]:
    """Each layer's parameters as its own arrays (static slices of the stacked ones), LoRA
    factors merged into their projections (merge_lora). A decode loop takes them once, outside
    its steps: XLA:GPU otherwise copies every weight of every layer out of the stacked arrays at
    every step (a memcpy per matrix before its gemm; 14% of a decode step at batch 64 on an
    H100, BENCHMARKS.md)."""
    arrays = self.arrays()
    num_layers = next(iter(arrays.values())).shape[0]
    return tuple(merge_lora(self.lora_scale, {name: w[i] for name, w in arrays.items()})
                 for i in range(num_layers))


class Transformer(nnx.Module):
  """Decoder-only LM. See the module docstring for parameter names and axes."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    key = rngs.params()
    arrays = init_arrays(cfg, key)
    # The adapters from their own key: the base weights are those of the same seed without.
    arrays.update({f"layers.{k}": v for k, v in
                   init_lora_arrays(cfg, jax.random.fold_in(key, 1)).items()})
    self.embed = _param(arrays["embed"], ("vocab", "embed"))
    self.layers = DecoderLayers(cfg, arrays)
    self.final_norm = _param(arrays["final_norm"], ("norm",))
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(arrays["lm_head"], ("embed", "vocab"))

  def add_lora(self, rank: int, alpha: float = 32.0, targets=LORA_TARGETS, *, seed: int = 0
               ) -> "Transformer":
    """Adds fresh LoRA adapters (A ~ N(0, 1 / fan-in), B = 0: the model's outputs do not
    change) to a built or loaded model, in place; returns it. Placement on a mesh is the
    caller's (sharding.shard_model)."""
    if self.layers.lora_names():
      raise ValueError("add_lora: the model already has LoRA adapters")
    cfg = self.cfg.replace(lora_rank=rank, lora_alpha=float(alpha), lora_targets=tuple(targets))
    self.cfg = cfg
    self.layers.set_lora(cfg, init_lora_arrays(cfg, jax.random.key(seed)))
    return self

  def lm_head_weight(self) -> jax.Array:
    """The output projection [H, V] (the transposed embedding when tied)."""
    if self.cfg.tie_word_embeddings:
      return self.embed[...].T
    return self.lm_head[...]

  def decode_layers(self) -> tuple[dict[str, jax.Array], ...]:
    """Each layer's weights as decode_paged takes them: their own arrays (DecoderLayers.unstacked,
    LoRA merged), matmul weights in the compute dtype, and q_proj, k_proj, v_proj as one
    qkv_proj [H, K, G + 2, D]: KV head h's G query projections, then its key's, then its
    value's (one GEMM a layer and step makes the rows attention.paged_write_attend takes; the
    KV-head axis stays the one tensor parallelism splits). A copy of the layer weights: the
    rollout engine makes it once per generate() (sampling.programs.decode_layers), not per
    decode call."""
    cfg = self.cfg
    K, D, G = cfg.num_kv_heads, cfg.head_dim, cfg.num_groups
    layers = []
    for p in self.layers.unstacked():
      p = _cast_layer(cfg, p)
      H = p["q_proj"].shape[0]
      qkv = jnp.concatenate([p.pop("q_proj").reshape(H, K, G, D), p.pop("k_proj")[:, :, None],
                             p.pop("v_proj")[:, :, None]], axis=2)
      layers.append(dict(p, qkv_proj=qkv))
    return tuple(layers)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, T, H] -> float32 logits [B, T, V]."""
    w = self.lm_head_weight().astype(hidden.dtype)
    return jnp.einsum("bth,hv->btv", hidden, w, preferred_element_type=jnp.float32)

  def __call__(self, input_ids: jax.Array, positions: Optional[jax.Array] = None,
               attention_mask: Optional[jax.Array] = None,
               return_logits: bool = True) -> ModelOutput:
    """Forward pass.

    input_ids: int32 [B, T].
    positions: int32 [B, T]. Default: cumsum(attention_mask) - 1 clipped at 0 when an
      attention_mask is given, otherwise arange(T).
    attention_mask: [B, T], 1 = real token; keys are masked by it (padding may be anywhere;
      where the attention resolves to cuDNN, each row's real tokens run at its front and the
      hidden states are moved back: one permutation a pass, not one a layer). Outputs at padding
      slots are unspecified (finite).
    Returns ModelOutput(logits float32 [B, T, V] or None with return_logits=False, hidden
    [B, T, H]). (The rollout prefill is prefill_paged.)
    """
    cfg = self.cfg
    B, T = input_ids.shape
    if positions is None:
      if attention_mask is not None:
        positions = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
      else:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    key_valid = None if attention_mask is None else attention_mask.astype(bool)
    kv_lengths = unpack = None
    if key_valid is not None and attention.resolve_impl(
        cfg.attention, (B, T, cfg.num_heads, cfg.head_dim), cfg.dtype, kv_len=T) == "cudnn":
      # cuDNN's key lengths take right-padded rows as they are: each row's real tokens run at
      # its front, in their order (one permutation here, undone on the hidden states), rather
      # than every layer's attention permuting its q, k, v and output (attend_packed_causal).
      order, inverse, kv_lengths = attention.padding_order(key_valid)
      input_ids, positions = (jnp.take_along_axis(a, order, axis=1)
                              for a in (input_ids, positions))
      key_valid, unpack = None, (inverse, order)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    x = jnp.take(self.embed[...], input_ids, axis=0).astype(cfg.dtype)

    def layer(x, p):
      p = _cast_layer(cfg, p)
      x = sharding_lib.constrain_rows(x)  # rows over the batch axes (sharding.rows_over_batch)
      q, k, v = _project_qkv(cfg, p, x)
      q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
      out = _finish_layer(cfg, p, x, _attend(cfg, q, k, v, key_valid, kv_lengths))
      return sharding_lib.constrain_rows(out), None

    x, _ = jax.lax.scan(_maybe_remat(cfg, layer), x, self.layers.arrays())
    if unpack is not None:
      x = attention.permute_rows(x, *unpack)

    hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
    logits = self.logits(hidden) if return_logits else None
    return ModelOutput(logits=logits, hidden=hidden)

  def prefill_paged(self, tokens: jax.Array, positions: jax.Array, key_valid: jax.Array,
                    cache: PagedKVCache, write_page: jax.Array, write_offset: jax.Array, *,
                    layers=None, mesh=None, batch_axes=()) -> PagedKVCache:
    """Prompts through every layer into a paged cache (the rollout engine's prefill).

    tokens, positions: int32 [B, T]; key_valid: [B, T], 1 = a real token (rows left-aligned,
    right-padded; padding is never attended to: the attention takes each row's count of real
    tokens as its key length, which cuDNN expresses without moving rows). Each layer writes its
    keys / values of token t of row b at page write_page[b, t], offset write_offset[b, t] of its
    pool (page -1: not written; with a mesh and batch_axes, shard-local pages:
    attention.write_prompt_pages) as it computes them, so no [L, B, T, K, D] stack of every
    layer's is ever held. The layers run unrolled on `layers` (decode_layers(): each layer's own
    arrays, LoRA merged, q / k / v as one GEMM; default: made here), the weights decode reads.
    Returns the updated PagedKVCache (the last layer's hidden states and the logits are not
    computed)."""
    cfg = self.cfg
    B, T = tokens.shape
    G, D = cfg.num_groups, cfg.head_dim
    if len(cache.k) != cfg.num_layers:
      raise ValueError(f"prefill_paged: the cache has {len(cache.k)} layers, the model "
                       f"{cfg.num_layers}")
    cos, sin = rope_cos_sin(positions, D, cfg.rope_theta)
    x = jnp.take(self.embed[...], tokens, axis=0).astype(cfg.dtype)
    lengths = jnp.sum(key_valid.astype(jnp.int32), axis=1)  # valid tokens: a prefix of each row
    layers = self.decode_layers() if layers is None else layers
    new_k, new_v = list(cache.k), list(cache.v)
    for i in range(cfg.num_layers):
      p = _cast_layer(cfg, layers[i])  # a no-op on decode_layers()
      h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
      qkv = jnp.einsum("bth,hkgd->btkgd", h, p["qkv_proj"])
      q, k, v = qkv[..., :G, :].reshape(B, T, -1, D), qkv[..., G, :], qkv[..., G + 1, :]
      if cfg.qk_norm:
        q, k = (rms_norm(q, p["q_norm"], cfg.rms_norm_eps),
                rms_norm(k, p["k_norm"], cfg.rms_norm_eps))
      q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
      attn = _attend(cfg, q, k, v, kv_lengths=lengths)
      new_k[i], new_v[i] = (attention.write_prompt_pages(pool, values, write_page, write_offset,
                                                         mesh=mesh, batch_axes=batch_axes)
                            for pool, values in ((new_k[i], k), (new_v[i], v)))
      if i + 1 < cfg.num_layers:  # the last layer's output feeds nothing here
        x = _finish_layer(cfg, p, x, attn)
    return PagedKVCache(k=tuple(new_k), v=tuple(new_v))

  def decode_paged(self, tokens: jax.Array, positions: jax.Array, cache: PagedKVCache,
                   block_tables: jax.Array, lengths: jax.Array, write_page: jax.Array,
                   write_offset: jax.Array, *, attention_impl: str = "auto",
                   pages_per_block: int = attention.DECODE_PAGES_PER_BLOCK,
                   attention_splits: int = 1, mesh=None, batch_axes=(), layers=None):
    """One decode step of B sequences against a paged cache.

    tokens, positions: int32 [B], each sequence's input token and its position (RoPE).
    Every layer writes the token's key/value at page write_page[b], offset write_offset[b] of
    its pool, and sequence b attends its tokens [0, lengths[b]) through block_tables
    [B, pages_per_seq] (so lengths[b] counts the token being written; padding rows have
    write_page -1, so they write nothing, and length 0): attention.paged_write_attend, which
    also applies the q / k norms and RoPE (in one kernel with attention_impl "mosaic_fused").
    attention_impl, attention_splits: see attention.paged_decode_attention (its impl, splits).
    mesh / batch_axes: a pool whose page axis is split over these mesh axes (write_page and
    block_tables then hold each row's shard-LOCAL page ids; attention.paged_write_attend).
    layers: self.decode_layers(), taken by a caller that loops over decode steps before its loop
    (default: sliced here).
    Returns (logits float32 [B, V], the updated PagedKVCache); donate the cache to the jitted
    caller so every write happens in place.
    """
    cfg = self.cfg
    B = tokens.shape[0]
    if len(cache.k) != cfg.num_layers:
      raise ValueError(f"decode_paged: the cache has {len(cache.k)} layers, the model "
                       f"{cfg.num_layers}")
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)  # [B, D] each
    x = jnp.take(self.embed[...], tokens.reshape(B, 1), axis=0).astype(cfg.dtype)
    layers = self.decode_layers() if layers is None else layers
    new_k, new_v = list(cache.k), list(cache.v)
    for i in range(cfg.num_layers):
      p = _cast_layer(cfg, layers[i])  # a no-op on decode_layers()
      # q, k, v of each KV head in one GEMM ([B, K, G + 2, D]), before the q / k norms and RoPE:
      # paged_write_attend applies them, then writes k and v at (page, offset) of each row and
      # attends over the pool, read in place (with "mosaic_fused" all of it is one Mosaic GPU
      # kernel: no norm, RoPE or scatter kernel of their own).
      h = rms_norm(x[:, 0], p["input_norm"], cfg.rms_norm_eps)
      qkv = jnp.einsum("bh,hkgd->bkgd", h, p["qkv_proj"])
      attn, new_k[i], new_v[i] = attention.paged_write_attend(
          qkv, new_k[i], new_v[i], write_page, write_offset, block_tables, lengths,
          rope=(cos, sin),
          qk_norm=(p["q_norm"], p["k_norm"]) if cfg.qk_norm else None, eps=cfg.rms_norm_eps,
          impl=attention_impl, pages_per_block=pages_per_block, splits=attention_splits,
          mesh=mesh, batch_axes=batch_axes)
      x = _finish_layer(cfg, p, x, attn[:, None])
    hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
    return self.logits(hidden)[:, 0], PagedKVCache(k=tuple(new_k), v=tuple(new_v))
