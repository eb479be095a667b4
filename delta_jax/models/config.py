"""Model hyper-parameters (`ModelConfig`) and named presets.

`ModelConfig` covers Qwen3 dense models (qk_norm=True) and the Llama family (qk_norm=False).
It is a frozen, hashable dataclass, so it can be a static argument of jitted functions.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn")  # delta_jax.models.attention.IMPLS
# The projections a LoRA adapter can sit on (ModelConfig.lora_targets).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a decoder-only transformer.

  head_dim is independent of hidden_size / num_heads (Qwen3 uses 128 everywhere).
  dtype is the activation/compute dtype, param_dtype the storage dtype of parameters; norms,
  RoPE and softmax always run in float32.
  remat: False/None/"none" (no rematerialisation), True/"full" (save nothing inside a layer),
  "dots_saveable" or "dots_with_no_batch_dims_saveable" (jax.checkpoint_policies names).
  attention: "auto" | "xla" | "blockwise" | "cudnn" (see delta_jax.models.attention: "xla"
  materialises the [B, N, T, S] scores, the others do not); attention_block_q / _kv: the block
  sizes of the blockwise implementation.
  lora_rank > 0: low-rank adapters (LoRA, Hu et al. 2021, https://arxiv.org/abs/2106.09685) on
  the projections named in lora_targets (a subset of LORA_TARGETS), W x + (alpha / rank) B A x
  (models.transformer; Transformer.add_lora adds them to a built or loaded model).
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1e6
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qk_norm: bool = True
  max_position_embeddings: int = 40960
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: Any = False
  attention: str = "auto"
  attention_block_q: int = 512
  attention_block_kv: int = 512
  lora_rank: int = 0
  lora_alpha: float = 32.0
  lora_targets: tuple = ()

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings", "attention_block_q",
                 "attention_block_kv"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    if not self.rope_theta > 0:
      raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
    if not self.rms_norm_eps > 0:
      raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
    if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
      raise ValueError(f"ModelConfig.lora_rank must be an int >= 0, got {self.lora_rank!r}")
    if self.lora_rank:
      unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
      if not self.lora_targets or unknown or len(set(self.lora_targets)) < len(self.lora_targets):
        raise ValueError(f"ModelConfig.lora_targets must be distinct names from {LORA_TARGETS}, "
                         f"got {self.lora_targets!r}")
      if not self.lora_alpha > 0:
        raise ValueError(f"ModelConfig.lora_alpha must be > 0, got {self.lora_alpha!r}")
    self.remat_policy  # validates
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig.attention must be one of {ATTENTION_IMPLS}, "
                       f"got {self.attention!r}")

  @property
  def remat_policy(self) -> str:
    """The remat setting normalised to one of REMAT_POLICIES."""
    if self.remat is None or self.remat is False:
      return "none"
    if self.remat is True:
      return "full"
    if self.remat in REMAT_POLICIES:
      return self.remat
    raise ValueError(f"ModelConfig.remat must be a bool or one of {REMAT_POLICIES}, "
                     f"got {self.remat!r}")

  @property
  def lora_scale(self) -> float:
    """LoRA's alpha / rank (0 without adapters)."""
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  @property
  def num_groups(self) -> int:
    """Query heads per key/value head (grouped-query attention)."""
    return self.num_heads // self.num_kv_heads

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def num_lora_params(self) -> int:
    """Parameters of the LoRA adapters (0 without): rank x (fan-in + fan-out) per target and
    layer."""
    h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
    n, k = self.num_heads * d, self.num_kv_heads * d
    sizes = {"q_proj": h + n, "k_proj": h + k, "v_proj": h + k, "o_proj": n + h,
             "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
    return self.num_layers * self.lora_rank * sum(sizes[t] for t in self.lora_targets)

  def num_params(self, include_embeddings: bool = True) -> int:
    """Exact parameter count of the base model this config builds (its LoRA adapters, if any:
    num_lora_params).

    include_embeddings=False leaves out the embedding table and the LM head (the
    "non-embedding" count of model cards).
    """
    h, d = self.hidden_size, self.head_dim
    attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
    if self.qk_norm:
      attn += 2 * d
    mlp = 3 * h * self.intermediate_size
    per_layer = attn + mlp + 2 * h
    total = self.num_layers * per_layer + h  # + final norm
    if include_embeddings:  # embedding table, plus the LM head when untied
      total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
    return total


def _qwen3(hidden, intermediate, layers, heads, tie):
  return ModelConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                     num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128,
                     rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tie, qk_norm=True,
                     max_position_embeddings=40960)


# Values from the published Hugging Face config.json files of Qwen/Qwen3-*.
PRESETS = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, False),
    # For tests and smoke runs: GQA 2:1, head_dim != hidden / heads, untied head.
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
                        max_position_embeddings=2048),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """A named preset (see PRESETS), with optional field overrides (e.g. dtype=jnp.bfloat16)."""
  key = name.lower()
  if key not in PRESETS:
    raise ValueError(f"Unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[key].replace(**overrides) if overrides else PRESETS[key]
