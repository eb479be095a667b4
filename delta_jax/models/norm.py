"""RMSNorm, the model's normalisation: the layers' input and post-attention norms, the final norm,
and Qwen3's per-head q / k norms (models.transformer; the decode step's q / k norms also run inside
the fused Mosaic GPU kernel, kernels/paged_decode.py, which computes the same rounding)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in float32, returned in x.dtype."""
  xf = x.astype(jnp.float32)
  normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (normed * weight.astype(jnp.float32)).astype(x.dtype)
