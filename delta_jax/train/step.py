"""The pure, jitted policy-update step: (TrainState, mini-batch) -> (TrainState, metrics).

The mini-batch is split into micro-batches scanned with lax.scan; each contributes the gradient of
its loss SUM, summed in float32 (zero_grad_sum, add_grads), and the sum of gradients is divided
by the mini-batch's total denominator, so the result is exactly the gradient of the global
(sum / denominator) loss. A non-finite loss or gradient norm leaves parameters and optimizer
state unchanged (state.apply_if_finite) and is reported in metrics["skipped"]; the caller counts
consecutive skips.

Mini-batch arrays (N rows, T = P + R tokens):
  input_ids int32 [N, T], attention_mask int32 [N, T], response_mask fp32 [N, R],
  old_logp fp32 [N, R], advantages fp32 [N], token_weights fp32 [N, R] (ones without DelTA),
  and, only with a KL term (rl.kl_coef > 0), ref_logp fp32 [N, R] (passed to loss_fn as ref_logp=).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from delta_jax.train.features import response_forward
from delta_jax.train import state as state_lib
from delta_jax.train.state import TrainState, apply_if_finite

# loss_fn(logp, old_logp, advantages, mask, token_weights, entropy[, ref_logp=...])
#   -> (loss_sum scalar, denominator scalar, metrics: dict of scalar SUMS)
LossFn = Callable


def split_micro(batch, micro: int, field: str = "rl.micro_batch_size"):
    """The batch's arrays [N, ...] as [N / micro, micro, ...] (micro <= 0 or >= N: one
    micro-batch of all N rows); ValueError naming `field` when micro does not divide N."""
    n = batch["input_ids"].shape[0]
    if micro <= 0 or micro >= n:
        micro = n
    if n % micro:
        raise ValueError(f"{field}={micro} does not divide the batch of {n} rows")
    return jax.tree.map(lambda x: x.reshape((n // micro, micro) + x.shape[1:]), batch)


def zero_grad_sum(params):
    """The float32 zeros micro-batch gradients of the trainable part of `params` are summed into
    (whatever the parameters' dtype: a bfloat16 sum of many micro-batches would round each
    addition to 8 significant bits)."""
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                        state_lib.split_trainable(params)[0])


def add_grads(total, grads):
    """`total` (zero_grad_sum's) plus one micro-batch's gradients, in float32."""
    return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), total, grads)


def make_train_step(graphdef, rest, optimizer: optax.GradientTransformation, loss_fn: LossFn, *,
                    temperature: float, chunk_size: int, micro_batch_size: int = 0,
                    schedule: optax.Schedule | None = None, mesh=None,
                    state_shardings=None, logprob_impl: str = "chunked") -> Callable:
    """Returns jitted train_step(state, batch) -> (state, metrics); the state is donated.

    logprob_impl: how the loss's log-probs are computed from the hidden states, "chunked" or
    "fused" (models.token_logprobs; config model.logprob_impl); chunk_size is its memory budget.
    mesh / state_shardings (delta_jax.sharding): with a mesh, each micro-batch is constrained to
    rows over the batch axes; the new state keeps `state_shardings` (e.g.
    sharding.tree_shardings(state, mesh)), so parameters never move between steps.
    """
    from delta_jax import sharding as sharding_lib

    def micro_loss(params, mb):
        model = nnx.merge(graphdef, params, rest)
        response_len = mb["response_mask"].shape[1]
        logp, entropy, _ = response_forward(model, mb["input_ids"], mb["attention_mask"],
                                            response_len, temperature=temperature,
                                            chunk_size=chunk_size, with_hidden=False,
                                            logprob_impl=logprob_impl)
        # ref_logp (reference-policy log-probs) only when the run has a KL term.
        extra = {"ref_logp": mb["ref_logp"]} if "ref_logp" in mb else {}
        loss_sum, denom, metrics = loss_fn(logp, mb["old_logp"], mb["advantages"],
                                           mb["response_mask"], mb["token_weights"], entropy,
                                           **extra)
        return loss_sum, (denom, dict(metrics))

    def grad_fn(params, mb):  # gradients of the trainable parameters (all, or LoRA's)
        with sharding_lib.rows_over_batch(mesh):  # the model's rows stay over the batch axes
            return state_lib.trainable_value_and_grad(micro_loss, params, mb)

    out_shardings = None if state_shardings is None else (state_shardings, None)

    @functools.partial(jax.jit, donate_argnums=(0,), out_shardings=out_shardings)
    def train_step(state: TrainState, batch):
        micro = sharding_lib.constrain_batch(split_micro(batch, micro_batch_size), mesh, axis=1)
        first = jax.tree.map(lambda x: x[0], micro)
        # Zero carries shaped like one micro-batch's outputs (traced once, no extra compute).
        (l_shape, (d_shape, m_shape)), _ = jax.eval_shape(grad_fn, state.params, first)
        zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731

        def body(carry, mb):
            grads, loss_sum, denom, msum = carry
            (l, (d, m)), g = grad_fn(state.params, mb)
            return (add_grads(grads, g), loss_sum + l, denom + d,
                    jax.tree.map(jnp.add, msum, m)), None

        init = (zero_grad_sum(state.params), zeros(l_shape), zeros(d_shape), zeros(m_shape))
        (grads, loss_sum, denom, msum), _ = jax.lax.scan(body, init, micro)

        safe_denom = jnp.maximum(denom, 1e-8)
        grads = jax.tree.map(lambda g: g / safe_denom, grads)
        loss = loss_sum / safe_denom
        grad_norm = optax.tree.norm(grads)
        new_state, finite = apply_if_finite(state, grads, optimizer, loss=loss,
                                            grad_norm=grad_norm)
        metrics = dict(msum)
        metrics.update(loss=loss, loss_denominator=denom, grad_norm=grad_norm,
                       skipped=1 - finite.astype(jnp.int32))
        if schedule is not None:
            metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        return new_state, metrics

    return train_step
