"""Supervised warm start on (problem, solution) pairs: token-mean NLL of the solution + EOS.

    examples = tokenize_examples(records, tokenizer, template, max_len)   # SFTExamples (numpy)
    step_fn = make_sft_step(graphdef, rest, optimizer)
    state, metrics = step_fn(state, sft_batch(examples, batch_size, seed, step))

Rows are right-padded to a fixed max_len (one compiled program); the loss covers only the
solution tokens and the EOS after them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax import models
from delta_jax.errors import InputError
from delta_jax.train.rollout import step_seed
from delta_jax.train.state import TrainState, apply_if_finite, trainable_value_and_grad

_SFT_SALT = 7


@dataclasses.dataclass
class SFTExamples:
    """input_ids int32 [E, L], attention_mask int32 [E, L], loss_mask fp32 [E, L] (1 on the
    target tokens: solution + EOS)."""
    input_ids: np.ndarray
    attention_mask: np.ndarray
    loss_mask: np.ndarray
    num_truncated: int   # kept, their target cut at max_len
    num_dropped: int = 0  # left out: the prompt alone fills max_len (no target token left)


def tokenize_examples(records, tokenizer, template, max_len: int) -> SFTExamples:
    """Tokenizes template(problem) + solution + EOS; rows longer than max_len are cut (counted in
    num_truncated), and rows whose prompt leaves no target token within max_len are left out
    (num_dropped; an error naming sft.max_len when that is every row)."""
    rows = [r for r in records if r.get("solution")]
    if not rows:
        raise InputError("sft.steps: the SFT warm start needs records with a worked 'solution' "
                         "and data.train has none; set sft.steps=0 to start RL from the model "
                         "as it is")
    encoded = []
    for r in rows:
        prompt = tokenizer.encode(template(r["problem"]))
        encoded.append((prompt, tokenizer.encode(r["solution"]) + [tokenizer.eos_token_id]))
    kept = [(p, t) for p, t in encoded if len(p) < max_len]
    if not kept:
        raise InputError(
            f"sft.max_len={max_len} leaves no solution token in any of the {len(rows)} records "
            f"with a solution: their prompts alone have {min(len(p) for p, _ in encoded)} to "
            f"{max(len(p) for p, _ in encoded)} tokens; raise sft.max_len")
    ids = np.full((len(kept), max_len), tokenizer.pad_token_id, np.int32)
    attn = np.zeros((len(kept), max_len), np.int32)
    loss = np.zeros((len(kept), max_len), np.float32)
    truncated = 0
    for i, (prompt, target) in enumerate(kept):
        seq = (prompt + target)[:max_len]
        truncated += len(prompt) + len(target) > max_len
        ids[i, :len(seq)] = seq
        attn[i, :len(seq)] = 1
        loss[i, len(prompt):len(seq)] = 1.0
    return SFTExamples(ids, attn, loss, int(truncated), len(rows) - len(kept))


def sft_batch(examples: SFTExamples, batch_size: int, seed: int, step: int) -> dict:
    """A batch drawn with a generator seeded by (seed, step): resumable and order-independent."""
    rng = np.random.default_rng(step_seed(seed, step, _SFT_SALT))
    idx = rng.choice(examples.input_ids.shape[0], size=batch_size,
                     replace=examples.input_ids.shape[0] < batch_size)
    return {"input_ids": examples.input_ids[idx], "attention_mask": examples.attention_mask[idx],
            "loss_mask": examples.loss_mask[idx]}


def sft_loss_sum(model, batch, chunk_size: int = 256, logprob_impl: str = "chunked"):
    """(summed NLL over loss_mask[:, 1:], number of target tokens). logprob_impl: "chunked" |
    "fused" (models.token_logprobs)."""
    ids = batch["input_ids"]
    out = model(ids, attention_mask=batch["attention_mask"], return_logits=False)
    logp, _ = models.token_logprobs(model, out.hidden[:, :-1], ids[:, 1:], temperature=1.0,
                                    chunk_size=chunk_size, impl=logprob_impl)
    mask = batch["loss_mask"][:, 1:]
    return -jnp.sum(logp * mask), jnp.sum(mask)


def sft_loss(model, batch, chunk_size: int = 256, logprob_impl: str = "chunked"):
    """(token-mean NLL over loss_mask[:, 1:], number of target tokens)."""
    total, count = sft_loss_sum(model, batch, chunk_size, logprob_impl)
    return total / jnp.maximum(count, 1.0), count


def make_sft_step(graphdef, rest, optimizer: optax.GradientTransformation,
                  schedule: optax.Schedule | None = None, chunk_size: int = 256,
                  logprob_impl: str = "chunked", mesh=None, state_shardings=None,
                  micro_batch_size: int = 0):
    """Jitted sft_step(state, batch) -> (state, metrics), state donated; non-finite skipped.
    mesh / state_shardings (as train.step.make_train_step's): the batch's rows and the model's
    residual stream stay over the batch axes (sharding.rows_over_batch: an fsdp-sharded layer's
    weights are gathered, not the activations), and the new state keeps `state_shardings`.
    micro_batch_size (sft.micro_batch_size; 0 = the whole batch at once): the batch's rows in
    micro-batches of that many, scanned, their NLL sums' gradients summed in float32 and divided
    by the batch's target tokens, as train.step does: the gradient of the whole batch's token
    mean with one micro-batch's activations live."""
    from delta_jax import sharding as sharding_lib
    from delta_jax.train.step import add_grads, split_micro, zero_grad_sum

    def loss_fn(params, batch):
        with sharding_lib.rows_over_batch(mesh):
            return sft_loss(nnx.merge(graphdef, params, rest), batch, chunk_size, logprob_impl)

    def sum_fn(params, batch):
        with sharding_lib.rows_over_batch(mesh):
            return sft_loss_sum(nnx.merge(graphdef, params, rest), batch, chunk_size,
                                logprob_impl)

    def micro_batched(params, batch):
        """((token-mean NLL, target tokens), its gradients) of the batch, micro-batch by
        micro-batch."""
        micro = sharding_lib.constrain_batch(
            split_micro(batch, micro_batch_size, "sft.micro_batch_size"), mesh, axis=1)

        def body(carry, mb):
            grads, total, count = carry
            (t, c), g = trainable_value_and_grad(sum_fn, params, mb)
            return (add_grads(grads, g), total + t, count + c), None

        zero = jnp.zeros((), jnp.float32)
        (grads, total, count), _ = jax.lax.scan(body, (zero_grad_sum(params), zero, zero), micro)
        denom = jnp.maximum(count, 1.0)
        return (total / denom, count), jax.tree.map(lambda g: g / denom, grads)

    whole = micro_batch_size <= 0
    out_shardings = None if state_shardings is None else (state_shardings, None)

    @functools.partial(jax.jit, donate_argnums=(0,), out_shardings=out_shardings)
    def sft_step(state: TrainState, batch):
        if whole or micro_batch_size >= batch["input_ids"].shape[0]:
            batch = sharding_lib.constrain_batch(batch, mesh)
            (loss, count), grads = trainable_value_and_grad(loss_fn, state.params, batch)
        else:
            (loss, count), grads = micro_batched(state.params, batch)
        grad_norm = optax.tree.norm(grads)
        new_state, finite = apply_if_finite(state, grads, optimizer, loss=loss,
                                            grad_norm=grad_norm)
        metrics = {"sft/loss": loss, "sft/grad_norm": grad_norm, "sft/tokens": count,
                   "sft/skipped": 1 - finite.astype(jnp.int32)}
        if schedule is not None:
            # The rate this update used: the schedule at the step count before it (as train_step).
            metrics["sft/learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        return new_state, metrics

    return sft_step
