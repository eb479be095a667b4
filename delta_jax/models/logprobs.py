"""Per-token log-probs and entropies without materialising the full [B, T, V] logits.

The sequence is cut into chunks; each chunk's logits [B, C, V] are computed, reduced and
dropped (lax.map), and rematerialised in the backward pass (jax.checkpoint), so peak memory
is one chunk of logits instead of all of them. Qwen3's vocabulary has 151,936 entries.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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
                   chunk_size: int = 512):
  """Chunked log p(labels) and entropy under softmax(logits / temperature).

  model_or_weight: a Transformer (uses model.lm_head_weight()) or the head weight [H, V].
  hidden: [B, T, H] final hidden states (after the final norm); labels: int [B, T].
  temperature: python float or scalar array (traceable).
  Returns (logp, entropy), both float32 [B, T]. Matches logprobs_from_logits on the full
  logits; the matmul runs in hidden.dtype with float32 accumulation.
  """
  w = _head_weight(model_or_weight).astype(hidden.dtype)
  B, T, H = hidden.shape
  if labels.shape != (B, T):
    raise ValueError(f"token_logprobs: labels shape {labels.shape} != hidden[:2] {(B, T)}")
  chunk = max(1, min(int(chunk_size), T))
  num_chunks = -(-T // chunk)
  pad = num_chunks * chunk - T
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    labels = jnp.pad(labels, ((0, 0), (0, pad)))
  # [num_chunks, B, C, ...]: lax.map walks the leading axis.
  h_chunks = hidden.reshape(B, num_chunks, chunk, H).swapaxes(0, 1)
  y_chunks = labels.reshape(B, num_chunks, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one_chunk(args):
    h, y = args
    logits = jnp.einsum("bch,hv->bcv", h, w, preferred_element_type=jnp.float32)
    return logprobs_from_logits(logits, y, temperature)

  logp, entropy = jax.lax.map(one_chunk, (h_chunks, y_chunks))
  logp = logp.swapaxes(0, 1).reshape(B, num_chunks * chunk)[:, :T]
  entropy = entropy.swapaxes(0, 1).reshape(B, num_chunks * chunk)[:, :T]
  return logp, entropy
