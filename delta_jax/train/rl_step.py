"""One RL step (`rl_step`):
  prompts -> sampler.generate (n = group_size, seed from (seed, step))
          -> rewards (RewardScorer; DAPO overlong penalty per method)
          -> [dynamic sampling: drop zero-variance groups, refill]
          -> advantages (rl.advantages)
          -> ONE old-policy pass per row chunk: log p, entropy, h (features.py); with
             delta.proxy = "hidden_topk" the same pass gives the top-K ids/probs instead of h
          -> [rl.kl_coef > 0: one more forward pass of the frozen reference policy: ref log p]
          -> DelTA coefficients from those cached features (method delta; no extra forward pass
             unless delta.feature_cache = "recompute" with the last-layer proxy), global or
             per-shard statistics (delta.stats_mode), XLA or fused-kernel passes
             (delta.pass_impl)
          -> mini-batch updates with the pure jitted train_step (step.py)
          -> metrics; the caller (loop.train) checkpoints and evaluates.
"""
from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax import sharding as sharding_lib
from delta_jax.train import features as features_lib
from delta_jax.train import rollout as rollout_lib
from delta_jax.train.config import method_settings
from delta_jax.train.run import Run, uses_topk_proxy
from delta_jax.train.state import TrainState

_SHUFFLE_SALT, _ROLLOUT_SALT = 13, 17

# Step-level values of train_step's metrics (everything else is a loss-metric sum).
_MEAN_OVER_UPDATES = ("loss", "grad_norm", "learning_rate")
_SUM_OVER_UPDATES = ("skipped", "loss_denominator")


def finish_metrics(sums: dict, num_updates: int) -> dict:
    """Metrics of one RL step from train_step metrics summed over its mini-batch updates:
    loss-metric sums -> means (rl.losses.finalize_metrics), loss / grad norm / lr averaged."""
    from delta_jax.rl import losses

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


# ----------------------------------------------------------------------------- one RL step


def _generate_and_score(run: Run, records, params, seed: int):
    """(samples, rewards [P*G], info) for a list of prompt records."""
    cfg = run.cfg
    run.sampler.update_params(run.model(params))
    t0 = time.perf_counter()
    samples = run.sampler.generate(
        [r["prompt_ids"] for r in records], n=cfg.rollout.group_size,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=(run.tokenizer.eos_token_id,), seed=seed)
    t1 = time.perf_counter()
    golds = [str(r["answer"]) for r in records for _ in range(cfg.rollout.group_size)]
    rewards, info = run.scorer.score(
        rollout_lib.flat(samples.texts), golds,
        response_lengths=np.asarray(rollout_lib.flat(samples.response_lengths)),
        truncated=np.asarray(rollout_lib.flat(samples.truncated)))
    info["time_generate"] = t1 - t0
    info["time_reward"] = time.perf_counter() - t1
    return samples, rewards, info


def collect_rollout(run: Run, params, step: int):
    """Prompts -> samples -> rewards (with DAPO dynamic sampling when on). Returns
    (samples, rewards [N], accuracy [N], metrics)."""
    cfg = run.cfg
    G = cfg.rollout.group_size
    want = cfg.rollout.batch_prompts
    parts, rew_parts, acc_parts = [], [], []
    metrics = {"time/rollout_s": 0.0, "time/reward_s": 0.0, "rollout/num_timeouts": 0.0,
               "rollout/num_no_box": 0.0}
    have, rounds, dropped = 0, 0, 0
    max_rounds = cfg.rl.dynamic_sampling_max_rounds if cfg.rl.dynamic_sampling else 1
    while have < want:
        if rounds >= max_rounds:
            raise RuntimeError(
                f"dynamic sampling: only {have} of {want} prompt groups with non-constant "
                f"rewards after rl.dynamic_sampling_max_rounds={max_rounds} rounds (step {step}); "
                "raise the cap, or the task is too easy/hard for the policy")
        records = next(run.data_iter)
        samples, rewards, info = _generate_and_score(
            run, records, params, rollout_lib.step_seed(cfg.seed, step, _ROLLOUT_SALT + rounds))
        rounds += 1
        metrics["time/rollout_s"] += info["time_generate"]
        metrics["time/reward_s"] += info["time_reward"]
        metrics["rollout/num_timeouts"] += info["num_timeouts"]
        metrics["rollout/num_no_box"] += info["num_no_box"]
        keep = np.arange(len(records))
        if cfg.rl.dynamic_sampling:
            from delta_jax.rl.dynamic_sampling import group_has_signal
            signal_mask = np.asarray(group_has_signal(np.asarray(rewards).reshape(-1, G)))
            keep = np.nonzero(signal_mask)[0][:want - have]
            dropped += int((~signal_mask).sum())
        if len(keep) == 0:
            continue
        parts.append(rollout_lib.select_groups(samples, keep))
        rows = (keep[:, None] * G + np.arange(G)[None]).reshape(-1)
        rew_parts.append(np.asarray(rewards)[rows])
        acc_parts.append(np.asarray(info["accuracy"])[rows])
        have += len(keep)
    metrics["rollout/sampling_rounds"] = float(rounds)
    metrics["rollout/dropped_groups"] = float(dropped)
    samples = parts[0] if len(parts) == 1 else rollout_lib.concat_samples(parts)
    return samples, np.concatenate(rew_parts), np.concatenate(acc_parts), metrics


def _pass_kwargs(d) -> dict:
    """delta.pass_impl: "jnp" (rl/delta.py's XLA passes) or "kernel" (kernels.delta_pass_auto)."""
    return {"pass_impl": d.get("pass_impl", "jnp")}


def _stats_kwargs(run, d) -> dict:
    """delta_coefficients' statistics mode: global, or per data shard of the run's mesh (the
    reference implementation's behaviour), over the mesh axes the batch rows are split over.
    With the fused kernel passes the global mode gets the mesh too (one kernel call per batch
    shard, statistics psummed), as a Pallas call is not partitioned by XLA."""
    kwargs = _pass_kwargs(d)
    mesh = getattr(run, "mesh", None)
    axes = sharding_lib.batch_axes(mesh) if mesh is not None else ("data",)
    if d.get("stats_mode", "global") == "per_shard":
        return {**kwargs, "stats_mode": "per_shard", "mesh": mesh, "data_axes": axes}
    if kwargs["pass_impl"] == "kernel" and mesh is not None and axes:
        return {**kwargs, "mesh": mesh, "data_axes": axes}
    return kwargs


def compute_delta_weights(run: Run, params, batch, logp, hidden, adv, mask, topk=None):
    """DelTA weights [N, R] from the old-policy features, per delta.feature_cache.

    Last-layer proxy (default): v = (1 - p) h from logp and hidden. Top-K proxy
    (delta.proxy = "hidden_topk"): topk = (ids [N, R, K], probs [N, R, K]) from the old-policy
    pass; v [N, R, H] is built from them and the LM head (run.topk_proxy_pass, no trunk pass):
    at once on device for feature_cache "device", chunk by chunk for "host" / "recompute".
    """
    from delta_jax.rl import delta as delta_lib

    d = run.cfg.delta
    if d.get("proxy", "last_layer") == "hidden_topk":
        return _topk_delta_weights(run, params, batch, topk, adv, mask)
    if d.feature_cache == "device":
        return delta_lib.delta_coefficients(hidden, jnp.exp(logp), adv, mask,
                                            num_refine=d.num_refine, lam_min=d.lam_min,
                                            lam_max=d.lam_max, **_stats_kwargs(run, d))
    chunk = d.recompute_chunk
    n = mask.shape[0]
    starts = range(0, n, chunk)
    scale = 1.0 - jnp.exp(logp)

    if d.feature_cache == "host":
        def chunks():
            for s in starts:
                yield delta_lib.FeatureChunk(jnp.asarray(hidden[s:s + chunk]), adv[s:s + chunk],
                                             mask[s:s + chunk], scale[s:s + chunk])
    else:  # recompute: stream the trunk again, chunk by chunk (no LM head)
        ids, attn = batch["input_ids"], batch["attention_mask"]

        def chunks():
            for s in starts:
                run.count("trunk_forward")
                h = run.hidden_pass(params, ids[s:s + chunk], attn[s:s + chunk],
                                    mask.shape[1])
                yield delta_lib.FeatureChunk(h, adv[s:s + chunk], mask[s:s + chunk],
                                             scale[s:s + chunk])
    weight_chunks, diag = delta_lib.delta_coefficients_streaming(
        chunks, num_refine=d.num_refine, lam_min=d.lam_min, lam_max=d.lam_max,
        **_pass_kwargs(d))
    return jnp.concatenate(weight_chunks), diag


def _topk_delta_weights(run: Run, params, batch, topk, adv, mask):
    """DelTA weights with the top-K hidden-gradient proxy (see compute_delta_weights)."""
    from delta_jax.rl import delta as delta_lib

    if topk is None or run.topk_proxy_pass is None:
        raise ValueError("delta.proxy='hidden_topk' needs the old-policy pass's top-K ids and "
                         "probabilities (build the run with that proxy)")
    d = run.cfg.delta
    ids, probs = topk
    n, response_len = mask.shape
    labels = batch["input_ids"][:, -response_len:]

    def proxy(s, e):
        run.count("topk_proxy")
        return run.topk_proxy_pass(params, labels[s:e], ids[s:e], probs[s:e])

    if d.feature_cache == "device":
        # The old-policy pass's row chunk: the gathered head rows per call are bounded like its
        # logits chunk (features.proxy_token_chunk).
        chunk = min(n, run.cfg.rollout.max_batch_size)
        parts = [proxy(s, s + chunk) for s in range(0, n, chunk)]
        v = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        return delta_lib.delta_coefficients(None, None, adv, mask, num_refine=d.num_refine,
                                            lam_min=d.lam_min, lam_max=d.lam_max, features=v,
                                            **_stats_kwargs(run, d))
    # host / recompute: v is rebuilt per chunk from the small top-K arrays in every pass.
    chunk = d.recompute_chunk

    def chunks():
        for s in range(0, n, chunk):
            yield delta_lib.FeatureChunk(proxy(s, s + chunk), adv[s:s + chunk],
                                         mask[s:s + chunk], None)
    weight_chunks, diag = delta_lib.delta_coefficients_streaming(
        chunks, num_refine=d.num_refine, lam_min=d.lam_min, lam_max=d.lam_max,
        **_pass_kwargs(d))
    return jnp.concatenate(weight_chunks), diag


def rl_step(run: Run, state: TrainState, step: int):
    """One RL step; returns (new state, metrics dict of Python floats)."""
    cfg = run.cfg
    settings = method_settings(cfg)
    G = cfg.rollout.group_size
    t_start = time.perf_counter()
    samples, rewards, accuracy, metrics = collect_rollout(run, state.params, step)

    from delta_jax.rl.advantages import compute_advantages
    adv = np.asarray(compute_advantages(jnp.asarray(rewards), method=settings.advantage,
                                        group_size=G))
    rb = rollout_lib.pack_rollout(samples, adv, rewards, run.tokenizer.pad_token_id)
    metrics.update(rollout_lib.rollout_metrics(rb, accuracy, cfg.rollout.max_new_tokens))
    batch = sharding_lib.put_batch({"input_ids": rb.input_ids,
                                    "attention_mask": rb.attention_mask,
                                    "response_mask": rb.response_mask,
                                    "advantages": rb.advantages}, run.mesh)

    # The one old-policy pass: log p + entropy + hidden states of the response tokens.
    t0 = time.perf_counter()
    keep_hidden = ("device" if cfg.delta.feature_cache == "device" else
                   "host" if cfg.delta.feature_cache == "host" else "drop")
    if not settings.use_delta or uses_topk_proxy(cfg):
        keep_hidden = "drop"
    counted = _counting(run, "old_policy_forward", run.old_pass)
    row_chunk = min(rb.num_rows, cfg.rollout.max_batch_size)
    logp, entropy, hidden, *topk = features_lib.run_in_chunks(
        counted, state.params, batch["input_ids"], batch["attention_mask"], rb.response_len,
        chunk=row_chunk, keep_hidden=keep_hidden)
    logp = jax.block_until_ready(logp)
    metrics["time/old_policy_s"] = time.perf_counter() - t0
    if run.ref_pass is not None:  # KL term: the frozen reference policy's log-probs
        t0 = time.perf_counter()
        ref_logp, _, _ = features_lib.run_in_chunks(
            _counting(run, "ref_forward", run.ref_pass), run.ref_params, batch["input_ids"],
            batch["attention_mask"], rb.response_len, chunk=row_chunk, keep_hidden="drop")
        batch["ref_logp"] = jax.block_until_ready(ref_logp)
        metrics["time/ref_policy_s"] = time.perf_counter() - t0
    mask = batch["response_mask"]
    ntok = float(jnp.sum(mask))
    metrics["rollout/old_entropy"] = float(jnp.sum(entropy * mask)) / max(ntok, 1.0)
    metrics["rollout/sampler_logp_abs_diff_max"] = float(jnp.max(
        jnp.abs(logp - jnp.asarray(rb.sampler_logp)) * mask))

    t0 = time.perf_counter()
    if settings.use_delta:
        weights, diag = compute_delta_weights(run, state.params, batch, logp, hidden,
                                              batch["advantages"], mask, topk=topk or None)
        weights = jax.block_until_ready(weights)
        metrics.update({f"delta/{k}": float(v) for k, v in diag.items()
                        if np.asarray(v).size == 1})
        from delta_jax.train import plots  # per-side weight histograms for the run's plots
        plots.append_weight_histogram(run.workdir, step, weights, batch["advantages"], mask,
                                      cfg.delta.lam_min, cfg.delta.lam_max)
    else:
        weights = mask
    metrics["time/delta_s"] = time.perf_counter() - t0
    batch["old_logp"] = logp
    batch["token_weights"] = weights.astype(jnp.float32)
    del hidden  # the feature cache lives only until the coefficients are computed
    if run.debug_record:
        run.debug = {"params": jax.device_get(state.params), "batch": jax.device_get(batch),
                     "rewards": rewards, "response_len": rb.response_len}

    # Mini-batch updates over permuted prompt groups.
    t0 = time.perf_counter()
    num_mini = cfg.rollout.batch_prompts // cfg.rl.mini_batch_prompts
    sums: dict = {}
    rng = np.random.default_rng(rollout_lib.step_seed(cfg.seed, step, _SHUFFLE_SALT))
    for _ in range(cfg.rl.epochs):
        order = rng.permutation(cfg.rollout.batch_prompts)
        for m in range(num_mini):
            groups = order[m * cfg.rl.mini_batch_prompts:(m + 1) * cfg.rl.mini_batch_prompts]
            rows = jnp.asarray((groups[:, None] * G + np.arange(G)[None]).reshape(-1))
            mb = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), batch)
            run.count("train_step")
            state, m_metrics = run.train_step(state, mb)
            for k, v in jax.device_get(m_metrics).items():
                sums[k] = sums.get(k, 0.0) + float(v)
    jax.block_until_ready(state.params)
    metrics["time/update_s"] = time.perf_counter() - t0
    updates = cfg.rl.epochs * num_mini
    for k, v in finish_metrics(sums, updates).items():
        metrics[("optim/" if k == "learning_rate" else "policy/") + k] = v
    metrics["policy/skipped_updates"] = sums.get("skipped", 0.0)
    step_time = time.perf_counter() - t_start
    metrics["time/step_s"] = step_time
    tokens = float(np.sum(rb.attention_mask))
    metrics["perf/tokens_per_s"] = tokens / step_time
    metrics["perf/generated_tokens_per_s"] = float(np.sum(rb.response_lengths)) / max(
        metrics["time/rollout_s"], 1e-9)
    return state, metrics


def _counting(run: Run, name: str, fn: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        run.count(name)
        return fn(*args, **kwargs)
    return wrapped
