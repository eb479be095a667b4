"""Rotary position embedding (RoPE) in the half-split "rotate_half" layout of Hugging Face's
Qwen3 / Llama: the model rotates q and k with it (models.transformer), and the paged decode
attention rotates q inside itself where its kernel takes q unrotated (models.attention)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float):
  """float32 cos, sin of shape [*positions.shape, head_dim] (both halves equal)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [..., heads, D]; cos / sin [..., D] (x's shape without the heads axis): x cos +
  rotate_half(x) sin with rotate_half(x) = [-x2, x1], in float32, the result in x.dtype."""
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  out = xf * cos[..., None, :] + rotated * sin[..., None, :]
  return out.astype(x.dtype)
