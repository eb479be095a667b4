"""Causal grouped-query attention with interchangeable implementations behind one signature.

    out = attend(q, k, v, q_offset=0, kv_valid=mask, impl="auto")   # [B, T, N, D]

Shapes: q [B, T, N, D]; k, v [B, S, K, D] with N = K * G (grouped-query attention; k/v are never
repeated in memory: q is viewed as [B, T, K, G, D]). The mask is described, never passed in:

    query t (at cache slot q_offset + t) may attend key s  <=>
        kv_valid[b, s]  and  s <= q_offset + t

so the [B, T, S] mask and the [B, N, T, S] scores need not exist. Without a cache q_offset = 0 and
S = T; with a cache, q_offset is the slot of q[:, 0] (a traced int32 scalar is fine).
A query with no key to attend to (a "fully masked row") gets output 0 in every implementation.

Implementations (`impl`):
  "xla"        plain einsum + float32 softmax over the materialised [B, N, T, S] scores: the
               reference.
  "blockwise"  flash-style online softmax in plain jnp: lax.map over query blocks, lax.scan over
               key/value blocks keeping a running max, running sum and float32 accumulator; key
               blocks that the mask removes entirely are skipped (lax.cond), which changes nothing.
               A custom VJP recomputes the block scores in the backward pass from the saved
               log-sum-exp, so forward + backward memory is O(B N block_q block_kv) + O(B (T + S)
               N D), never O(T S).
  "cudnn"      jax.nn.dot_product_attention(implementation="cudnn") (NVIDIA GPUs, bf16/fp16,
               causal self-attention with q_offset == 0 and T == S: training and the old-policy
               pass). Arbitrary key padding is expressed exactly by moving each row's valid tokens
               to the front (a stable per-row permutation), running causal attention with
               key_value_seq_lengths, and moving them back. Outputs at query slots that are
               themselves invalid (padding) are 0 here, not the reference's mix; callers ignore
               them. Right-padded rows given as kv_lengths (or no mask at all) need no
               permutation: cuDNN's key lengths express them as they are, and the outputs are
               the reference's at every slot (attend_prefix_causal). The model's passes take
               that path: the rollout prefill's prompts are right-padded, and
               Transformer.__call__ moves each row's real tokens to its front once a pass
               (padding_order, permute_rows) rather than once a layer. Where cuDNN cannot
               express the call it falls back to "blockwise".
  "auto"       "cudnn" where supported, else "blockwise" when T * S > AUTO_BLOCKWISE_MIN_SCORES,
               else "xla" (short sequences and single-token decoding).

Decode against a page pool (paged_decode_attention; the rollout engine's decode step): one query
per sequence, keys/values in one layer's pool [K, P, page_size, D] addressed through a block table
and attended up to each sequence's length, read in place. "reference" is a jnp loop over blocks of
pages (CPU, CI, TPU, and GPUs the kernel does not serve); "mosaic" is delta_jax.kernels.paged_decode
(Pallas Mosaic GPU: TMA page copies and WGMMA, so Hopper GPUs only, bf16/fp16); "mosaic_fused"
is the same kernel with the rest of the layer's attention step in it where it takes the problem
(paged_write_attend: the q / k norms, RoPE and the new key / value written in place by
kernels.paged_decode.paged_write_decode_mosaic, head_dim 128 in bf16), by name only until it is
measured on a GPU (issue #16: a kernel is a default only where measured faster); "tpu" is
jax.experimental.pallas.ops.tpu's paged attention (Mosaic TPU, bf16; by name only: never run on
a TPU here, so not measured against the reader); "auto" picks "mosaic" on a Hopper GPU for the
problems it takes, else "reference". Forward only. (pallas.ops' Triton paged attention was retired
on 2026-11-26: Pallas' Triton backend is deprecated, issue #16.)

Numerics in every implementation: scores q.k accumulated in float32, scaled by D ** -0.5, softmax in
float32, probabilities cast to v.dtype for the value product (float32 accumulation; the "tpu" decode
kernel keeps them in float32).
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.models.norm import rms_norm
from delta_jax.models.rope import apply_rope

IMPLS = ("auto", "xla", "blockwise", "cudnn")
# Paged decode attention (the rollout engine's decode): implementations and block sizes.
DECODE_IMPLS = ("auto", "reference", "mosaic", "mosaic_fused", "tpu")
# The Mosaic GPU kernels' names (Hopper only).
MOSAIC_DECODE_IMPLS = ("mosaic", "mosaic_fused")
# Pages gathered per step of the reference loop (x page_size keys).
DECODE_PAGES_PER_BLOCK = 8
# "auto" switches from the materialised scores to blockwise above this many scores per (row, head):
# 2048 x 2048 float32 scores are 16 MiB per head per row.
AUTO_BLOCKWISE_MIN_SCORES = 2048 * 2048
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


# ---------------------------------------------------------------------------------------------
# Masks and checks


def _check_inputs(q, k, v, kv_valid):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"attend: q, k, v must be [B, T, N, D] / [B, S, K, D], got shapes "
                     f"{q.shape}, {k.shape}, {v.shape}")
  B, T, N, D = q.shape
  if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
    raise ValueError(f"attend: k {k.shape} and v {v.shape} must be [B={B}, S, K, D={D}]")
  if N % k.shape[2]:
    raise ValueError(f"attend: query heads ({N}) must be a multiple of key/value heads "
                     f"({k.shape[2]})")
  if kv_valid is not None and kv_valid.shape != (B, k.shape[1]):
    raise ValueError(f"attend: kv_valid must be [B, S] = {(B, k.shape[1])}, got "
                     f"{kv_valid.shape}")


def attention_mask(q_len: int, kv_valid: jax.Array, q_offset=0):
  """bool [B, T, S]: query t may attend key s (see the module docstring)."""
  S = kv_valid.shape[1]
  mask = jnp.broadcast_to(kv_valid.astype(bool)[:, None, :], (kv_valid.shape[0], q_len, S))
  q_slot = jnp.asarray(q_offset, jnp.int32) + jnp.arange(q_len, dtype=jnp.int32)
  return mask & (jnp.arange(S, dtype=jnp.int32)[None, :] <= q_slot[:, None])[None]


# ---------------------------------------------------------------------------------------------
# "xla": the reference


def attend_xla(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Materialised-scores attention. q [B, T, N, D]; k, v [B, S, K, D]; mask bool [B, T, S].

  Returns [B, T, N, D] in q.dtype; rows with no allowed key give 0.
  """
  B, T, N, D = q.shape
  K = k.shape[2]
  qg = q.reshape(B, T, K, N // K, D)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
  scores = scores * (D ** -0.5)
  allowed = mask[:, None, None, :, :]
  # A finite fill keeps the softmax NaN-free; zeroing afterwards makes empty rows exactly 0 (in a
  # row with any allowed key the masked probabilities underflow to 0 anyway).
  scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
  probs = jnp.where(allowed, jax.nn.softmax(scores, axis=-1), 0.0).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(B, T, N, D).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# "blockwise": online softmax over key blocks, custom VJP


def _to_blocks(x: jax.Array, num: int, size: int) -> jax.Array:
  """[B, num * size, ...] -> [num, B, size, ...]."""
  return jnp.moveaxis(x.reshape(x.shape[:1] + (num, size) + x.shape[2:]), 1, 0)


def _from_blocks(x: jax.Array) -> jax.Array:
  """[num, B, size, ...] -> [B, num * size, ...]."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[:1] + (x.shape[1] * x.shape[2],) + x.shape[3:])


def _pad_axis1(x: jax.Array, to: int, value=0) -> jax.Array:
  pad = to - x.shape[1]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


class _Blocks:
  """Blocked views of one attend() call's operands (padded to whole blocks)."""

  def __init__(self, q, k, v, q_offset, kv_valid, block_q, block_kv):
    B, T, N, D = q.shape
    S, K = k.shape[1], k.shape[2]
    self.shape = (B, T, N, D, S, K, N // K)
    self.bq, self.bkv = min(block_q, T), min(block_kv, S)
    self.nq, self.nk = -(-T // self.bq), -(-S // self.bkv)
    self.q_offset = q_offset
    self.scale = D ** -0.5
    qg = _pad_axis1(q, self.nq * self.bq).reshape(B, self.nq * self.bq, K, N // K, D)
    self.q = _to_blocks(qg, self.nq, self.bq)                               # [nq, B, bq, K, G, D]
    self.k = _to_blocks(_pad_axis1(k, self.nk * self.bkv), self.nk, self.bkv)  # [nk, B, bkv, K, D]
    self.v = _to_blocks(_pad_axis1(v, self.nk * self.bkv), self.nk, self.bkv)
    valid = _pad_axis1(kv_valid, self.nk * self.bkv, False)
    self.valid = _to_blocks(valid, self.nk, self.bkv)                       # [nk, B, bkv]

  def q_rows(self, x):
    """[B, T, N, ...] -> [nq, B, bq, K, G, ...] (padded)."""
    B, T, N, D, S, K, G = self.shape
    x = _pad_axis1(x, self.nq * self.bq)
    return _to_blocks(x.reshape((B, self.nq * self.bq, K, G) + x.shape[3:]), self.nq, self.bq)

  def tie(self, kj, vj, valid_j, i, j):
    """Block-loop operands, passed through one optimization barrier with the key block.

    Why: when attend() runs inside a differentiated outer scan (the model's layer scan), JAX
    hoists loop-invariant computations out of it, and the mask of every block pair depends only
    on (i, j, kv_valid, q_offset), which do not change from layer to layer: it would be computed
    ahead for all block pairs at once, i.e. materialised at [T, S]. Tying them to the key block
    keeps the mask inside the loops. (For the same reason the loop bodies use no broadcast
    constants of block size.)
    """
    return jax.lax.optimization_barrier((kj, vj, valid_j, i, j, self.q_offset))

  def needed(self, i, j, valid_j, q_offset):
    """Whether key block j can matter to query block i (else it is skipped; exact)."""
    last_q_slot = q_offset + (i + 1) * self.bq - 1
    return jnp.any(valid_j) & (j * self.bkv <= last_q_slot)

  def scores(self, qi, kj, i, j, valid_j, q_offset):
    """float32 [B, K, G, bq, bkv] scaled scores of blocks (i, j), -inf where not allowed."""
    q_slot = q_offset + i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)
    kv_slot = j * self.bkv + jnp.arange(self.bkv, dtype=jnp.int32)
    allowed = valid_j[:, None, :] & (kv_slot[None, :] <= q_slot[:, None])[None]
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32)
    # log(1) = 0, log(0) = -inf: the mask as an additive term, without a broadcast constant.
    return s * self.scale + jnp.log(allowed.astype(jnp.float32))[:, None, None, :, :]


def _blockwise_forward(q, k, v, q_offset, kv_valid, block_q, block_kv):
  """Returns out [B, T, N, D] (q.dtype) and lse [nq, B, K, G, bq] (float32; +inf on empty rows)."""
  blk = _Blocks(q, k, v, q_offset, kv_valid, block_q, block_kv)
  B, T, N, D, S, K, G = blk.shape
  kv_xs = (blk.k, blk.v, blk.valid, jnp.arange(blk.nk, dtype=jnp.int32))

  def query_block(args):
    qi, i = args

    def kv_step(carry, xs):
      kj, vj, valid_j, i_, j, q_offset = blk.tie(*xs[:3], i, xs[3])

      def update(carry):
        s = blk.scores(qi, kj, i_, j, valid_j, q_offset)
        return _online_softmax_step(carry, s, vj, "bkgqs,bskd->bkgqd")

      return jax.lax.cond(blk.needed(i_, j, valid_j, q_offset), update, lambda c: c,
                          carry), None

    init = (jnp.full((B, K, G, blk.bq), -jnp.inf, jnp.float32),
            jnp.zeros((B, K, G, blk.bq), jnp.float32),
            jnp.zeros((B, K, G, blk.bq, D), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(kv_step, init, kv_xs)
    out, nonempty = _online_softmax_result(l, acc)
    lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), jnp.inf)
    return out.astype(q.dtype), lse

  out, lse = jax.lax.map(query_block, (blk.q, jnp.arange(blk.nq, dtype=jnp.int32)))
  # out [nq, B, K, G, bq, D] -> [B, T, N, D]
  out = jnp.moveaxis(out, 4, 2).reshape(blk.nq, B, blk.bq, N, D)
  return _from_blocks(out)[:, :T], lse


def _blockwise_backward(q, k, v, q_offset, kv_valid, out, lse, dout, block_q, block_kv):
  """Flash-attention backward: recompute block scores, p = exp(s - lse)."""
  blk = _Blocks(q, k, v, q_offset, kv_valid, block_q, block_kv)
  B, T, N, D, S, K, G = blk.shape
  # delta = rowsum(dout * out): the softmax backward's per-query term.
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  delta_b = jnp.moveaxis(blk.q_rows(delta), 2, 4)                         # [nq, B, K, G, bq]
  do_b = blk.q_rows(dout.astype(q.dtype))                                 # [nq, B, bq, K, G, D]
  kv_xs = (blk.k, blk.v, blk.valid, jnp.arange(blk.nk, dtype=jnp.int32))
  kv_zeros = jnp.zeros((B, blk.bkv, K, D), jnp.float32)

  def query_block(carry, xs):
    dk_acc, dv_acc = carry
    qi, doi, lse_i, delta_i, i = xs

    def kv_step(dq, xs):
      kj, vj, valid_j, i_, j, q_offset = blk.tie(*xs[:3], i, xs[3])

      def grads(dq):
        s = blk.scores(qi, kj, i_, j, valid_j, q_offset)
        p = jnp.exp(s - lse_i[..., None])  # 0 where masked (s = -inf) or the row is empty
        dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(doi.dtype), doi,
                        preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_i[..., None]) * blk.scale).astype(qi.dtype)
        dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=jnp.float32)
        return dq, (dk, dv)

      return jax.lax.cond(blk.needed(i_, j, valid_j, q_offset), grads,
                          lambda dq: (dq, (kv_zeros, kv_zeros)), dq)

    dq, (dk, dv) = jax.lax.scan(kv_step, jnp.zeros((B, blk.bq, K, G, D), jnp.float32), kv_xs)
    return (dk_acc + dk, dv_acc + dv), dq

  acc0 = jnp.zeros((blk.nk, B, blk.bkv, K, D), jnp.float32)
  (dk, dv), dq = jax.lax.scan(
      query_block, (acc0, acc0),
      (blk.q, do_b, lse, delta_b, jnp.arange(blk.nq, dtype=jnp.int32)))
  dq = _from_blocks(dq.reshape(blk.nq, B, blk.bq, N, D))[:, :T]
  dk, dv = _from_blocks(dk)[:, :S], _from_blocks(dv)[:, :S]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _online_softmax_step(carry, s, v, pv_subscripts: str):
  """One key block of flash-style attention: fold float32 scores s [..., keys] (-inf = not
  allowed) and values v into the running (max m, sum l, weighted values acc) carry;
  pv_subscripts contracts p [..., keys] with v into acc's shape."""
  m, l, acc = carry
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  # Finite where the row has seen no allowed key yet: no (-inf) - (-inf) below.
  m_safe = jnp.maximum(m_new, jnp.finfo(jnp.float32).min)
  p = jnp.exp(s - m_safe[..., None])
  correction = jnp.exp(m - m_safe)
  l = l * correction + jnp.sum(p, axis=-1)
  pv = jnp.einsum(pv_subscripts, p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return m_new, l, acc * correction[..., None] + pv


def _online_softmax_result(l, acc):
  """(acc / l, 0 for rows that saw no allowed key; the mask of rows that did)."""
  nonempty = l > 0
  out = jnp.where(nonempty[..., None], acc / jnp.where(nonempty, l, 1.0)[..., None], 0.0)
  return out, nonempty


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _blockwise(q, k, v, q_offset, kv_valid, block_q, block_kv):
  return _blockwise_forward(q, k, v, q_offset, kv_valid, block_q, block_kv)[0]


def _blockwise_fwd(q, k, v, q_offset, kv_valid, block_q, block_kv):
  out, lse = _blockwise_forward(q, k, v, q_offset, kv_valid, block_q, block_kv)
  return out, (q, k, v, q_offset, kv_valid, out, lse)


def _blockwise_bwd(block_q, block_kv, res, dout):
  q, k, v, q_offset, kv_valid, out, lse = res
  dq, dk, dv = _blockwise_backward(q, k, v, q_offset, kv_valid, out, lse, dout, block_q,
                                   block_kv)
  return dq, dk, dv, None, None  # the offset and the mask have no cotangent


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def attend_blockwise(q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset=0,
                     kv_valid: Optional[jax.Array] = None, block_q: int = 512,
                     block_kv: int = 512) -> jax.Array:
  """Memory-efficient causal attention (see the module docstring); differentiable in q, k, v.

  q [B, T, N, D]; k, v [B, S, K, D]; kv_valid bool [B, S] (None = all valid).
  Block sizes are clipped to T / S; T and S need not be multiples of them.
  """
  _check_inputs(q, k, v, kv_valid)
  if kv_valid is None:
    kv_valid = jnp.ones(k.shape[:2], bool)
  return _blockwise(q, k, v, jnp.asarray(q_offset, jnp.int32), kv_valid.astype(bool),
                    int(block_q), int(block_kv))


# ---------------------------------------------------------------------------------------------
# Paged decode: one query per sequence against a page pool, read in place


def check_paged_decode_inputs(q, k_pages, v_pages, block_tables, lengths,
                              who: str = "paged_decode") -> None:
  """The shapes of the paged decode contract (paged_decode_reference's docstring), or a
  ValueError naming the tensors."""
  B, N, D = q.shape
  K = k_pages.shape[0]
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[-1] != D or N % K:
    raise ValueError(f"{who}: q {q.shape}, k_pages {k_pages.shape}, v_pages "
                     f"{v_pages.shape} must be [B, N, D], [K, P, page_size, D] with N % K == 0")
  if block_tables.ndim != 2 or block_tables.shape[0] != B or lengths.shape != (B,):
    raise ValueError(f"{who}: block_tables {block_tables.shape} must be [B={B}, pages] "
                     f"and lengths {lengths.shape} [B]")


def paged_decode_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, lengths: jax.Array, *,
                           pages_per_block: int = DECODE_PAGES_PER_BLOCK) -> jax.Array:
  """Decode attention of one query per sequence over its pages (the jnp path: CPU, CI, TPU).

  q [B, N, D]; k_pages, v_pages [K, P, page_size, D] (one layer's page pool, the layout the
  Mosaic GPU kernel reads); block_tables int32 [B, pages_per_seq]: sequence b's token t lives at
  page block_tables[b, t // page_size], offset t % page_size; lengths int32 [B]: sequence b
  attends its tokens [0, lengths[b]) (0 = none: output 0).
  A lax.fori_loop over blocks of `pages_per_block` pages with a traced trip count (the longest
  length): each step gathers one block of pages per sequence straight out of the pool (no copy
  of the pool, no page past the longest live length is read) and updates an online softmax.
  Numerics as attend(): scores q.k accumulated in float32, scaled by D ** -0.5, softmax in
  float32, probabilities cast to v's dtype for the value product (float32 accumulation).
  Returns [B, N, D] in q.dtype.
  """
  check_paged_decode_inputs(q, k_pages, v_pages, block_tables, lengths)
  B, N, D = q.shape
  K, _, page_size, _ = k_pages.shape
  G = N // K
  ppb = max(1, min(int(pages_per_block), block_tables.shape[1]))
  num_blocks = -(-block_tables.shape[1] // ppb)
  tables = jnp.pad(block_tables, ((0, 0), (0, num_blocks * ppb - block_tables.shape[1])))
  lengths = lengths.astype(jnp.int32)
  block_len = ppb * page_size
  trips = jnp.minimum((jnp.max(lengths) + block_len - 1) // block_len, num_blocks)
  qg = q.reshape(B, K, G, D)

  def step(j, carry):
    pages = jax.lax.dynamic_slice_in_dim(tables, j * ppb, ppb, axis=1)          # [B, ppb]
    kj = k_pages[:, pages].reshape(K, B, block_len, D).astype(q.dtype)       # [K, B, s, D]
    vj = v_pages[:, pages].reshape(K, B, block_len, D)
    s = jnp.einsum("bkgd,kbsd->bkgs", qg, kj, preferred_element_type=jnp.float32)
    slot = j * block_len + jnp.arange(block_len, dtype=jnp.int32)
    allowed = (slot[None, :] < lengths[:, None])[:, None, None, :]               # [B, 1, 1, s]
    s = jnp.where(allowed, s * (D ** -0.5), -jnp.inf)
    return _online_softmax_step(carry, s, vj, "bkgs,kbsd->bkgd")

  init = (jnp.full((B, K, G), -jnp.inf, jnp.float32), jnp.zeros((B, K, G), jnp.float32),
          jnp.zeros((B, K, G, D), jnp.float32))
  _, l, acc = jax.lax.fori_loop(jnp.int32(0), trips, step, init)
  out, _ = _online_softmax_result(l, acc)
  return out.reshape(B, N, D).astype(q.dtype)


def paged_decode_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                     block_tables: jax.Array, lengths: jax.Array, *,
                     pages_per_block: int = DECODE_PAGES_PER_BLOCK) -> jax.Array:
  """The same contract through jax.experimental.pallas.ops.tpu.paged_attention (Pallas Mosaic TPU:
  one program per (sequence, KV head) walking its live pages in blocks of pages_per_block pages,
  the next block's pages copied while this one is computed; rows of length 0 are skipped).

  The kernel takes this module's pool layout as it is ([K, P, page_size, D], block tables
  [B, pages_per_seq]) and reads keys and values as bfloat16 (it casts what it loads), so it
  serves bfloat16 pools only (a ValueError otherwise). It scores q.k without the 1 / sqrt(D)
  scale and in float32: q goes in float32, already scaled, so the scale is applied in float32 as
  in the reference. Its probabilities stay float32 in the value product (the reference casts
  them to v's dtype: the two differ by bf16 rounding). Outputs of rows of length 0 are 0 (the
  kernel leaves them unwritten). The compute block is the largest divisor of pages_per_seq that
  is at most pages_per_block (the kernel needs one that divides it).
  Not run on a TPU here: its numbers are checked by Pallas' TPU interpreter on the CPU, its
  lowering for a TPU by jax.export and its compile by libtpu's TPU compiler for a v5p slice
  without one, in the decode program (tests/test_attention.py, tests/tpu_compile.py). The
  kernel's megacore_mode is left unset: on chips with two TensorCores per device (v4, v5p) it runs
  on one of them (setting it where a chip has one core can hang the kernel, says its documentation,
  and none was at hand to tell the kinds apart)."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

  check_paged_decode_inputs(q, k_pages, v_pages, block_tables, lengths, "paged_decode_tpu")
  if k_pages.dtype != jnp.bfloat16 or v_pages.dtype != jnp.bfloat16:
    raise ValueError(f"paged_decode_tpu: the kernel reads keys and values as bfloat16; the pools "
                     f"are {k_pages.dtype} / {v_pages.dtype}")
  pages_per_seq = block_tables.shape[1]
  per_block = max(d for d in range(1, max(1, min(int(pages_per_block), pages_per_seq)) + 1)
                  if pages_per_seq % d == 0)
  lengths = lengths.astype(jnp.int32)
  scaled = q.astype(jnp.float32) * (q.shape[-1] ** -0.5)
  # The kernel multiplies its float32 q by the bfloat16 keys it loads, which Mosaic TPU compiles
  # only at the default precision: under jax_default_matmul_precision "highest" / "float32" it
  # refuses the product ("Bad rhs type"), so the kernel is traced at the default whatever the
  # caller's setting (tests/test_attention.py compiles it for a TPU under "highest").
  with jax.default_matmul_precision("default"):
    out = tpu_paged(scaled, k_pages, v_pages, lengths, block_tables.astype(jnp.int32),
                    pages_per_compute_block=per_block)
  return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)


def resolve_decode_impl(impl: str, *, dtype=None, head_dim: Optional[int] = None,
                        page_size: Optional[int] = None, group: Optional[int] = None) -> str:
  """The decode attention that runs for rollout.decode_attention `impl` on this backend.

  "auto": "mosaic" (delta_jax.kernels.paged_decode, the project's Mosaic GPU kernel) on a Hopper
  GPU when the kernel takes the problem (the q dtype, head_dim, page_size and query heads per KV
  head `group`, given here: without them "auto" never picks it), else "reference" (the jnp page
  reader), with a warning on a CUDA GPU (slower there; the Mosaic kernel's requirements named).
  Measured on one H200 (2026-11-26, Qwen3-0.6B shape, bf16, batch 64 / 256, prompt 512 + 1,024
  tokens): the Mosaic kernel 80 / 302 us a layer call against 126 / 440 us for pallas.ops'
  (Triton) kernel, itself 2.0-2.3x the reader's speed on an H100 (BENCHMARKS.md "Kernel
  decisions"). "mosaic" and "mosaic_fused" by name only on a Hopper GPU (refused here, at
  start-up, rather than in the compiler); whether the kernel takes the problem is the caller's
  check (the Sampler's, at start-up). "mosaic_fused" resolves to itself: paged_write_attend runs
  the fused step where fused_write_attend holds, the attention reads as "mosaic" elsewhere.
  "tpu" (paged_decode_tpu) by name only on a TPU and for a bfloat16 model: "auto" does not pick
  it there, as it has not been measured against the reader.
  """
  if impl not in DECODE_IMPLS:
    raise ValueError(f"paged decode attention impl (rollout.decode_attention) must be one of "
                     f"{DECODE_IMPLS}, got {impl!r}")
  if impl == "auto":
    if not _cuda_backend():
      return "reference"
    if _hopper() and _mosaic_takes(dtype, head_dim, page_size, group):
      return "mosaic"
    # Python's default warning filter shows it once per calling line, not at every trace.
    warnings.warn("rollout.decode_attention 'auto' runs the jnp page reader ('reference') on this "
                  "GPU: the Mosaic GPU kernel ('mosaic') needs a Hopper GPU (compute capability "
                  "9.x), a bfloat16 / float16 model, a head_dim multiple of 64 and pages of a "
                  "multiple of 32 tokens (the reader measured 2.0-2.3x slower than a GPU kernel "
                  "on an H100)",
                  RuntimeWarning, stacklevel=2)
    return "reference"
  if impl in MOSAIC_DECODE_IMPLS and not _hopper():
    raise ValueError(f"paged decode attention {impl!r} (rollout.decode_attention) is a Mosaic "
                     f"GPU kernel for NVIDIA Hopper GPUs (compute capability 9.x: it issues "
                     f"WGMMA); here the device is {_device_name()}: use 'auto' or 'reference'")
  if impl == "tpu" and not _tpu_backend():
    raise ValueError(f"paged decode attention 'tpu' (rollout.decode_attention) is "
                     f"jax.experimental.pallas.ops.tpu's Mosaic TPU kernel; here the device is "
                     f"{_device_name()}: use 'auto' or 'reference'")
  if impl == "tpu" and dtype is not None and jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(f"paged decode attention 'tpu' (rollout.decode_attention) reads keys and "
                     f"values as bfloat16; the model computes in {jnp.dtype(dtype).name} "
                     f"(model.dtype): use 'reference'")
  return impl


def _mosaic_takes(dtype, head_dim, page_size, group) -> bool:
  """Whether the Mosaic GPU kernel, at its default parameters, runs this problem (False when any
  part of it is not given)."""
  if None in (dtype, head_dim, page_size, group):
    return False
  from delta_jax.kernels import paged_decode
  return paged_decode.config_problem(dtype, head_dim, page_size, group) is None


def _hopper() -> bool:
  """A CUDA GPU of compute capability 9.x: TMA and WGMMA (Blackwell, 10.x and up, has TMA but
  not WGMMA, and the Mosaic kernel issues WGMMA)."""
  if not _cuda_backend():
    return False
  try:
    return 9.0 <= float(_default_device().compute_capability) < 10.0
  except (AttributeError, ValueError, TypeError):
    return False


def _tpu_backend() -> bool:
  """Whether computations traced now run on a TPU (_default_device)."""
  device = _default_device()
  return device is not None and device.platform == "tpu"


def _device_name() -> str:
  """The default device, for messages: its kind and compute capability where it has one."""
  device = _default_device()
  if device is None:
    return "none"
  capability = getattr(device, "compute_capability", None)
  return (f"{getattr(device, 'device_kind', device.platform)!r}"
          + (f" (compute capability {capability})" if capability else ""))


def decode_splits(splits: int, rows: int, num_kv_heads: int) -> int:
  """The Mosaic GPU decode kernel's k_splits for a call of `rows` rows (rollout.decode_splits):
  `splits` itself when >= 1; 0 = kernels.paged_decode.auto_splits for the call's rows and KV
  heads on the default device's SMs (one split where the device does not say how many)."""
  if isinstance(splits, bool) or not isinstance(splits, (int, np.integer)) or splits < 0:
    raise ValueError(f"decode splits must be an int >= 0 (0 = auto), got {splits!r}")
  if splits >= 1:
    return int(splits)
  cores = _sm_count()
  if cores is None:
    return 1
  from delta_jax.kernels.paged_decode import auto_splits
  return auto_splits(rows, num_kv_heads, cores)


def _sm_count() -> Optional[int]:
  """The default device's streaming multiprocessors (a GPU's core_count; a compile-only GPU
  device has it too), or None where it has none (a CPU)."""
  cores = getattr(_default_device(), "core_count", None)
  if isinstance(cores, bool) or not isinstance(cores, (int, np.integer)) or cores < 1:
    return None
  return int(cores)


def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, rope=None,
                           impl: str = "auto",
                           pages_per_block: int = DECODE_PAGES_PER_BLOCK,
                           splits: int = 1) -> jax.Array:
  """Decode attention over a page pool (see paged_decode_reference for the contract).
  rope: None, or (cos, sin) [B, D] each: q is rotated by them first (rope.apply_rope; the Mosaic
  kernel does it in its prologue). impl: "auto" | "reference" | "mosaic" | "mosaic_fused" |
  "tpu" (resolve_decode_impl; "mosaic_fused" reads as "mosaic" here: the fusion is
  paged_write_attend's); pages_per_block: the reader's block of pages, and the TPU kernel's
  compute block; splits: the Mosaic kernel's splits of each row's pages (decode_splits: >= 1,
  or 0 = auto; the other implementations have none)."""
  chosen = resolve_decode_impl(impl, dtype=q.dtype, head_dim=q.shape[-1],
                               page_size=k_pages.shape[2], group=q.shape[1] // k_pages.shape[0])
  if chosen in MOSAIC_DECODE_IMPLS:
    from delta_jax.kernels.paged_decode import paged_decode_mosaic
    return paged_decode_mosaic(q, k_pages, v_pages, block_tables, lengths, rope=rope,
                               k_splits=decode_splits(splits, q.shape[0], k_pages.shape[0]))
  if rope is not None:
    q = apply_rope(q, *rope)
  if chosen == "reference":
    return paged_decode_reference(q, k_pages, v_pages, block_tables, lengths,
                                  pages_per_block=pages_per_block)
  return paged_decode_tpu(q, k_pages, v_pages, block_tables, lengths,
                          pages_per_block=pages_per_block)


def drop_negative(pages: jax.Array, num_pages: int) -> jax.Array:
  """Page ids [N] for a scatter into a pool of num_pages pages that drops out-of-range entries:
  a negative id (a row not to write) becomes num_pages + n, out of range and unlike any other
  entry, so the scatter can be told its indices are unique."""
  return jnp.where(pages >= 0, pages, num_pages + jnp.arange(pages.shape[0], dtype=pages.dtype))


def write_pages(pool: jax.Array, pages: jax.Array, offsets: jax.Array,
                values: jax.Array) -> jax.Array:
  """pool [K, P, page_size, D] with values [N, K, D] written at (pages[n], offsets[n]); rows with
  pages[n] < 0 are not written. The written (page, offset) pairs must be distinct (the rollout
  engine's are: a token position of one sequence each): the scatter is told its indices are
  unique. (Writing every padding row to one scratch slot instead made XLA:GPU's scatter 2x
  slower when most rows were padding: 5-6 us against 2.7-3.2 us a layer on an H200,
  2026-11-26, long-tailed workload at batch 64.)

  Each (head, page, offset) is an index of its own and each write a row of D: written as one
  [K, D] window per (page, offset), the scatter made the TPU compiler lay the pool out with its
  page axis major (the window minor), so a decode program copied every pool into that layout at
  each call and back at every step (compiled for a v5p without one, Qwen3-0.6B at 64 slots:
  10.75 GiB of temporaries, now 0.35; tests/test_attention.py). Compiled for an H100, the
  decode program keeps its kernels and temporaries (BENCHMARKS.md, 2026-11-28)."""
  K = pool.shape[0]
  heads = jnp.arange(K, dtype=jnp.int32)[:, None]
  return pool.at[heads, drop_negative(pages, pool.shape[1])[None, :], offsets[None, :]].set(
      jnp.swapaxes(values, 0, 1).astype(pool.dtype), mode="drop", unique_indices=True)


def write_prompt_pages(pool: jax.Array, values: jax.Array, pages: jax.Array, offsets: jax.Array,
                       *, mesh=None, batch_axes=()) -> jax.Array:
  """pool [K, P, page_size, D] with values [B, T, K, D] (one layer's keys or values of B
  prompts) written at (pages[b, t], offsets[b, t]) (int32 [B, T]; page -1: not written; the
  written pairs distinct, write_pages). With a mesh and batch_axes, per batch shard on its own
  pages (shard_pages: rows and pages over the batch axes, shard-local page ids)."""
  def local(pool, values, pages, offsets):  # this shard's rows, KV heads and pages
    b, t, k, d = values.shape
    return write_pages(pool, pages.reshape(b * t), offsets.reshape(b * t),
                       values.reshape(b * t, k, d))

  if mesh is None or not batch_axes:
    return local(pool, values, pages, offsets)
  # values as a one-layer stack: shard_pages' "stack" kind splits its rows over the batch axes
  # and its KV heads as the pool's
  return shard_pages(lambda pool, values, pages, offsets: local(pool, values[0], pages, offsets),
                     mesh, batch_axes, pool.shape[0], ("pool", "stack", "rows", "rows"),
                     "pool")(pool, values[None], pages, offsets)


def pool_specs(mesh, batch_axes, num_kv_heads: int):
  """(page pool spec, kv head mesh axis or None) of a pool split over the batch shards: the
  page axis over `batch_axes`, the KV heads over "tensor" when it divides them."""
  from jax.sharding import PartitionSpec
  head = None
  if "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1 \
      and num_kv_heads % mesh.shape["tensor"] == 0:
    head = "tensor"
  return PartitionSpec(head, tuple(batch_axes), None, None), head


def shard_pages(fn, mesh, batch_axes, num_kv_heads: int, in_kinds, out_kinds):
  """fn run per batch shard (jax.shard_map over the whole mesh) on a page pool split over the
  batch shards: fn sees its shard's pages (LOCAL page ids) and its shard's rows, so no page
  leaves its device. Kinds name each argument / result's layout: "pool" [K, P, ps, D] (pages
  over the batch axes, heads over "tensor" where it divides them), "rows" (dim 0 over the batch
  axes), "heads" ([B, heads, D]: rows over the batch axes, heads like the pool's),
  "stack" ([L, B, T, K, D]: rows over the batch axes, K like the pool's), "qkv"
  ([B, K, G + 2, D]: rows over the batch axes, K like the pool's), "all" (replicated); a tuple
  of kinds for a tuple argument."""
  from jax.sharding import PartitionSpec as P
  pool, head = pool_specs(mesh, batch_axes, num_kv_heads)
  rows = tuple(batch_axes)
  specs = {"pool": pool, "rows": P(rows), "heads": P(rows, head, None),
           "stack": P(None, rows, None, head, None), "qkv": P(rows, head, None, None),
           "all": P()}

  def spec(kind):
    if isinstance(kind, (tuple, list)):
      return tuple(spec(k) for k in kind)
    return None if kind is None else specs[kind]  # None: an argument that is None

  # check_vma=False: a Pallas call's outputs carry no varying-axes annotation (every input and
  # output here is split over the batch axes or replicated where it is the same everywhere).
  return jax.shard_map(fn, mesh=mesh, in_specs=spec(tuple(in_kinds)),
                       out_specs=spec(out_kinds), check_vma=False)


def fused_write_attend(impl: str, q_dtype, pool_dtype, head_dim: int, page_size: int,
                       group: int, rope: bool) -> bool:
  """Whether paged_write_attend runs as one kernel (kernels.paged_decode.paged_write_decode_mosaic)
  for decode attention `impl` as resolved (resolve_decode_impl): "mosaic_fused" (asked for by
  name: not measured on a GPU yet, so "auto" and "mosaic" keep the unfused step), with rope, a
  pool in q's dtype and a head the fused kernel takes (config_problem(fused=True): head_dim 128
  in bf16)."""
  if impl != "mosaic_fused" or not rope or jnp.dtype(q_dtype) != jnp.dtype(pool_dtype):
    return False
  from delta_jax.kernels import paged_decode
  return paged_decode.config_problem(q_dtype, head_dim, page_size, group, fused=True) is None


def paged_write_attend(qkv, k_pages, v_pages, write_page, write_offset, block_tables, lengths,
                       *, rope=None, qk_norm=None, eps: float = 1e-6, impl: str = "auto",
                       pages_per_block: int = DECODE_PAGES_PER_BLOCK, splits: int = 1,
                       mesh=None, batch_axes=()):
  """One decode step of one layer, from its projections of each row's new token, qkv
  [B, K, G + 2, D] (KV head h's G queries, query head h G + g at qkv[:, h, g], then its new key
  qkv[:, h, G] and value qkv[:, h, G + 1]: models.Transformer.decode_layers' qkv_proj). q and
  k are first normalised (qk_norm = (q_norm, k_norm), [D] weights each: norm.rms_norm over each
  head with eps, when given) and rotated by rope = (cos, sin) [B, D] each (when given); the key
  and value are written at (write_page[b], write_offset[b]) of the layer's pools (page -1: not
  written), then paged_decode_attention of q over block_tables / lengths (lengths[b] counts the
  new token). splits: the Mosaic kernels' splits of each row's pages (decode_splits, with the
  rows of each batch shard). Returns (out [B, N, D], k_pages, v_pages).

  With impl "mosaic_fused" (where fused_write_attend holds) all of it is one Mosaic GPU kernel,
  paged_write_decode_mosaic, which writes the pools in place; otherwise XLA normalises, rotates
  k and writes (write_pages), and the attention (for "mosaic", the Mosaic GPU kernel) rotates q.

  With a mesh and batch_axes, the pools' page axis is split over the batch axes (shard j owns
  pages [j * P / S, (j + 1) * P / S)), the rows are split the same way, and write_page /
  block_tables hold LOCAL page ids: the write and the attention run per shard (shard_map), so
  no pool page is gathered or moved across devices."""
  if qkv.ndim != 4 or qkv.shape[2] < 3 or qkv.shape[1] != k_pages.shape[0]:
    raise ValueError(f"paged_write_attend: qkv {qkv.shape} must be [B, K, G + 2, D] with the "
                     f"pools' K = {k_pages.shape[0]} KV heads")
  G, D = qkv.shape[2] - 2, qkv.shape[3]
  chosen = resolve_decode_impl(impl, dtype=qkv.dtype, head_dim=D, page_size=k_pages.shape[2],
                               group=G)
  fused = fused_write_attend(chosen, qkv.dtype, k_pages.dtype, D, k_pages.shape[2], G,
                             rope is not None)

  def local(qkv, k_pages, v_pages, write_page, write_offset, block_tables, lengths, rope,
            qk_norm):
    if fused:
      from delta_jax.kernels.paged_decode import paged_write_decode_mosaic
      return paged_write_decode_mosaic(
          qkv, k_pages, v_pages, block_tables, lengths, write_page, write_offset, rope=rope,
          q_norm=None if qk_norm is None else qk_norm[0],
          k_norm=None if qk_norm is None else qk_norm[1], eps=eps,
          k_splits=decode_splits(splits, qkv.shape[0], k_pages.shape[0]))
    q = qkv[:, :, :G].reshape(qkv.shape[0], -1, D)
    k_new, v_new = qkv[:, :, G], qkv[:, :, G + 1]
    if qk_norm is not None:
      q, k_new = rms_norm(q, qk_norm[0], eps), rms_norm(k_new, qk_norm[1], eps)
    if rope is not None:
      k_new = apply_rope(k_new, *rope)
    k_pages = write_pages(k_pages, write_page, write_offset, k_new)
    v_pages = write_pages(v_pages, write_page, write_offset, v_new)
    out = paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, rope=rope,
                                 impl=impl, pages_per_block=pages_per_block, splits=splits)
    return out, k_pages, v_pages

  args = (qkv, k_pages, v_pages, write_page, write_offset, block_tables, lengths, rope, qk_norm)
  if mesh is None or not batch_axes:
    return local(*args)
  return shard_pages(local, mesh, batch_axes, k_pages.shape[0],
                     ("qkv", "pool", "pool", "rows", "rows", "rows", "rows",
                      None if rope is None else ("rows", "rows"),
                      None if qk_norm is None else ("all", "all")),
                     ("heads", "pool", "pool"))(*args)


# ---------------------------------------------------------------------------------------------
# "cudnn"


def _default_device():
  """The device a computation traced now runs on unless its inputs are placed elsewhere: JAX's
  default device (jax.default_device, a device or a platform name) where one is set, else the
  first device. None where that platform has no device."""
  device = jax.config.jax_default_device
  try:
    if device is None:
      return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device
  except RuntimeError:
    return None


def _cuda_backend() -> bool:
  """Whether computations traced now run on a CUDA GPU (_default_device: under
  jax.default_device(cpu) on a GPU machine they run on the CPU, which must not get cuDNN or the
  GPU kernels). A CUDA client's platform version names CUDA; a compile-only client's (a
  deviceless compile for a GPU described by a target config, benchmarks/gpu_program.py) does
  not, and its device is known by its NVIDIA device kind."""
  device = _default_device()
  if device is None or device.platform != "gpu":
    return False
  return ("cuda" in str(getattr(device.client, "platform_version", "")).lower()
          or str(getattr(device, "device_kind", "")).startswith("NVIDIA"))


def cudnn_supported(q_shape, dtype, *, q_offset, kv_len: int,
                    cuda: Optional[bool] = None) -> bool:
  """Whether the "cudnn" path can express this call exactly on the current backend (`cuda`:
  whether that is a CUDA GPU; None = look, plan mode passes its target's answer)."""
  T, D = q_shape[1], q_shape[3]
  static_zero_offset = isinstance(q_offset, (int, np.integer)) and int(q_offset) == 0
  cuda = _cuda_backend() if cuda is None else cuda
  return (cuda and jnp.dtype(dtype) in [jnp.dtype(d) for d in _CUDNN_DTYPES]
          and static_zero_offset and T == kv_len and D % 8 == 0 and D <= 128)


def attend_prefix_causal(q: jax.Array, k: jax.Array, v: jax.Array,
                         kv_lengths: Optional[jax.Array]) -> jax.Array:
  """Causal self-attention (T == S, offset 0) over rows whose valid tokens are their first
  kv_lengths[b] (left-aligned, right-padded: the rollout prefill's prompts; None: every token),
  through jax.nn.dot_product_attention's key-length masks as they are: no permutation.

  The result is the reference's at every query slot: one past a row's length attends the row's
  valid keys, as the reference's mask has it, and a row with no valid key gives 0 (cuDNN gets
  one key for it, whose value is set to 0 by an elementwise select that XLA fuses into the copy
  of v cuDNN reads anyway; a dynamic-update-slice of that one row instead tripled the
  prefill's temporaries at 64 x 512 tokens, compiled for an H100).
  """
  if kv_lengths is None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  S = k.shape[1]
  lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, S)
  first_of_empty = (lengths == 0)[:, None] & (jnp.arange(S) == 0)[None, :]
  v = jnp.where(first_of_empty[:, :, None, None], jnp.zeros((), v.dtype), v)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                      key_value_seq_lengths=jnp.maximum(lengths, 1),
                                      implementation="cudnn")


def _take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[b, index[b, t]] along axis 1; x [B, T, ...], index int [B, T]."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


@jax.custom_vjp
def permute_rows(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
  """x[b, order[b, t]] along axis 1 (x [B, T, ...]), order int [B, T] a permutation of each row
  and inverse its inverse (padding_order). Its VJP is the inverse gather: JAX's own transposes a
  gather to a scatter-add (on a GPU a zeroed buffer and atomic adds)."""
  return _take_rows(x, order)


def _permute_rows_fwd(x, order, inverse):
  return _take_rows(x, order), inverse


def _permute_rows_bwd(inverse, g):
  return _take_rows(g, inverse), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def padding_order(valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(order, inverse, lengths) for rows of any padding, valid bool [B, T]: order moves each
  row's valid tokens to its front in their order (a stable permutation, permute_rows(x, order,
  inverse)), inverse moves them back, lengths int32 [B] counts them. So "key s is valid and
  s <= t" becomes "key index < lengths[b] and index <= query index" (attend(kv_lengths=))."""
  valid = valid.astype(bool)
  order = jnp.argsort(jnp.logical_not(valid).astype(jnp.int8), axis=1, stable=True)
  return order, jnp.argsort(order, axis=1), jnp.sum(valid, axis=1, dtype=jnp.int32)


def attend_packed_causal(q: jax.Array, k: jax.Array, v: jax.Array,
                         kv_valid: jax.Array) -> jax.Array:
  """Causal self-attention (T == S, offset 0) with arbitrary padding through cuDNN's key
  lengths: each row's valid tokens moved to its front in order (padding_order, a stable
  permutation), attended by key lengths (attend_prefix_causal), moved back; the output at invalid
  query slots is 0. attend(kv_valid=) takes this path with cuDNN; the model's own passes move
  their rows once a pass instead (Transformer.__call__).
  """
  valid = kv_valid.astype(bool)
  order, inverse, lengths = padding_order(valid)
  out = attend_prefix_causal(*(permute_rows(x, order, inverse) for x in (q, k, v)), lengths)
  out = permute_rows(out, inverse, order)
  return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))


# ---------------------------------------------------------------------------------------------
# Dispatch


def resolve_impl(impl: str, q_shape, dtype, *, kv_len: int, q_offset=0,
                 cuda: Optional[bool] = None) -> str:
  """The implementation attend() will run: "xla", "blockwise" or "cudnn" (`cuda`: as
  cudnn_supported; None = this backend)."""
  if impl not in IMPLS:
    raise ValueError(f"attend: impl must be one of {IMPLS}, got {impl!r}")
  if impl in ("auto", "cudnn") and cudnn_supported(q_shape, dtype, q_offset=q_offset,
                                                    kv_len=kv_len, cuda=cuda):
    return "cudnn"
  if impl == "auto":
    return "blockwise" if q_shape[1] * kv_len > AUTO_BLOCKWISE_MIN_SCORES else "xla"
  if impl == "cudnn":  # not expressible here: the memory-efficient fallback
    return "blockwise"
  return impl


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset=0,
           kv_valid: Optional[jax.Array] = None, kv_lengths: Optional[jax.Array] = None,
           impl: str = "auto", block_q: int = 512, block_kv: int = 512) -> jax.Array:
  """Causal grouped-query attention; see the module docstring for the mask and the
  implementations.

  q [B, T, N, D]; k, v [B, S, K, D]; q_offset: int or int32 scalar, the slot of q[:, 0];
  kv_valid: bool [B, S] (None = all keys valid), or instead kv_lengths: int [B], row b's valid
  keys its first kv_lengths[b] (kv_valid = s < kv_lengths[b]: right-padded rows, which cuDNN
  takes without a permutation); returns [B, T, N, D] in q.dtype.
  """
  if kv_lengths is not None:
    if kv_valid is not None:
      raise ValueError("attend: give kv_valid or kv_lengths, not both")
    if kv_lengths.shape != (q.shape[0],):
      raise ValueError(f"attend: kv_lengths must be [B] = ({q.shape[0]},), got "
                       f"{kv_lengths.shape}")
  _check_inputs(q, k, v, kv_valid)
  B, S = k.shape[:2]
  chosen = resolve_impl(impl, q.shape, q.dtype, kv_len=S, q_offset=q_offset)
  if chosen == "cudnn":  # key lengths (or none) as they are; any other mask by a permutation
    if kv_valid is None:
      return attend_prefix_causal(q, k, v, kv_lengths)
    return attend_packed_causal(q, k, v, kv_valid)
  if kv_lengths is not None:
    kv_valid = jnp.arange(S, dtype=jnp.int32)[None, :] < kv_lengths[:, None]
  if chosen == "blockwise":
    return attend_blockwise(q, k, v, q_offset=q_offset, kv_valid=kv_valid, block_q=block_q,
                            block_kv=block_kv)
  valid = jnp.ones((B, S), bool) if kv_valid is None else kv_valid
  return attend_xla(q, k, v, attention_mask(q.shape[1], valid, q_offset))
