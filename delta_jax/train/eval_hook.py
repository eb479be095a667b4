"""Evaluation hook of the RL loop: avg@k / pass@k / maj@k of the current policy on the eval benchmarks
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
from delta_jax.train.config import EVAL, VAL, eval_settings, validation_on
from delta_jax.train.metrics import read_jsonl, sampler_metrics
from delta_jax.train.run import Run

log = logging.getLogger("delta_jax.train")

_EVAL_SALT, _VAL_SALT = 11, 29  # each benchmark i draws with salt + 1 + i


def benchmarks_of(run: Run, kind: str) -> dict:
    """The benchmarks {name: rows} an evaluation of `kind` evaluates: data.eval's (EVAL), or the
    validations' (VAL: data.val's, else data.eval's)."""
    return run.benchmarks if kind == EVAL else run.val_benchmarks


def evaluate_policy(run: Run, params, step: int, *, kind: str = EVAL,
                    file_stem: str | None = None, should_stop=None):
    """avg@k / pass@k (/ maj@k) of `kind`'s benchmarks (EVAL: data.eval at eval.k; VAL: the validation,
    data.val at eval.val_k: config.eval_settings) with the eval sampling settings; writes
    eval/<file_stem>.json (default step_<step>, val_step_<step>) and returns (flat metrics
    "<kind>/...", the evaluation result), ({}, None) without benchmarks. should_stop: asked
    after every decode call (sampling.GenerationStopped when it turns true; nothing is written
    then)."""
    cfg = run.cfg
    settings = eval_settings(cfg, kind)
    benchmarks = benchmarks_of(run, kind)
    if not benchmarks:
        return {}, None
    from delta_jax import evaluation
    from delta_jax.rl.rewards import TrainerState
    from delta_jax.train.run import add_eval_scorers

    # Each benchmark is graded by its own kind's reward (accuracy only) and asked for that kind's
    # answer form (run.eval_prompts): a math run's HumanEval runs unit tests on a ```python block.
    add_eval_scorers(cfg, run.eval_prompts, run.eval_scorers, run.scorer)
    run.sampler.update_params(run.model(params))
    salt = _EVAL_SALT if kind == EVAL else _VAL_SALT
    generate_fn = evaluation.sampler_generate_fn(
        run.sampler, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
        max_new_tokens=cfg.eval.max_new_tokens, stop_token_ids=(run.tokenizer.eos_token_id,),
        seeds=lambda i: rollout_lib.step_seed(cfg.seed, step, salt + 1 + i),
        progress=ProgressLog(f"{kind} step {step}", cfg.train.progress_every_s),
        should_stop=should_stop)

    t0 = time.perf_counter()
    result = evaluation.evaluate(
        generate_fn, benchmarks, k=settings.k, pass_ks=settings.pass_ks, maj_ks=settings.maj_ks,
        format_prompt=run.eval_prompts, limit=cfg.eval.limit or None, scorer=run.eval_scorers,
        settings={"step": step, "kind": kind, "temperature": cfg.eval.temperature,
                  "top_p": cfg.eval.top_p, "max_new_tokens": cfg.eval.max_new_tokens},
        trainer_state=TrainerState(step, cfg.train.steps))
    metrics = result.flat_metrics(prefix=kind)
    metrics[f"time/{kind}_s"] = time.perf_counter() - t0
    if generate_fn.sampler_counters:  # the sampler's side: tokens/s, preemptions, ...
        metrics.update(sampler_metrics(generate_fn.sampler_counters, kind))
    stem = file_stem or (f"step_{step}" if kind == EVAL else f"{kind}_step_{step}")
    if jax.process_index() == 0:
        files.write_text(os.path.join(run.workdir, "eval", f"{stem}.json"), result.to_json())
        if cfg.eval.save_responses:
            generations.write_eval_responses(run.workdir, stem, result)
    if file_stem is None:
        run.writer.write_text(step, kind, result.to_markdown())
    return metrics, result


def write_eval(run: Run, params, step: int, kind: str = EVAL, should_stop=None) -> dict | None:
    """evaluate_policy of `kind` at `step`, its metrics written and logged and returned ({}
    without benchmarks); None when should_stop ended it (nothing written: the loop stops)."""
    from delta_jax.sampling import GenerationStopped
    try:
        metrics, _ = evaluate_policy(run, params, step, kind=kind, should_stop=should_stop)
    except GenerationStopped:
        log.warning("%s step %d: stopped by the signal before it finished (not recorded)",
                    kind, step)
        return None
    if metrics:
        run.writer.write(step, metrics)
        log.info("%s step %d: %s", kind, step,
                 ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return metrics


def evals_due(cfg, step: int) -> tuple[str, ...]:
    """The evaluations the training loop runs at `step`, in order: data.eval's (EVAL) with
    train.eval_before at 0, train.eval_after at train.steps and, without validations, every
    train.eval_every steps between; with validations (config.validation_on) VAL at every
    multiple of train.eval_every up to train.steps (the last step's before its EVAL)."""
    steps, every = cfg.train.steps, cfg.train.eval_every
    periodic = bool(every) and 0 < step <= steps and step % every == 0
    ends = (step == 0 and cfg.train.eval_before) or (step >= steps and cfg.train.eval_after)
    if not validation_on(cfg):
        return (EVAL,) if ends or (periodic and step < steps) else ()
    return ((VAL,) if periodic else ()) + ((EVAL,) if ends and cfg.data.eval else ())


def eval_recorded(run: Run, step: int, kind: str = EVAL) -> bool:
    """Whether metrics.jsonl holds `kind`'s evaluation rows of `step` (process 0 reads it; every
    process of a multi-host run gets its answer: a collective)."""
    recorded = False
    path = os.path.join(run.workdir, "metrics.jsonl")
    if jax.process_index() == 0 and os.path.isfile(path):
        recorded = any(row.get("step") == step and any(k.startswith(f"{kind}/") for k in row)
                       for row in read_jsonl(path))
    return bool(sharding_lib.from_process_0(np.int32(recorded)))
