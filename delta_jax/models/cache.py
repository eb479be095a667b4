"""The key/value cache.

PagedKVCache(k, v): the rollout engine's cache (Transformer.prefill_paged writes prompts into
it, Transformer.decode_paged decodes over it). One page pool per
layer, k[l] and v[l] of shape [num_kv_heads, num_pages, page_size, head_dim]: separate arrays, so
a layer's decode attention reads its own pool in place (no slice of a layer-stacked array), in
the layout the paged decode attention kernels read (kernels/paged_decode.py on Hopper GPUs,
attention.paged_decode_tpu on TPUs). Which pages hold a sequence's tokens is a block table owned
by the caller (delta_jax.sampling); page 0 is by convention a scratch page: the filler of unused
block-table entries, attended by no sequence (padding rows write nothing: attention.write_pages
drops rows with a negative page id).
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from delta_jax.models.config import ModelConfig


@flax.struct.dataclass
class PagedKVCache:
  k: tuple  # num_layers arrays [num_kv_heads, num_pages, page_size, head_dim]
  v: tuple

  @property
  def page_size(self) -> int:
    return self.k[0].shape[2]


def page_bytes(cfg: ModelConfig, page_size: int, dtype=None) -> int:
  """Bytes of one page in all layers, K and V."""
  dtype = cfg.dtype if dtype is None else dtype
  return (2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim
          * jnp.dtype(dtype).itemsize)


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None,
                     sharding=None) -> PagedKVCache:
  """A zero page pool per layer (dtype defaults to cfg.dtype); `sharding`: an optional
  jax.sharding.Sharding for each [K, P, page_size, D] array."""
  shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
  make = _zeros_program(shape, jnp.dtype(cfg.dtype if dtype is None else dtype), sharding)
  return PagedKVCache(k=tuple(make() for _ in range(cfg.num_layers)),
                      v=tuple(make() for _ in range(cfg.num_layers)))


@functools.lru_cache(maxsize=16)
def _zeros_program(shape, dtype, sharding):
  """A jitted maker of zeros, one per (shape, dtype, sharding): compiled once, not once per
  generate() (a fresh jax.jit of a fresh function is a fresh compile)."""
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
