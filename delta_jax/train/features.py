"""Teacher-forced passes over rollout rows: the old-policy pass that feeds the loss and DelTA.

Row layout (built by rollout.py): `input_ids [N, P + R]` = the prompt left-padded to P tokens, then
the response right-padded to R tokens; `attention_mask` marks real tokens. The logits that predict
response token j come from position P - 1 + j, so the response features are hidden[:, P-1 : P+R-1].

The old-policy pass computes, in ONE forward pass per chunk of rows and with no gradient:
  logp    fp32 [N, R]  log softmax(z / T)[y]  (T = the rollout temperature)
  entropy fp32 [N, R]  entropy of softmax(z / T)
  hidden  bf16 [N, R, H] (or None)  the final hidden state (after the final norm) feeding the head
DelTA reads logp (as p = exp(logp)) and hidden from here: it adds no forward pass.

With the top-K hidden-gradient proxy (delta.proxy = "hidden_topk", `topk=K`) the same pass also
returns, per response token, the K most likely token ids and their probabilities at T:
  topk_ids int32 [N, R, K], topk_probs fp32 [N, R, K]
taken from the logits chunk that already exists for log p (one LM-head matmul per chunk, the full
[N, R, V] logits never exist). The proxy v = W_y - sum_j p~_j W_j depends on the LM head and these
alone, not on h, so `make_topk_proxy_pass` builds v [N, R, H] (the size of the h cache) from them
without another trunk pass.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from delta_jax import models
from delta_jax.models.logprobs import positions_per_chunk


def response_forward(model, input_ids, attention_mask, response_len: int, *, temperature: float,
                     chunk_size: int, with_hidden: bool = True, logprob_impl: str = "chunked"):
    """One forward pass; returns (logp fp32 [B,R], entropy fp32 [B,R], hidden [B,R,H] | None).

    logprob_impl: "chunked" | "fused" (models.token_logprobs impl=; config model.logprob_impl)."""
    out = model(input_ids, attention_mask=attention_mask, return_logits=False)
    total = input_ids.shape[1]
    start = total - response_len
    hidden = out.hidden[:, start - 1:total - 1]
    labels = input_ids[:, start:]
    logp, entropy = models.token_logprobs(model, hidden, labels, temperature=temperature,
                                          chunk_size=chunk_size, impl=logprob_impl)
    return logp, entropy, (hidden if with_hidden else None)


def logprobs_and_topk(head, hidden, labels, *, temperature: float, chunk_size: int,
                      topk: int):
    """log p, entropy and the top-K of softmax(logits / T), chunked over the sequence.

    head [H, V] (model.lm_head_weight()), hidden [B, T, H], labels int [B, T] ->
    (logp fp32 [B, T], entropy fp32 [B, T], topk_ids int32 [B, T, K], topk_probs fp32 [B, T, K]).
    Each chunk's logits [B, C, V] are computed once (the same matmul as models.token_logprobs:
    hidden dtype in, fp32 accumulation), reduced and dropped. No gradient is meant to flow.
    """
    V = head.shape[1]
    if not 1 <= topk <= V:
        raise ValueError(f"delta.topk={topk} must be in [1, vocab_size={V}]")
    w = head.astype(hidden.dtype)
    inv_t = 1.0 / jnp.asarray(temperature, jnp.float32)

    def one_chunk(args):
        h, y = args
        logits = jnp.einsum("bch,hv->bcv", h, w, preferred_element_type=jnp.float32)
        logp_all = jax.nn.log_softmax(logits * inv_t, axis=-1)
        logp = jnp.take_along_axis(logp_all, y[..., None].astype(jnp.int32), axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        top_logp, top_ids = jax.lax.top_k(logp_all, topk)
        return logp, entropy, top_ids.astype(jnp.int32), jnp.exp(top_logp)

    return models.map_sequence_chunks(one_chunk, (hidden, labels),
                                      positions_per_chunk(chunk_size, hidden.shape[0]))


def topk_proxy_features(head, labels, topk_ids, topk_probs, *, chunk_size: int,
                        dtype=jnp.float32):
    """The top-K hidden-gradient proxy v = W_y - sum_{j in topK} p~_j W_j (DELTA_SPEC 4 / 5.4),
    via rl.delta.hidden_topk_proxy_from_head, chunked over the sequence.

    head [H, V], labels int [B, T], topk_ids int [B, T, K], topk_probs [B, T, K] -> v [B, T, H]
    in `dtype` (computed in fp32). At most [chunk_size tokens, K, H] gathered head rows exist at
    once (chunk_size: a token budget, rows x positions).
    """
    from delta_jax.rl import delta as delta_lib

    def one_chunk(args):
        y, ids, probs = args
        return delta_lib.hidden_topk_proxy_from_head(head, y, ids, probs).astype(dtype)

    return models.map_sequence_chunks(one_chunk, (labels, topk_ids, topk_probs),
                                      positions_per_chunk(chunk_size, labels.shape[0]))


def proxy_token_chunk(logprob_chunk_tokens: int, vocab_size: int, topk: int,
                      hidden_size: int) -> int:
    """Token budget for `topk_proxy_features` whose gathered rows [tokens, K, H] take no more
    memory than the old-policy pass's logits chunk [logprob_chunk_tokens, V]."""
    return max(1, (logprob_chunk_tokens * vocab_size) // max(topk * hidden_size, 1))


def response_hidden(model, input_ids, attention_mask, response_len: int):
    """The trunk only (no LM head): hidden [B, R, H] of the response positions."""
    out = model(input_ids, attention_mask=attention_mask, return_logits=False)
    total = input_ids.shape[1]
    start = total - response_len
    return out.hidden[:, start - 1:total - 1]


def make_old_policy_pass(graphdef, rest, *, temperature: float, chunk_size: int,
                         hidden_dtype=jnp.bfloat16, mesh=None, topk: int = 0,
                         with_hidden: bool = True, logprob_impl: str = "chunked") -> Callable:
    """Jitted (params, input_ids, attention_mask, response_len) -> (logp, entropy, hidden), or
    with topk = K > 0 -> (logp, entropy, hidden, topk_ids [N, R, K], topk_probs [N, R, K]).
    with_hidden=False returns None for hidden (e.g. the reference-policy pass, or the top-K proxy,
    which does not read h). With a mesh (delta_jax.sharding) the outputs stay row-sharded like
    the inputs. logprob_impl ("chunked" | "fused", models.token_logprobs) applies without top-K;
    with topk > 0 the pass always uses the chunked logits (logprobs_and_topk), because the top-K
    needs each token's logits over the whole vocabulary, which the fused path never holds."""
    from flax import nnx

    from delta_jax.sharding import constrain_batch, rows_over_batch

    @functools.partial(jax.jit, static_argnums=(3,))
    def old_policy_pass(params, input_ids, attention_mask, response_len):
        model = nnx.merge(graphdef, params, rest)
        with rows_over_batch(mesh):
            out = model(input_ids, attention_mask=attention_mask, return_logits=False)
        total = input_ids.shape[1]
        start = total - response_len
        hidden = out.hidden[:, start - 1:total - 1]
        labels = input_ids[:, start:]
        if topk > 0:
            logp, entropy, top_ids, top_probs = logprobs_and_topk(
                model.lm_head_weight(), hidden, labels, temperature=temperature,
                chunk_size=chunk_size, topk=topk)
            extra = (top_ids, top_probs)
        else:
            logp, entropy = models.token_logprobs(model, hidden, labels,
                                                  temperature=temperature,
                                                  chunk_size=chunk_size, impl=logprob_impl)
            extra = ()
        kept = hidden.astype(hidden_dtype) if with_hidden else None
        return constrain_batch(jax.lax.stop_gradient((logp, entropy, kept) + extra), mesh)

    return old_policy_pass


def make_topk_proxy_pass(graphdef, rest, *, chunk_size: int, feature_dtype=jnp.bfloat16,
                         mesh=None) -> Callable:
    """Jitted (params, labels [b, R], topk_ids [b, R, K], topk_probs [b, R, K]) -> v [b, R, H]
    (`topk_proxy_features` with the model's LM head; the trunk is not run)."""
    from flax import nnx

    from delta_jax.sharding import constrain_batch

    @jax.jit
    def topk_proxy_pass(params, labels, topk_ids, topk_probs):
        model = nnx.merge(graphdef, params, rest)
        v = topk_proxy_features(model.lm_head_weight(), labels, topk_ids, topk_probs,
                                chunk_size=chunk_size, dtype=feature_dtype)
        return constrain_batch(jax.lax.stop_gradient(v), mesh)

    return topk_proxy_pass


def make_hidden_pass(graphdef, rest, hidden_dtype=jnp.bfloat16, mesh=None) -> Callable:
    """Jitted (params, input_ids, attention_mask, response_len) -> hidden (trunk only)."""
    from flax import nnx

    from delta_jax.sharding import constrain_batch, rows_over_batch

    @functools.partial(jax.jit, static_argnums=(3,))
    def hidden_pass(params, input_ids, attention_mask, response_len):
        model = nnx.merge(graphdef, params, rest)
        with rows_over_batch(mesh):
            hidden = response_hidden(model, input_ids, attention_mask, response_len)
        return constrain_batch(hidden.astype(hidden_dtype), mesh)

    return hidden_pass
