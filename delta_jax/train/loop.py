"""The RL loop: builds the run from a validated config, then orchestrates one step at a time.

One step (`rl_step`):
  prompts -> sampler.generate (n = group_size, seed from (seed, step))
          -> rewards (RewardScorer; DAPO overlong penalty per method)
          -> [dynamic sampling: drop zero-variance groups, refill]
          -> advantages (rl.advantages)
          -> ONE old-policy pass per row chunk: log p, entropy, h (features.py); with
             delta.proxy = "hidden_topk" the same pass gives the top-K ids/probs instead of h
          -> [rl.kl_coef > 0: one more forward pass of the frozen reference policy: ref log p]
          -> DelTA coefficients from those cached features (method delta; no extra forward pass
             unless delta.feature_cache = "recompute" with the last-layer proxy), global or
             per-shard statistics (delta.stats_mode)
          -> mini-batch updates with the pure jitted train_step (step.py)
          -> metrics; the caller checkpoints and evaluates.

`train(cfg, workdir)` runs: resume from the latest checkpoint in workdir, or SFT warm start
(sft.steps > 0) + checkpoint 0; eval before; the RL steps with checkpoints every
train.save_every and eval every train.eval_every; a final checkpoint, eval after, and the final
policy exported as a Hugging Face directory (workdir/final).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax import models
from delta_jax import sharding as sharding_lib
from delta_jax.sampling import Sampler
from delta_jax.train import features as features_lib
from delta_jax.train import rollout as rollout_lib
from delta_jax.train import sft as sft_lib
from delta_jax.train.checkpoint import Checkpointer
from delta_jax.train.config import method_settings
from delta_jax.train.metrics import MetricsWriter, summary_line, to_scalars
from delta_jax.train.state import (TrainState, init_train_state, optimizer_from_config,
                                   split_model)
from delta_jax.train.step import make_train_step

log = logging.getLogger("delta_jax.train")

_EVAL_SALT, _SHUFFLE_SALT, _ROLLOUT_SALT = 11, 13, 17
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim")


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite updates; the last checkpoint is usable."""


# ----------------------------------------------------------------------------- assets


def prepare_assets(cfg, workdir: str) -> dict:
    """Resolves data/tokenizer paths; generates the synthetic task and tiny tokenizer on demand.

    Returns {"train": path(s) or "", "eval": {name: path}, "tokenizer": dir}.
    """
    out = {"train": cfg.data.train, "eval": {}, "tokenizer": cfg.tokenizer.path or cfg.model.path}
    synth_dir = os.path.join(workdir, "synthetic")
    needs_synth = "synthetic" in (cfg.data.train, cfg.data.eval)
    if needs_synth:
        from delta_jax.data import synthetic
        levels = [int(x) for x in str(cfg.data.synthetic_levels).split(",") if x.strip()]
        train_path = os.path.join(synth_dir, "train.jsonl")
        if not os.path.exists(train_path):  # deterministic from the seed: generate once
            synthetic.write_synthetic_splits(synth_dir, num_train=cfg.data.synthetic_train,
                                             num_test=cfg.data.synthetic_test, seed=cfg.seed,
                                             levels=levels)
        if cfg.data.train == "synthetic":
            out["train"] = train_path
        if cfg.data.eval == "synthetic":
            out["eval"]["synthetic_test"] = os.path.join(synth_dir, "test.jsonl")
    if cfg.data.eval and cfg.data.eval != "synthetic":
        for path in str(cfg.data.eval).split(","):
            path = path.strip()
            if path:
                name = os.path.splitext(os.path.basename(path))[0]
                out["eval"][name] = path
    if cfg.tokenizer.path == "synthetic":
        from delta_jax.data import tiny_tokenizer
        tok_dir = os.path.join(workdir, "tokenizer")
        if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
            tiny_tokenizer.build_tiny_tokenizer(tok_dir)
        out["tokenizer"] = tok_dir
    return out


def build_model(cfg, vocab_size: int, mesh=None):
    """Random init from a preset (+ shape overrides) or a Hugging Face directory; with a mesh,
    the parameters are placed by the sharding rules (checkpoint tensors go straight to their
    shards)."""
    dtype = jnp.dtype(cfg.model.dtype)
    param_dtype = jnp.dtype(cfg.model.param_dtype)
    remat = cfg.model.remat
    if cfg.model.random_init:
        overrides = {f: cfg.model[f] for f in _SHAPE_FIELDS if cfg.model[f]}
        overrides["attention"] = cfg.model.attention  # models.attention implementation
        vocab = cfg.model.vocab_size or -(-vocab_size // 64) * 64
        mcfg = models.get_preset(cfg.model.preset, vocab_size=vocab, dtype=dtype,
                                 param_dtype=param_dtype, remat=remat, **overrides)
        model = models.Transformer(mcfg, rngs=nnx.Rngs(cfg.seed))
        return model if mesh is None else sharding_lib.shard_model(model, mesh)
    shardings = None if mesh is None else sharding_lib.param_sharding_fn(mesh)
    return models.from_pretrained(cfg.model.path, dtype=dtype, param_dtype=param_dtype,
                                  remat=remat, attention=cfg.model.attention, shardings=shardings)


def make_loss_fn(cfg) -> Callable:
    """loss_fn(logp, old_logp, adv, mask, weights, entropy) -> (sum, denom, metric sums)."""
    from delta_jax.rl import losses

    loss_cfg = losses.PolicyLossConfig(
        eps_low=cfg.rl.eps_low, eps_high=cfg.rl.eps_high,
        dual_clip=cfg.rl.dual_clip if cfg.rl.dual_clip > 0 else None,
        log_ratio_clamp=cfg.rl.log_ratio_clamp, agg=cfg.rl.agg,
        # Dr.GRPO's constant normaliser: the maximum response length.
        drgrpo_norm=(float(cfg.rollout.max_new_tokens)
                     if cfg.rl.agg == "seq-mean-token-sum-norm" else None),
        entropy_coef=cfg.rl.entropy_coef,
        kl_type=cfg.rl.kl_type if cfg.rl.kl_coef > 0 else None, kl_coef=cfg.rl.kl_coef)

    def loss_fn(logp, old_logp, advantages, mask, token_weights, entropy, ref_logp=None):
        return losses.policy_loss(logp, old_logp, advantages, mask, token_weights=token_weights,
                                  cfg=loss_cfg, entropy=entropy, ref_logp=ref_logp)

    return loss_fn


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


# ----------------------------------------------------------------------------- run


@dataclasses.dataclass
class Run:
    """Everything a step needs; built once by build_run."""
    cfg: Any
    workdir: str
    assets: dict
    tokenizer: Any
    graphdef: Any
    rest: Any
    template: Callable[[str], str]
    sampler: Sampler
    optimizer: Any
    schedule: Any
    train_step: Callable
    old_pass: Callable
    hidden_pass: Callable
    ckpt: Checkpointer
    writer: MetricsWriter
    data_iter: Any = None
    scorer: Any = None
    eval_scorer: Any = None      # accuracy only (no overlong shaping); made on first eval
    counters: dict = dataclasses.field(default_factory=dict)
    debug_record: bool = False   # tests: keep the last step's inputs in `debug`
    debug: dict = dataclasses.field(default_factory=dict)
    initial_params: Any = None
    mesh: Any = None             # the (data, fsdp, tensor) mesh shared by sampler and trainer
    state_shardings: Any = None  # TrainState-shaped NamedShardings (delta_jax.sharding)
    topk_proxy_pass: Any = None  # delta.proxy = "hidden_topk": (params, labels, ids, probs) -> v
    ref_pass: Any = None         # rl.kl_coef > 0: log-probs of the reference policy
    ref_params: Any = None       # rl.kl_coef > 0: the frozen reference parameters

    def count(self, name: str, k: int = 1):
        self.counters[name] = self.counters.get(name, 0) + k

    def model(self, params):
        return nnx.merge(self.graphdef, params, self.rest)

    def close(self):
        for scorer in (self.scorer, self.eval_scorer):
            if scorer is not None:
                scorer.close()
        self.ckpt.close()
        self.writer.close()


def build_run(cfg, workdir: str, *, need_data: bool = True, need_scorer: bool = True,
              mesh=None) -> Run:
    """Everything a run needs. mesh: a delta_jax.sharding mesh (default: from config.mesh)."""
    from delta_jax.data import templates

    os.makedirs(workdir, exist_ok=True)
    assets = prepare_assets(cfg, workdir)
    tokenizer = models.load_tokenizer(assets["tokenizer"])
    mesh = sharding_lib.mesh_from_config(cfg.mesh) if mesh is None else mesh
    model = build_model(cfg, tokenizer.vocab_size, mesh=mesh)
    graphdef, params, rest = split_model(model)
    optimizer, schedule = optimizer_from_config(cfg.optim, cfg.train.steps * _updates_per_step(cfg))
    state_shardings = sharding_lib.tree_shardings(
        jax.eval_shape(lambda p: init_train_state(p, optimizer), params), mesh)
    template = templates.make_template(cfg.data.template, tokenizer=tokenizer)
    sampler = Sampler(model, tokenizer, max_batch_size=cfg.rollout.max_batch_size,
                      max_prompt_len=cfg.data.max_prompt_len, truncate_prompts="left",
                      pad_id=tokenizer.pad_token_id, mesh=mesh,
                      batch_axes=sharding_lib.batch_axes(mesh))
    run = Run(
        cfg=cfg, workdir=workdir, assets=assets, tokenizer=tokenizer, graphdef=graphdef,
        rest=rest, template=template, sampler=sampler, optimizer=optimizer, schedule=schedule,
        train_step=None, old_pass=None, hidden_pass=None,
        ckpt=Checkpointer(os.path.join(workdir, "checkpoints"), save_every=cfg.train.save_every,
                          keep=cfg.train.keep),
        writer=MetricsWriter(workdir) if jax.process_index() == 0 else _NullWriter(),
        initial_params=params, mesh=mesh, state_shardings=state_shardings)
    if cfg.mode == "train":
        run.train_step = make_train_step(
            graphdef, rest, optimizer, make_loss_fn(cfg), temperature=cfg.rollout.temperature,
            chunk_size=cfg.model.logprob_chunk, micro_batch_size=cfg.rl.micro_batch_size,
            schedule=schedule, mesh=mesh, state_shardings=state_shardings)
        topk = cfg.delta.topk if _uses_topk_proxy(cfg) else 0
        run.old_pass = features_lib.make_old_policy_pass(
            graphdef, rest, temperature=cfg.rollout.temperature,
            chunk_size=cfg.model.logprob_chunk, mesh=mesh, topk=topk, with_hidden=not topk)
        run.hidden_pass = features_lib.make_hidden_pass(graphdef, rest, mesh=mesh)
        if topk:
            mcfg = model.cfg
            run.topk_proxy_pass = features_lib.make_topk_proxy_pass(
                graphdef, rest, mesh=mesh, chunk_size=features_lib.proxy_token_chunk(
                    cfg.model.logprob_chunk, mcfg.vocab_size, topk, mcfg.hidden_size))
        if cfg.rl.kl_coef > 0:
            run.ref_pass = features_lib.make_old_policy_pass(
                graphdef, rest, temperature=cfg.rollout.temperature,
                chunk_size=cfg.model.logprob_chunk, mesh=mesh, with_hidden=False)
            # A copy: the train step donates (and so frees) the buffers of the live parameters.
            # train() replaces it with the post-SFT parameters when there is a warm start.
            run.ref_params = _copy_tree(params)
    if need_data and cfg.mode == "train":
        from delta_jax.data import builders, pipeline
        source = builders.build_tfds_source(assets["train"],
                                            data_dir=os.path.join(workdir, "tfds"))
        run.data_iter = pipeline.make_prompt_pipeline(
            source, batch_size=cfg.rollout.batch_prompts, seed=cfg.seed, shuffle=True,
            template=template, encode_fn=tokenizer.encode)
    if need_scorer and cfg.mode == "train":
        from delta_jax.rl.rewards import RewardScorer
        overlong = cfg.rewards.overlong
        run.scorer = RewardScorer(
            name=cfg.rewards.name, num_workers=cfg.rewards.num_workers,
            timeout_s=cfg.rewards.timeout_s, max_response_len=cfg.rollout.max_new_tokens,
            overlong_buffer_len=cfg.rewards.overlong_buffer if overlong else 0,
            overlong_penalty_factor=cfg.rewards.overlong_factor)
    return run


class _NullWriter:
    """Metrics sink of processes other than 0 (metrics are logged once)."""

    def write(self, step, metrics, prefix=""):
        return {prefix + k: v for k, v in to_scalars(metrics).items()}

    def write_text(self, step, tag, text):
        pass

    def close(self):
        pass


def place_state(run: Run, state: TrainState) -> TrainState:
    """The train state on the run's mesh, by its logical-axis shardings."""
    if run.state_shardings is None:
        return state
    return sharding_lib.shard_tree(state, run.state_shardings)


def _uses_topk_proxy(cfg) -> bool:
    return cfg.method == "delta" and cfg.delta.proxy == "hidden_topk"


def _copy_tree(tree):
    """Fresh device buffers with the same values and shardings."""
    return jax.tree.map(lambda x: x.copy(), tree)


def _updates_per_step(cfg) -> int:
    return cfg.rl.epochs * (cfg.rollout.batch_prompts // cfg.rl.mini_batch_prompts)


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


def _stats_kwargs(run, d) -> dict:
    """delta_coefficients' statistics mode: global, or per data shard of the run's mesh (the
    reference implementation's behaviour), over the mesh axes the batch rows are split over."""
    if d.get("stats_mode", "global") != "per_shard":
        return {}
    mesh = getattr(run, "mesh", None)
    axes = sharding_lib.batch_axes(mesh) if mesh is not None else ("data",)
    return {"stats_mode": "per_shard", "mesh": mesh, "data_axes": axes}


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
        chunks, num_refine=d.num_refine, lam_min=d.lam_min, lam_max=d.lam_max)
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
        chunks, num_refine=d.num_refine, lam_min=d.lam_min, lam_max=d.lam_max)
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
    if not settings.use_delta or _uses_topk_proxy(cfg):
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


# ----------------------------------------------------------------------------- eval


def evaluate_policy(run: Run, params, step: int) -> dict:
    """avg@k / pass@k on the eval benchmarks with the eval sampling settings."""
    cfg = run.cfg
    if not run.assets["eval"]:
        return {}
    from delta_jax import evaluation
    from delta_jax.rl.rewards import RewardScorer

    if run.eval_scorer is None:
        run.eval_scorer = RewardScorer(name="math", num_workers=cfg.rewards.num_workers,
                                       timeout_s=cfg.rewards.timeout_s)
    run.sampler.update_params(run.model(params))
    calls = [0]

    def generate_fn(prompts, n):
        calls[0] += 1
        out = run.sampler.generate(
            list(prompts), n=n, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
            max_new_tokens=cfg.eval.max_new_tokens,
            stop_token_ids=(run.tokenizer.eos_token_id,),
            seed=rollout_lib.step_seed(cfg.seed, step, _EVAL_SALT + calls[0]))
        return out.texts

    t0 = time.perf_counter()
    pass_k = [int(x) for x in str(cfg.eval.pass_k).split(",")]
    result = evaluation.evaluate(
        generate_fn, run.assets["eval"], k=cfg.eval.k, pass_ks=pass_k,
        format_prompt=run.template, limit=cfg.eval.limit or None, scorer=run.eval_scorer,
        settings={"step": step, "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p,
                  "max_new_tokens": cfg.eval.max_new_tokens})
    metrics = _flatten_eval(result)
    metrics["time/eval_s"] = time.perf_counter() - t0
    os.makedirs(os.path.join(run.workdir, "eval"), exist_ok=True)
    with open(os.path.join(run.workdir, "eval", f"step_{step}.json"), "w") as f:
        f.write(result.to_json() if hasattr(result, "to_json") else str(result))
    if hasattr(result, "to_markdown"):
        run.writer.write_text(step, "eval", result.to_markdown())
    return metrics


def _flatten_eval(result) -> dict:
    import json
    data = json.loads(result.to_json()) if hasattr(result, "to_json") else dict(result)
    out = {}

    def walk(prefix, value):
        if prefix == "settings":
            return
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out["eval/" + prefix] = float(value)
    walk("", data)
    return out


# ----------------------------------------------------------------------------- drivers


def run_sft(run: Run, params, log_every: int = 10):
    """Supervised warm start; returns the new params (the RL optimizer starts fresh after)."""
    from delta_jax.data import records as records_lib
    from delta_jax.train.state import learning_rate_schedule, make_optimizer

    cfg = run.cfg
    recs, _ = records_lib.load_records(run.assets["train"])
    examples = sft_lib.tokenize_examples(recs, run.tokenizer, run.template, cfg.sft.max_len)
    schedule = learning_rate_schedule(cfg.sft.lr, "cosine", cfg.sft.warmup_steps, cfg.sft.steps,
                                      0.1)
    optimizer = make_optimizer(schedule, weight_decay=cfg.sft.weight_decay,
                               max_grad_norm=cfg.optim.max_grad_norm)
    step_fn = sft_lib.make_sft_step(run.graphdef, run.rest, optimizer, schedule,
                                    chunk_size=cfg.model.logprob_chunk)
    state = init_train_state(params, optimizer)
    bar = _progress(cfg, cfg.sft.steps, "sft")
    for step in range(1, cfg.sft.steps + 1):
        batch = sft_lib.sft_batch(examples, cfg.sft.batch_size, cfg.seed, step)
        state, m = step_fn(state, jax.tree.map(jnp.asarray, batch))
        if step % log_every == 0 or step == cfg.sft.steps:
            scalars = run.writer.write(step, jax.device_get(m))
            _bar_update(bar, step, f"sft loss {scalars['sft/loss']:.3f}")
    if bar is not None:
        bar.close()
    return state.params


def _progress(cfg, total, desc):
    if not cfg.train.progress_bar:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, dynamic_ncols=True)


def _bar_update(bar, step, text):
    if bar is None:
        log.info(text)
        return
    bar.n = step
    bar.set_postfix_str(text)
    bar.refresh()


def train(cfg, workdir: str, *, run: Run | None = None) -> tuple[TrainState, Run]:
    """RL training (mode train); returns the final state and the run (caller closes it)."""
    run = run or build_run(cfg, workdir)
    init_state = place_state(run, init_train_state(run.initial_params, run.optimizer))
    latest = run.ckpt.latest_step()
    nonfinite_streak = 0
    if latest is not None:
        state, data_state, meta = run.ckpt.restore(latest, init_state)
        run.data_iter.set_state(data_state)
        nonfinite_streak = int(meta.get("nonfinite_streak", 0))
        start = latest
        if run.ref_pass is not None and cfg.sft.steps > 0:
            run.ref_params = _restore_reference(run, state.params)
        log.info("resumed from %s at step %d", run.ckpt.directory, latest)
    else:
        state = init_state
        if cfg.sft.steps > 0:
            state = place_state(run, init_train_state(run_sft(run, state.params),
                                                      run.optimizer))
            if run.ref_pass is not None:  # the KL reference is the policy after the warm start
                run.ref_params = _copy_tree(state.params)
                _save_reference(run, run.ref_params)
        run.ckpt.save(0, state, run.data_iter.get_state(), _meta(cfg, 0), force=True)
        if cfg.train.eval_before:
            _write_eval(run, state.params, 0)
        start = 0

    bar = _progress(cfg, cfg.train.steps, f"rl ({cfg.method})")
    for step in range(start + 1, cfg.train.steps + 1):
        state, metrics = rl_step(run, state, step)
        skipped = metrics.get("policy/skipped_updates", 0.0)
        nonfinite_streak = nonfinite_streak + 1 if skipped > 0 else 0
        metrics["policy/nonfinite_streak"] = float(nonfinite_streak)
        scalars = run.writer.write(step, metrics)
        line = summary_line(step, scalars)
        if bar is not None:
            _bar_update(bar, step, line)
        if step % cfg.train.log_every == 0:  # the one-line summary (once, with or without a bar)
            log.info(line)
        if nonfinite_streak > cfg.rl.max_nonfinite:
            run.ckpt.save(step, state, run.data_iter.get_state(),
                          _meta(cfg, step, nonfinite_streak), force=True)
            raise NonFiniteError(
                f"step {step}: {nonfinite_streak} consecutive steps with non-finite loss or "
                f"gradients (rl.max_nonfinite={cfg.rl.max_nonfinite}); parameters were left "
                f"unchanged by those updates; the last checkpoint in {run.ckpt.directory} "
                "is usable")
        saved = run.ckpt.save(step, state, run.data_iter.get_state(),
                              _meta(cfg, step, nonfinite_streak),
                              force=step == cfg.train.steps)
        if saved and cfg.debug.kill_after_step == step:
            os.kill(os.getpid(), signal.SIGKILL)  # tests: a real crash right after the save
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
            _write_eval(run, state.params, step)
    if bar is not None:
        bar.close()
    if cfg.train.eval_after and start < cfg.train.steps:
        _write_eval(run, state.params, cfg.train.steps)
    if cfg.train.export_final:
        models.save_pretrained(run.model(state.params), os.path.join(workdir, "final"))
        run.tokenizer.hf.save_pretrained(os.path.join(workdir, "final"))
    return state, run


def _reference_dir(run: Run) -> str:
    return os.path.join(run.workdir, "reference")


def _save_reference(run: Run, params):
    """Keeps the post-SFT reference policy for resumes (without SFT it is rebuilt from the
    config: random init from the seed, or model.path)."""
    ckpt = Checkpointer(_reference_dir(run), keep=1)
    try:
        ckpt.save(0, params, None, {"what": "KL reference policy (parameters after SFT)"},
                  force=True)
    finally:
        ckpt.close()


def _restore_reference(run: Run, target):
    ckpt = Checkpointer(_reference_dir(run), keep=1)
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(
                f"rl.kl_coef: resuming a run with an SFT warm start needs its KL reference "
                f"policy in {_reference_dir(run)}, which is missing (was rl.kl_coef 0 when the "
                "run started?)")
        params, _, _ = ckpt.restore(0, target)
        return params
    finally:
        ckpt.close()


def _write_eval(run: Run, params, step: int):
    metrics = evaluate_policy(run, params, step)
    if metrics:
        run.writer.write(step, metrics)
        log.info("eval step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))


def _meta(cfg, step, nonfinite_streak=0) -> dict:
    return {"seed": int(cfg.seed), "step": int(step), "method": cfg.method,
            "nonfinite_streak": int(nonfinite_streak)}


def sft_only(cfg, workdir: str):
    """Mode sft: the warm start alone, exported as a HF directory (workdir/sft)."""
    run = build_run(cfg, workdir, need_scorer=False)
    try:
        params = run_sft(run, run.initial_params)
        models.save_pretrained(run.model(params), os.path.join(workdir, "sft"))
        run.tokenizer.hf.save_pretrained(os.path.join(workdir, "sft"))
        return params
    finally:
        run.close()


def eval_only(cfg, workdir: str) -> dict:
    """Mode eval: evaluate model.path (or the latest checkpoint in workdir if there is one)."""
    run = build_run(cfg, workdir, need_data=False)
    try:
        params = run.initial_params
        latest = run.ckpt.latest_step()
        if latest is not None:
            optimizer = run.optimizer
            state, _, _ = run.ckpt.restore(latest, place_state(
                run, init_train_state(params, optimizer)))
            params = state.params
        metrics = evaluate_policy(run, params, latest or 0)
        run.writer.write(latest or 0, metrics)
        return metrics
    finally:
        run.close()
