"""RMSNorm, the model's normalisation: the layers' input and post-attention norms, the final norm,
and Qwen3's per-head q / k norms (models.transformer; the decode step's q / k norms also run inside
the fused Mosaic GPU kernel, kernels/paged_decode.py, which computes the same rounding)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in float32, returned in x.dtype.

  Differentiated, it keeps only its inputs for the backward and recomputes its float32
  internals there (jax.checkpoint): plain autodiff would keep x's float32 upcast and the
  normalised value, 8 bytes an element, for each of a layer's four norms. In the Qwen3-1.7B train
  step without remat (bf16, 8 x 4,096 tokens in micro-batches of 2) that took the compiled peak
  from 71.47 to 62.19 GiB for an H100 and from 80.07 to 70.84 GiB for a v5p chip (BENCHMARKS.md,
  2026-11-28); remat=full and the dots policies recompute the norms anyway."""
  return _rms_norm(x, weight, eps)


# prevent_cse=False: the layers run in a scan, where the forward's values cannot stand in for
# the backward's recompute anyway (jax.checkpoint's documentation), and no optimization barrier
# is put in the backward's way.
@functools.partial(jax.checkpoint, prevent_cse=False, static_argnums=(2,))
def _rms_norm(x, weight, eps):
  xf = x.astype(jnp.float32)
  normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (normed * weight.astype(jnp.float32)).astype(x.dtype)
