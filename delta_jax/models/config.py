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
  def num_groups(self) -> int:
    """Query heads per key/value head (grouped-query attention)."""
    return self.num_heads // self.num_kv_heads

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def num_params(self, include_embeddings: bool = True) -> int:
    """Exact parameter count of the model this config builds.

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
