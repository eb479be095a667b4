"""Per-token log-probs and entropies without materialising the full [B, T, V] logits.

Two implementations (`impl=`), same results:
  "chunked"  the sequence is cut into chunks of C = chunk_size // B positions (chunk_size is a
             budget in TOKENS, rows x positions, so the memory does not grow with the batch);
             each chunk's logits [B, C, V] are computed, reduced and dropped (lax.map), and
             rematerialised in the backward pass (jax.checkpoint), so peak memory is one chunk
             of logits instead of all of them.
  "fused"    delta_jax.kernels.lm_head_logprob: all B*T tokens at once, tiled over the
             VOCABULARY with an online log-sum-exp and a custom VJP that recomputes each logits
             tile in the backward (plain XLA; under a mesh the SPMD partitioner shards it).
             The vocabulary tile is chosen so that one [B*T, tile] fp32 tile holds as many
             elements as chunk_size tokens' logits [chunk_size, V]: the same budget for both.
Qwen3's vocabulary has 151,936 entries.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


LOGPROB_IMPLS = ("chunked", "fused")


def _head_weight(model_or_weight) -> jax.Array:
  if hasattr(model_or_weight, "lm_head_weight"):
    return model_or_weight.lm_head_weight()
  return jnp.asarray(model_or_weight)


def logprobs_from_logits(logits: jax.Array, labels: jax.Array, temperature=1.0):
  """log p(labels) and entropy of softmax(logits / temperature), float32 [...].

  logits [..., V], labels int [...] (same leading shape).
  """
  z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
  logp_all = jax.nn.log_softmax(z, axis=-1)
  logp = jnp.take_along_axis(logp_all, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return logp, entropy


def token_logprobs(model_or_weight, hidden: jax.Array, labels: jax.Array, temperature=1.0,
                   chunk_size: int = 512, *, impl: str = "chunked"):
  """log p(labels) and entropy under softmax(logits / temperature), never all logits at once.

  model_or_weight: a Transformer (uses model.lm_head_weight()) or the head weight [H, V].
  hidden: [B, T, H] final hidden states (after the final norm); labels: int [B, T] in [0, V).
  temperature: python float or scalar array (traceable).
  chunk_size: the memory budget in tokens (rows x positions) whose fp32 logits exist at once
    (config model.logprob_chunk_tokens).
  impl: "chunked" (sequence chunks of chunk_size // B positions) or "fused" (vocabulary tiles,
    see the module docstring).
  Returns (logp, entropy), both float32 [B, T]. Matches logprobs_from_logits on the full
  logits; the matmul runs in hidden.dtype with float32 accumulation.
  """
  B, T, H = hidden.shape
  if labels.shape != (B, T):
    raise ValueError(f"token_logprobs: labels shape {labels.shape} != hidden[:2] {(B, T)}")
  if impl == "fused":
    return _fused_token_logprobs(_head_weight(model_or_weight), hidden, labels, temperature,
                                 chunk_size)
  if impl != "chunked":
    raise ValueError(f"token_logprobs: impl={impl!r}; expected one of {LOGPROB_IMPLS} "
                     "(config field model.logprob_impl)")
  return _chunked_token_logprobs(_head_weight(model_or_weight), hidden, labels, temperature,
                                 chunk_size)


def positions_per_chunk(chunk_tokens: int, rows: int) -> int:
  """Sequence positions per chunk under a budget of `chunk_tokens` tokens over `rows` rows."""
  return max(1, int(chunk_tokens) // max(1, int(rows)))


def fused_vocab_chunk(chunk_tokens: int, num_tokens: int, vocab: int) -> int:
  """Vocabulary tile of the fused path with the chunked path's memory: [N, c] ~ [chunk, V],
  i.e. c = chunk_tokens * V / N, rounded down to a multiple of 128 (at least 128, at most V)."""
  c = (max(1, int(chunk_tokens)) * vocab) // max(1, num_tokens)
  if c >= 128:
    c = (c // 128) * 128
  return int(max(1, min(vocab, max(c, 128))))


def _fused_token_logprobs(w, hidden, labels, temperature, chunk_size):
  from delta_jax import kernels

  B, T, H = hidden.shape
  vocab_chunk = fused_vocab_chunk(chunk_size, B * T, w.shape[1])
  if isinstance(temperature, (int, float)):
    static_t = float(temperature)
  else:
    # A traced temperature cannot be a static argument of the custom VJP: fold 1/T into the
    # hidden states (exact for the gradient: d/dh flows through the division).
    static_t = 1.0
    hidden = (hidden.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)).astype(
        hidden.dtype)
  logp, ent = kernels.lm_head_logprob(hidden.reshape(B * T, H), w, labels.reshape(B * T),
                                      static_t, chunk_size=vocab_chunk)
  return logp.reshape(B, T), ent.reshape(B, T)


def map_sequence_chunks(fn, arrays, chunk_size: int):
  """lax.map of `fn` over chunks of the sequence axis, so only one chunk's temporaries exist.

  arrays: a tuple of [B, T, ...] arrays; fn gets the tuple of their [B, C, ...] chunks and returns
  a pytree of [B, C, ...] arrays, reassembled here to [B, T, ...]. The last chunk is zero-padded
  and its padded positions are cut off.
  """
  B, T = arrays[0].shape[:2]
  chunk = max(1, min(int(chunk_size), T))
  num_chunks = -(-T // chunk)
  pad = num_chunks * chunk - T

  def split(x):  # [B, T, ...] -> [num_chunks, B, C, ...]: lax.map walks the leading axis.
    if pad:
      x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape((B, num_chunks, chunk) + x.shape[2:]).swapaxes(0, 1)

  def join(x):  # [num_chunks, B, C, ...] -> [B, T, ...]
    x = x.swapaxes(0, 1)
    return x.reshape((B, num_chunks * chunk) + x.shape[3:])[:, :T]

  outs = jax.lax.map(fn, tuple(split(x) for x in arrays))
  return jax.tree.map(join, outs)


def _chunked_token_logprobs(w, hidden, labels, temperature, chunk_size):
  w = w.astype(hidden.dtype)

  @jax.checkpoint
  def one_chunk(args):
    h, y = args
    logits = jnp.einsum("bch,hv->bcv", h, w, preferred_element_type=jnp.float32)
    return logprobs_from_logits(logits, y, temperature)

  return map_sequence_chunks(one_chunk, (hidden, labels),
                             positions_per_chunk(chunk_size, hidden.shape[0]))
