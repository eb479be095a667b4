"""The RL loop's drivers: `train(cfg, workdir)` runs: resume from the latest checkpoint in
workdir, or SFT warm start (sft.steps > 0) + checkpoint 0; eval before; the RL steps
(rl_step.rl_step) with checkpoints every train.save_every and eval every train.eval_every
(eval_hook); a final checkpoint, eval after, and the final policy exported as a Hugging Face
directory (workdir/final). Also the sft and eval modes (`sft_only`, `eval_only`).

The run itself is built by run.build_run; one step is rl_step.rl_step.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from delta_jax import models
from delta_jax.train import sft as sft_lib
from delta_jax.train.eval_hook import evaluate_policy, write_eval
from delta_jax.train.metrics import summary_line
from delta_jax.train.rl_step import StepOutput, rl_step
from delta_jax.train.run import (Run, build_run, copy_tree, place_state, restore_reference,
                                 save_reference)
from delta_jax.train.state import TrainState, init_train_state

log = logging.getLogger("delta_jax.train")


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite updates; the last checkpoint is usable."""


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
                                    chunk_size=cfg.model.logprob_chunk,
                                    logprob_impl=cfg.model.logprob_impl)
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


StepHook = Callable[[Run, int, StepOutput], None]


def write_weight_histogram(run: Run, step: int, out: StepOutput):
    """Per-side histograms of the step's DelTA weights (workdir/delta_weights.jsonl, plots.py)."""
    if run.cfg.method == "delta" and jax.process_index() == 0:
        from delta_jax.train import plots
        b = out.batch
        plots.append_weight_histogram(run.workdir, step, b["token_weights"], b["advantages"],
                                      b["response_mask"], run.cfg.delta.lam_min,
                                      run.cfg.delta.lam_max)


def train(cfg, workdir: str, *, run: Run | None = None,
          step_hooks: Sequence[StepHook] = (write_weight_histogram,)
          ) -> tuple[TrainState, Run]:
    """RL training (mode train); returns the final state and the run (caller closes it).

    step_hooks: called as hook(run, step, StepOutput) after each RL step's metrics are written and
    before its checkpoint (default: the DelTA weight histograms)."""
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
            run.ref_params = restore_reference(run, state.params)
        log.info("resumed from %s at step %d", run.ckpt.directory, latest)
    else:
        state = init_state
        if cfg.sft.steps > 0:
            state = place_state(run, init_train_state(run_sft(run, state.params),
                                                      run.optimizer))
            if run.ref_pass is not None:  # the KL reference is the policy after the warm start
                run.ref_params = copy_tree(state.params)
                save_reference(run, run.ref_params)
        run.ckpt.save(0, state, run.data_iter.get_state(), _meta(cfg, 0), force=True)
        if cfg.train.eval_before:
            write_eval(run, state.params, 0)
        start = 0

    bar = _progress(cfg, cfg.train.steps, f"rl ({cfg.method})")
    for step in range(start + 1, cfg.train.steps + 1):
        out = rl_step(run, state, step)
        state, metrics = out.state, out.metrics
        skipped = metrics.get("policy/skipped_updates", 0.0)
        nonfinite_streak = nonfinite_streak + 1 if skipped > 0 else 0
        metrics["policy/nonfinite_streak"] = float(nonfinite_streak)
        scalars = run.writer.write(step, metrics)
        for hook in step_hooks:
            hook(run, step, out)
        del out  # the batch is not kept past the hooks
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
        run.ckpt.save(step, state, run.data_iter.get_state(), _meta(cfg, step, nonfinite_streak),
                      force=step == cfg.train.steps)
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
            write_eval(run, state.params, step)
    if bar is not None:
        bar.close()
    if cfg.train.eval_after and start < cfg.train.steps:
        write_eval(run, state.params, cfg.train.steps)
    if cfg.train.export_final:
        export_policy(run, state.params, os.path.join(workdir, "final"))
    return state, run

def export_policy(run: Run, params, path: str):
    """The policy as a Hugging Face directory (weights + tokenizer). Collective: every process
    calls it (models.save_pretrained gathers parameters that span processes); process 0 writes."""
    models.save_pretrained(run.model(params), path)
    if jax.process_index() == 0:
        run.tokenizer.hf.save_pretrained(path)


def _meta(cfg, step, nonfinite_streak=0) -> dict:
    return {"seed": int(cfg.seed), "step": int(step), "method": cfg.method,
            "nonfinite_streak": int(nonfinite_streak)}


def sft_only(cfg, workdir: str):
    """Mode sft: the warm start alone, exported as a HF directory (workdir/sft)."""
    run = build_run(cfg, workdir, need_scorer=False)
    try:
        params = run_sft(run, run.initial_params)
        export_policy(run, params, os.path.join(workdir, "sft"))
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
