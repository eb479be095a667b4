"""The key/value cache used for prefill + decode.

KVCache(k, v) holds arrays [layers, batch, max_len, num_kv_heads, head_dim]. The model writes
new entries with lax.dynamic_update_slice at `cache_index` and returns a new cache; callers
should donate the old one (jax.jit(..., donate_argnums=...)) so XLA updates it in place.
"""
from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from delta_jax.models.config import ModelConfig

# Logical axis names of the cache arrays, for the sharding module.
CACHE_AXES = ("layers", "cache_batch", "cache_sequence", "kv_heads", "head_dim")


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [layers, B, S, num_kv_heads, head_dim]
  v: jax.Array  # [layers, B, S, num_kv_heads, head_dim]
  # The arrays' logical names: sharding.cache_shardings reads them from the cache.
  logical_axes: ClassVar[tuple] = CACHE_AXES

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
  """A zero cache for `batch` sequences of up to `max_len` slots (dtype defaults to cfg.dtype)."""
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dtype = cfg.dtype if dtype is None else dtype
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
