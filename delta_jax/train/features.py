"""Teacher-forced passes over rollout rows: the old-policy pass that feeds the loss and DelTA.

Row layout (built by rollout.py): `input_ids [N, P + R]` = the prompt left-padded to P tokens, then
the response right-padded to R tokens; `attention_mask` marks real tokens. The logits that predict
response token j come from position P - 1 + j, so the response features are hidden[:, P-1 : P+R-1].

The old-policy pass computes, in ONE forward pass per chunk of rows and with no gradient:
  logp    fp32 [N, R]  log softmax(z / T)[y]  (T = the rollout temperature)
  entropy fp32 [N, R]  entropy of softmax(z / T)
  hidden  bf16 [N, R, H] (or None)  the final hidden state (after the final norm) feeding the head
DelTA reads logp (as p = exp(logp)) and hidden from here: it adds no forward pass.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax import models


def response_forward(model, input_ids, attention_mask, response_len: int, *, temperature: float,
                     chunk_size: int, with_hidden: bool = True):
    """One forward pass; returns (logp fp32 [B,R], entropy fp32 [B,R], hidden [B,R,H] | None)."""
    out = model(input_ids, attention_mask=attention_mask, return_logits=False)
    total = input_ids.shape[1]
    start = total - response_len
    hidden = out.hidden[:, start - 1:total - 1]
    labels = input_ids[:, start:]
    logp, entropy = models.token_logprobs(model, hidden, labels, temperature=temperature,
                                          chunk_size=chunk_size)
    return logp, entropy, (hidden if with_hidden else None)


def response_hidden(model, input_ids, attention_mask, response_len: int):
    """The trunk only (no LM head): hidden [B, R, H] of the response positions."""
    out = model(input_ids, attention_mask=attention_mask, return_logits=False)
    total = input_ids.shape[1]
    start = total - response_len
    return out.hidden[:, start - 1:total - 1]


def make_old_policy_pass(graphdef, rest, *, temperature: float, chunk_size: int,
                         hidden_dtype=jnp.bfloat16, mesh=None) -> Callable:
    """Jitted (params, input_ids, attention_mask, response_len) -> (logp, entropy, hidden).
    With a mesh (delta_jax.sharding) the outputs stay row-sharded like the inputs."""
    from flax import nnx

    from delta_jax.sharding import constrain_batch

    @functools.partial(jax.jit, static_argnums=(3,))
    def old_policy_pass(params, input_ids, attention_mask, response_len):
        model = nnx.merge(graphdef, params, rest)
        logp, entropy, hidden = response_forward(
            model, input_ids, attention_mask, response_len, temperature=temperature,
            chunk_size=chunk_size)
        logp = jax.lax.stop_gradient(logp)
        return constrain_batch((logp, jax.lax.stop_gradient(entropy),
                                jax.lax.stop_gradient(hidden).astype(hidden_dtype)), mesh)

    return old_policy_pass


def make_hidden_pass(graphdef, rest, hidden_dtype=jnp.bfloat16, mesh=None) -> Callable:
    """Jitted (params, input_ids, attention_mask, response_len) -> hidden (trunk only)."""
    from flax import nnx

    from delta_jax.sharding import constrain_batch

    @functools.partial(jax.jit, static_argnums=(3,))
    def hidden_pass(params, input_ids, attention_mask, response_len):
        model = nnx.merge(graphdef, params, rest)
        return constrain_batch(response_hidden(model, input_ids, attention_mask,
                                               response_len).astype(hidden_dtype), mesh)

    return hidden_pass


def run_in_chunks(fn: Callable, params, input_ids, attention_mask, response_len: int,
                  chunk: int, keep_hidden: str = "device"):
    """Applies the old-policy pass over row chunks of at most `chunk` rows.

    keep_hidden: "device" (concatenate on device), "host" (move each chunk to host memory as
    numpy), "drop" (recompute mode: do not keep it). Returns (logp, entropy, hidden | None).
    """
    n = input_ids.shape[0]
    logps, ents, hids = [], [], []
    for s in range(0, n, chunk):
        logp, ent, hid = fn(params, input_ids[s:s + chunk], attention_mask[s:s + chunk],
                            response_len)
        logps.append(logp)
        ents.append(ent)
        if keep_hidden == "device":
            hids.append(hid)
        elif keep_hidden == "host":
            hids.append(np.asarray(jax.device_get(hid)))
    logp = jnp.concatenate(logps) if len(logps) > 1 else logps[0]
    ent = jnp.concatenate(ents) if len(ents) > 1 else ents[0]
    hidden = None
    if keep_hidden == "device":
        hidden = jnp.concatenate(hids) if len(hids) > 1 else hids[0]
    elif keep_hidden == "host":
        hidden = np.concatenate(hids) if len(hids) > 1 else hids[0]
    return logp, ent, hidden
