"""Evaluation hook of the RL loop: avg@k / pass@k of the current policy on the eval benchmarks
(delta_jax.evaluation), written to workdir/eval/step_<n>.json and the metrics log (with
eval.save_responses every sample's response too: train/generations.py).
"""
from __future__ import annotations

import logging
import os
import time

import jax
import numpy as np

from delta_jax import files
from delta_jax import sharding as sharding_lib
from delta_jax.sampling.progress import ProgressLog
from delta_jax.train import generations
from delta_jax.train import rollout as rollout_lib
from delta_jax.train.metrics import read_jsonl, sampler_metrics
from delta_jax.train.run import Run

log = logging.getLogger("delta_jax.train")

_EVAL_SALT = 11

def evaluate_policy(run: Run, params, step: int, *, file_stem: str | None = None,
                    should_stop=None):
    """avg@k / pass@k on the eval benchmarks with the eval sampling settings; writes
    eval/<file_stem>.json (default step_<step>) and returns (flat metrics, the evaluation
    result), ({}, None) without eval benchmarks. should_stop: asked after every decode call
    (sampling.GenerationStopped when it turns true; nothing is written then)."""
    cfg = run.cfg
    if not run.benchmarks:
        return {}, None
    from delta_jax import evaluation
    from delta_jax.train.run import add_eval_scorers

    # Each benchmark is graded by its own kind's reward (accuracy only) and asked for that kind's
    # answer form (run.eval_prompts): a math run's HumanEval runs unit tests on a ```python block.
    add_eval_scorers(cfg, run.eval_prompts, run.eval_scorers, run.scorer)
    run.sampler.update_params(run.model(params))
    generate_fn = evaluation.sampler_generate_fn(
        run.sampler, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
        max_new_tokens=cfg.eval.max_new_tokens, stop_token_ids=(run.tokenizer.eos_token_id,),
        seeds=lambda i: rollout_lib.step_seed(cfg.seed, step, _EVAL_SALT + 1 + i),
        progress=ProgressLog(f"eval step {step}", cfg.train.progress_every_s),
        should_stop=should_stop)

    t0 = time.perf_counter()
    pass_k = [int(x) for x in str(cfg.eval.pass_k).split(",")]
    result = evaluation.evaluate(
        generate_fn, run.benchmarks, k=cfg.eval.k, pass_ks=pass_k,
        format_prompt=run.eval_prompts, limit=cfg.eval.limit or None, scorer=run.eval_scorers,
        settings={"step": step, "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p,
                  "max_new_tokens": cfg.eval.max_new_tokens})
    metrics = result.flat_metrics()
    metrics["time/eval_s"] = time.perf_counter() - t0
    if generate_fn.sampler_counters:  # the sampler's side: tokens/s, preemptions, ...
        metrics.update(sampler_metrics(generate_fn.sampler_counters, "eval"))
    os.makedirs(os.path.join(run.workdir, "eval"), exist_ok=True)
    stem = file_stem or f"step_{step}"
    if jax.process_index() == 0:
        files.write_text(os.path.join(run.workdir, "eval", f"{stem}.json"), result.to_json())
        if cfg.eval.save_responses:
            generations.write_eval_responses(run.workdir, stem, result)
    if file_stem is None:
        run.writer.write_text(step, "eval", result.to_markdown())
    return metrics, result



def write_eval(run: Run, params, step: int, should_stop=None) -> dict | None:
    """evaluate_policy at `step`, its metrics written and logged and returned ({} without eval
    benchmarks); None when should_stop ended it (nothing written: the training loop stops)."""
    from delta_jax.sampling import GenerationStopped
    try:
        metrics, _ = evaluate_policy(run, params, step, should_stop=should_stop)
    except GenerationStopped:
        log.warning("eval step %d: stopped by the signal before it finished (not recorded)", step)
        return None
    if metrics:
        run.writer.write(step, metrics)
        log.info("eval step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return metrics


def eval_due(cfg, step: int) -> bool:
    """Whether the training loop evaluates at `step`: train.eval_before at 0, every
    train.eval_every steps between, train.eval_after at train.steps."""
    if step == 0:
        return bool(cfg.train.eval_before)
    if step >= cfg.train.steps:
        return bool(cfg.train.eval_after)
    return bool(cfg.train.eval_every) and step % cfg.train.eval_every == 0


def eval_recorded(run: Run, step: int) -> bool:
    """Whether metrics.jsonl holds eval rows of `step` (process 0 reads it; every process of a
    multi-host run gets its answer: a collective)."""
    recorded = False
    path = os.path.join(run.workdir, "metrics.jsonl")
    if jax.process_index() == 0 and os.path.isfile(path):
        recorded = any(row.get("step") == step and any(k.startswith("eval/") for k in row)
                       for row in read_jsonl(path))
    return bool(sharding_lib.from_process_0(np.int32(recorded)))
