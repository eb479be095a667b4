"""One RL step, as its phases (train/phases.py) in DESIGN.md's order:

    prompts ─ collect_rollout ─> samples + rewards (RewardScorer, DAPO overlong shaping per
              method; DAPO dynamic sampling: drop zero-variance groups, refill)
            ─ compute_advantages ─> advantages ─ pack_rollout ─> RolloutBatch ─ put_batch ─> mesh
            ─ old_policy_features ─> log p, entropy, h (or the top-K proxy inputs): ONE pass
            ─ [rl.kl_coef > 0: the frozen reference policy's log p]
            ─ delta_feature_source + delta_weights ─> DelTA token weights (method delta)
            ─ update_policy ─> mini-batch updates with the pure jitted train_step (step.py)

`prepare_batch` runs everything up to the updates (the token view uses it as it is); `rl_step`
adds the updates and the step's metrics (on the synthetic task with credit_report's
ground-truth credit/* metrics of the token weights, rl/credit.py). This module times the phases
and turns the Run's programs and config into the phases' explicit inputs; the loop
(loop.train) writes metrics, checkpoints and evaluates.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax import sharding as sharding_lib
from delta_jax.rl import credit, losses, rollout_correction
from delta_jax.rl import rewards as rewards_lib
from delta_jax.rl.advantages import compute_advantages
from delta_jax.rl.high_entropy import high_entropy_mask
from delta_jax.sampling import GenerationStopped
from delta_jax.sampling.output import fetch_global
from delta_jax.sampling.progress import ProgressLog
from delta_jax.train import metrics as metrics_lib
from delta_jax.train import phases
from delta_jax.train import rollout as rollout_lib
from delta_jax.train.config import method_settings, old_pass_rows
from delta_jax.train.run import Run, feature_cache_mode, optimizer_state_to, reference_params
from delta_jax.train.state import TrainState

_SHUFFLE_SALT, _ROLLOUT_SALT = 13, 17
_DELTA_SALT = 5  # delta.random_lambda's draws (clear of 7, 11 + 1 + i, 13, 17 + round)

# Step-level values of train_step's metrics (everything else is a loss-metric sum).
_MEAN_OVER_UPDATES = ("loss", "grad_norm", "learning_rate")
_SUM_OVER_UPDATES = ("skipped", "loss_denominator")


def finish_metrics(sums: dict, num_updates: int) -> dict:
    """Metrics of one RL step from train_step metrics summed over its mini-batch updates:
    loss-metric sums -> means (rl.losses.finalize_metrics), loss / grad norm / lr averaged."""
    loss_sums = {k: v for k, v in sums.items()
                 if k not in _MEAN_OVER_UPDATES + _SUM_OVER_UPDATES}
    out = {k: float(v) for k, v in losses.finalize_metrics(loss_sums).items()}
    for k in _MEAN_OVER_UPDATES:
        if k in sums:
            out[k] = sums[k] / max(num_updates, 1)
    for k in _SUM_OVER_UPDATES:
        if k in sums:
            out[k] = sums[k]
    out["clip_frac"] = sum(out.get(f"clip_frac_{s}", 0.0) for s in ("low", "high", "dual"))
    return out


@dataclasses.dataclass
class PreparedBatch:
    """Everything an RL step trains on, before its updates.

    rollout: phases.Rollout (samples, records, rewards, accuracy); packed: the RolloutBatch
    (numpy); batch: the device arrays of train_step (input_ids, attention_mask, response_mask,
    advantages, old_logp, token_weights[, ref_logp]), placed on the run's mesh; delta_weights:
    fp32 [N, R] DelTA weights when the run computes them (run.with_delta; token_weights for
    method delta without rl.rollout_is), else None; delta_diagnostics: scalars of the DelTA
    fit ({} without DelTA); metrics: rollout and timing metrics so far; credit_classes: int8
    [N, R] ground-truth credit classes of the response tokens (rl.credit codes) once
    credit_report has labelled the batch (runs with a run.credit_labeller: the synthetic task),
    else None; loss_mask: the host copy of batch["response_mask"], the response tokens the loss
    takes (less the truncated responses' with rl.mask_truncated, less the low-entropy tokens
    with rl.entropy_top_frac).
    """
    rollout: phases.Rollout
    packed: rollout_lib.RolloutBatch
    batch: dict
    delta_weights: jax.Array | None
    delta_diagnostics: dict
    metrics: dict
    credit_classes: np.ndarray | None = None
    loss_mask: np.ndarray | None = None  # fp32 [N, R] host: the response tokens the loss takes


@dataclasses.dataclass
class StepOutput:
    """The result of one RL step: the new state, its metrics (Python floats) and what it trained
    on (the PreparedBatch: rollout, packed rows, device batch, DelTA weights)."""
    state: TrainState
    metrics: dict
    prepared: PreparedBatch

    @property
    def batch(self) -> dict:
        return self.prepared.batch


def generate_and_score_fn(run: Run, params, step: int,
                          should_stop: Callable[[], bool] | None = None
                          ) -> phases.GenerateAndScore:
    """collect_rollout's generate_and_score for the run's sampler and scorer at `step`:
    round r samples with the seed (seed, step, r), timed; should_stop is asked after every
    decode call (sampling.GenerationStopped when true)."""
    cfg = run.cfg
    run.sampler.update_params(run.model(params))

    def generate_and_score(records, round_index):
        t0 = time.perf_counter()
        samples = run.sampler.generate(
            [r["prompt_ids"] for r in records], n=cfg.rollout.group_size,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=(run.tokenizer.eos_token_id,),
            seed=rollout_lib.step_seed(cfg.seed, step, _ROLLOUT_SALT + round_index),
            progress=ProgressLog(f"rollout step {step}"
                                 + (f" round {round_index + 1}" if round_index else ""),
                                 cfg.train.progress_every_s),
            should_stop=should_stop)
        t1 = time.perf_counter()
        golds = [str(r["answer"]) for r in records for _ in range(cfg.rollout.group_size)]
        rewards, info = rewards_lib.score_across_processes(
            run.scorer.score, rollout_lib.flat(samples.texts), golds,
            np.asarray(rollout_lib.flat(samples.response_lengths)),
            np.asarray(rollout_lib.flat(samples.truncated)),
            **rewards_lib.reward_context(records, cfg.rollout.group_size),
            response_ids=rollout_lib.flat(samples.response_ids),
            trainer_state=rewards_lib.TrainerState(step - 1, cfg.train.steps))
        info = dict(info, time_generate=t1 - t0, time_reward=time.perf_counter() - t1,
                    **samples.counters())
        return samples, rewards, info

    return generate_and_score


def loss_mask(cfg, rb) -> np.ndarray:
    """The response tokens the loss takes [N, R] (host): the packed batch's response mask, less
    the truncated responses' tokens with rl.mask_truncated (DAPO's overlong filtering)."""
    if not cfg.rl.mask_truncated:
        return rb.response_mask
    return rb.response_mask * (~rb.truncated)[:, None].astype(rb.response_mask.dtype)


def prepare_batch(run: Run, params, step: int,
                  should_stop: Callable[[], bool] | None = None) -> PreparedBatch:
    """Rollout, rewards, advantages, the old-policy (and reference) pass and, when the run
    computes them (run.with_delta), the DelTA weights of RL step `step`; token_weights are the
    DelTA weights for method delta and the response mask otherwise, times the sampler-vs-trainer
    importance weights when rl.rollout_is is "tis" or "mis" (rl/rollout_correction.py). With
    rl.entropy_top_frac the loss mask keeps only the batch's high-entropy tokens (after the
    old-policy pass that gives their entropy; rl/high_entropy.py).
    should_stop: asked after every decode call of the rollout, once it is scored and between the
    old-policy pass's chunks; when true, StepAbandoned (the rest of the step does not run)."""
    cfg = run.cfg
    settings = method_settings(cfg)
    G = cfg.rollout.group_size
    try:
        roll = phases.collect_rollout(
            generate_and_score_fn(run, params, step, should_stop), run.data_iter,
            num_prompts=cfg.rollout.batch_prompts, group_size=G,
            dynamic_sampling=cfg.rl.dynamic_sampling,
            max_rounds=cfg.rl.dynamic_sampling_max_rounds,
            prompts_per_round=cfg.rl.dynamic_sampling_prompts_per_round,
            on_max_rounds=cfg.rl.dynamic_sampling_on_max_rounds)
    except GenerationStopped:
        raise StepAbandoned(f"step {step} abandoned during its rollout") from None
    if should_stop is not None and should_stop():  # before the old-policy pass (minutes at 20k
        raise StepAbandoned(f"step {step} abandoned after its rollout")  # tokens a response)
    metrics = {"time/rollout_s": roll.stats["time_generate"],
               "time/reward_s": roll.stats["time_reward"],
               "rollout/num_timeouts": roll.stats["num_timeouts"],
               "rollout/num_errors": roll.stats["num_errors"],
               "rollout/num_no_box": roll.stats["num_no_box"],
               "rollout/sampling_rounds": roll.stats["rounds"],
               "rollout/dropped_groups": roll.stats["dropped_groups"],
               **metrics_lib.sampler_metrics(roll.stats, "rollout")}
    for key, total in roll.stats.items():  # each of several python_fn functions' mean reward
        if key.startswith(phases.REWARD_FN_STAT):
            metrics[f"rollout/{key}"] = total / max(roll.stats["num_scored"], 1.0)
    if cfg.rl.dynamic_sampling:
        metrics.update({"rollout/padded_groups": roll.stats["padded_groups"],
                        "rollout/keep_rate": roll.stats["keep_rate"],
                        "rollout/dropped_mean_reward": roll.stats["dropped_mean_reward"]})

    adv = np.asarray(compute_advantages(jnp.asarray(roll.rewards), method=settings.advantage,
                                        group_size=G))
    rb = rollout_lib.pack_rollout(roll.samples, adv, roll.rewards, run.tokenizer.pad_token_id)
    metrics.update(rollout_lib.rollout_metrics(rb, roll.accuracy, cfg.rollout.max_new_tokens))
    if cfg.rl.mask_truncated:
        metrics["rollout/masked_truncated"] = float(rb.truncated.sum())
    host_mask = loss_mask(cfg, rb)
    batch = sharding_lib.put_batch({"input_ids": rb.input_ids,
                                    "attention_mask": rb.attention_mask,
                                    "response_mask": host_mask,
                                    "advantages": rb.advantages}, run.mesh)
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["response_mask"]

    t0 = time.perf_counter()
    cache = feature_cache_mode(cfg, run.with_delta)
    row_chunk = min(rb.num_rows, old_pass_rows(cfg))
    if cache == "host":  # host chunks come back one delta.recompute_chunk at a time
        row_chunk = min(row_chunk, cfg.delta.recompute_chunk)
    try:
        old = phases.old_policy_features(run.old_pass, params, ids, attn, rb.response_len,
                                         row_chunk=row_chunk, keep_hidden=cache,
                                         should_stop=should_stop)
    except phases.PassStopped:
        raise StepAbandoned(f"step {step} abandoned during its old-policy pass") from None
    batch["old_logp"] = jax.block_until_ready(old.logp)
    metrics["time/old_policy_s"] = time.perf_counter() - t0
    if run.ref_pass is not None:  # KL term: the frozen reference policy's log-probs
        t0 = time.perf_counter()
        ref = phases.old_policy_features(run.ref_pass, reference_params(run.ref_params, params),
                                         ids, attn, rb.response_len, row_chunk=row_chunk,
                                         keep_hidden="drop")
        batch["ref_logp"] = jax.block_until_ready(ref.logp)
        metrics["time/ref_policy_s"] = time.perf_counter() - t0
    ntok = float(jnp.sum(mask))
    metrics["rollout/old_entropy"] = float(jnp.sum(old.entropy * mask)) / max(ntok, 1.0)
    if cfg.rl.entropy_top_frac > 0:  # the high-entropy minority alone (rl/high_entropy.py)
        keep, threshold = high_entropy_mask(old.entropy, mask, cfg.rl.entropy_top_frac)
        mask = batch["response_mask"] = jax.device_put(mask * keep, mask.sharding)
        host_mask = np.asarray(fetch_global(mask), np.float32)
        metrics["rollout/entropy_threshold"] = float(threshold)
        metrics["rollout/entropy_kept_frac"] = float(host_mask.sum()) / max(ntok, 1.0)
    is_weights, is_metrics = rollout_correction.rollout_is_weights(
        old.logp, sharding_lib.put_rows(rb.sampler_logp, run.mesh), mask,
        mode=cfg.rl.rollout_is, cap=cfg.rl.rollout_is_cap)
    metrics.update({k: float(v) for k, v in jax.device_get(is_metrics).items()})

    t0 = time.perf_counter()
    weights, delta_w, diag = mask, None, {}
    if run.with_delta:
        delta = phases.DeltaSettings.from_config(cfg.delta)
        source = phases.delta_feature_source(
            old, delta, params=params, input_ids=ids, attention_mask=attn,
            hidden_pass=run.hidden_pass, topk_proxy_pass=run.topk_proxy_pass,
            proxy_row_chunk=min(rb.num_rows, old_pass_rows(cfg)))
        delta_w, diag = phases.delta_weights(
            source, batch["advantages"], mask, delta, mesh=run.mesh,
            batch_axes=sharding_lib.batch_axes(run.mesh) if run.mesh is not None else ("data",),
            key=jax.random.key(rollout_lib.step_seed(cfg.seed, step, _DELTA_SALT)))
        delta_w = jax.block_until_ready(delta_w)
        diag = {k: float(v) for k, v in jax.device_get(diag).items() if np.asarray(v).size == 1}
        if settings.use_delta:
            weights = delta_w
        metrics.update({f"delta/{k}": v for k, v in diag.items()})
    metrics["time/delta_s"] = time.perf_counter() - t0
    if cfg.rl.rollout_is != "none":  # sampler-vs-trainer correction on top of any DelTA weight
        weights = weights * is_weights
    batch["token_weights"] = weights.astype(jnp.float32)
    return PreparedBatch(rollout=roll, packed=rb, batch=batch, delta_weights=delta_w,
                         delta_diagnostics=diag, metrics=metrics, loss_mask=host_mask)


def credit_report(run: Run, prep: PreparedBatch) -> dict:
    """The ground-truth credit metrics (rl.credit.credit_metrics: credit/*) of a prepared batch:
    its response tokens labelled by run.credit_labeller against the prompts' reference solutions,
    scored with the token weights the loss uses (batch["token_weights"]: DelTA's for method
    delta, the mask for grpo / dapo) and the advantages; host numpy, timed as time/credit_s.
    Keeps the labels in prep.credit_classes. {} when the run has no labeller."""
    if run.credit_labeller is None:
        return {}
    t0 = time.perf_counter()
    rb = prep.packed
    classes = run.credit_labeller(prep.rollout.records, rb.input_ids[:, rb.prompt_len:],
                                  rb.response_mask)
    weights = np.asarray(fetch_global(prep.batch["token_weights"]), np.float32)
    out = credit.credit_metrics(classes, weights, rb.advantages, prep.loss_mask)
    prep.credit_classes = classes
    out["time/credit_s"] = time.perf_counter() - t0
    return out


class StepAbandoned(Exception):
    """rl_step was asked to stop before its updates began: the state is unchanged."""


def rl_step(run: Run, state: TrainState, step: int,
            should_stop: Callable[[], bool] = lambda: False) -> StepOutput:
    """One RL step: prepare_batch, then the mini-batch updates over permuted prompt groups.
    If should_stop() turns true during the rollout (asked after every decode call) or is true
    once the batch is prepared, the step is abandoned (StepAbandoned) before any update, so the
    caller can save the unchanged state. Once the updates begin, `state` is consumed: the train
    step donates its arrays, and with optim.offload its optimizer state's host copy is freed."""
    cfg = run.cfg
    t_start = time.perf_counter()
    prep = prepare_batch(run, state.params, step, should_stop)
    if should_stop():
        raise StepAbandoned(f"step {step} abandoned before its updates")
    metrics = prep.metrics
    metrics.update(credit_report(run, prep))  # the synthetic task's ground-truth credit/*

    t0 = time.perf_counter()
    offload = run.resting_shardings is not None
    if offload:  # optim.offload: the optimizer state comes in for the updates
        resting = state.opt_state
        state = jax.block_until_ready(optimizer_state_to(run, state, "device"))
        # Its host copy goes as the donated parameters do: the updates begin, no abandoning the
        # step now, and the copy back after them is not to sit beside it in pinned host memory.
        for leaf in jax.tree.leaves(resting):
            leaf.delete()
        metrics["time/offload_in_s"] = time.perf_counter() - t0
    state, sums, updates = phases.update_policy(
        run.train_step, state, prep.batch, num_prompts=cfg.rollout.batch_prompts,
        group_size=cfg.rollout.group_size, mini_batch_prompts=cfg.rl.mini_batch_prompts,
        epochs=cfg.rl.epochs, seed=rollout_lib.step_seed(cfg.seed, step, _SHUFFLE_SALT))
    jax.block_until_ready(state)
    if offload:  # and goes out again
        t1 = time.perf_counter()
        state = jax.block_until_ready(optimizer_state_to(run, state, "host"))
        metrics["time/offload_out_s"] = time.perf_counter() - t1
    metrics["time/update_s"] = time.perf_counter() - t0
    for k, v in finish_metrics(sums, updates).items():
        metrics[("optim/" if k == "learning_rate" else "policy/") + k] = v
    metrics["policy/skipped_updates"] = sums.get("skipped", 0.0)
    step_time = time.perf_counter() - t_start
    metrics["time/step_s"] = step_time
    rb = prep.packed
    metrics["perf/tokens_per_s"] = float(np.sum(rb.attention_mask)) / step_time
    metrics["perf/generated_tokens_per_s"] = float(np.sum(rb.response_lengths)) / max(
        metrics["time/rollout_s"], 1e-9)
    # the devices' allocator figures where the backend has them (plan mode's phases, measured)
    metrics.update(metrics_lib.device_memory_metrics())
    return StepOutput(state=state, metrics=metrics, prepared=prep)
