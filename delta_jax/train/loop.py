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
import numpy as np

from delta_jax import models
from delta_jax import sharding as sharding_lib
from delta_jax.errors import InputError, RunHalted, naming
from delta_jax.rl.dynamic_sampling import BatchNotFilled
from delta_jax.train import SFT_CHECKPOINTS
from delta_jax.train import generations
from delta_jax.train import sft as sft_lib
from delta_jax.train.best import BEST, BestPolicy, read_best
from delta_jax.train.checkpoint import Checkpointer
from delta_jax.train.eval_hook import (benchmarks_of, eval_recorded, evals_due, evaluate_policy,
                                      write_eval)
from delta_jax.train.metrics import summary_line
from delta_jax.train.preemption import StopOnSignal, TrainingInterrupted
from delta_jax.train.rl_step import StepAbandoned, StepOutput, rl_step
from delta_jax.train.run import (Run, abstract_state, build_model, build_run, place_state,
                                 reference_part, resumed_reference, save_reference)
from delta_jax.train.state import (TrainState, abstract_train_state, init_train_state,
                                   split_model)

log = logging.getLogger("delta_jax.train")


class NonFiniteError(RunHalted):
    """Too many consecutive non-finite updates; the last checkpoint is usable."""


# ----------------------------------------------------------------------------- drivers


def sft_checkpointer(run: Run) -> Checkpointer:
    """The SFT warm start's checkpoints (workdir/sft_checkpoints): every sft.save_every steps,
    train.keep of them kept."""
    return Checkpointer(os.path.join(run.workdir, SFT_CHECKPOINTS),
                        save_every=run.cfg.sft.save_every, keep=run.cfg.train.keep)


def sft_interrupted(stop: StopOnSignal, ckpt: Checkpointer) -> TrainingInterrupted:
    """The TrainingInterrupted of a warm start that `stop` ended (its checkpoint saved in
    `ckpt`, which is closed here)."""
    saved = ckpt.latest_step()
    ckpt.close()
    return TrainingInterrupted(stop.signum, saved, ckpt.directory)


def run_sft(run: Run, params, log_every: int = 10,
            should_stop: Callable[[], bool] = lambda: False, ckpt: Checkpointer | None = None,
            on_resumed: Callable[[str], None] | None = None):
    """Supervised warm start; returns the new params (the RL optimizer starts fresh after), or
    None when should_stop() turned true (checked after every step).

    ckpt: where the warm start saves its state every sft.save_every steps and when stopped,
    and resumes from (the newest that reads back; metrics.jsonl cut back to what that checkpoint
    had written). Its batches follow (seed, step) alone, so a resumed warm start trains what an
    uninterrupted one does. None: nothing is saved.

    on_resumed: called once with "sft_step_<N>" after that restore (N = 0: none to restore)."""
    from delta_jax.data import records as records_lib
    from delta_jax.train.state import learning_rate_schedule, make_optimizer

    cfg = run.cfg
    with naming("data.train"):
        recs, _ = records_lib.load_records(run.assets["train"], fields=cfg.data.fields,
                                           on_error=cfg.data.on_error)
    examples = sft_lib.tokenize_examples(recs, run.tokenizer, run.template, cfg.sft.max_len)
    if examples.num_truncated or examples.num_dropped:
        total = examples.input_ids.shape[0] + examples.num_dropped
        log.warning("sft: %d of %d examples cut at sft.max_len=%d tokens, %d more left out (their "
                    "prompt leaves no solution token)", examples.num_truncated, total,
                    cfg.sft.max_len, examples.num_dropped)
    schedule = learning_rate_schedule(cfg.sft.lr, "cosine", cfg.sft.warmup_steps, cfg.sft.steps,
                                      0.1)
    optimizer = make_optimizer(schedule, weight_decay=cfg.sft.weight_decay,
                               max_grad_norm=cfg.optim.max_grad_norm,
                               master_weights=cfg.optim.master_weights)
    shardings = (None if run.mesh is None
                 else abstract_train_state(params, optimizer, run.mesh)[1])
    step_fn = sft_lib.make_sft_step(run.graphdef, run.rest, optimizer, schedule,
                                    chunk_size=cfg.model.logprob_chunk_tokens,
                                    logprob_impl=cfg.model.logprob_impl, mesh=run.mesh,
                                    state_shardings=shardings,
                                    micro_batch_size=cfg.sft.micro_batch_size)
    state = init_train_state(params, optimizer)
    if shardings is not None:
        state = sharding_lib.shard_tree(state, shardings)
    start = 0
    found = ckpt.restore_latest(state) if ckpt is not None else None
    if found is not None:
        start, state, _, meta = found
        run.writer.truncate(int(meta.get("metrics_offset", -1)))
        log.info("sft: resumed from %s at step %d", ckpt.directory, start)
    if on_resumed is not None:
        on_resumed(f"sft_step_{start}")
    bar = _progress(cfg, cfg.sft.steps, "sft")
    stopped = False
    for step in range(start + 1, cfg.sft.steps + 1):
        batch = sft_lib.sft_batch(examples, cfg.sft.batch_size, cfg.seed, step)
        state, m = step_fn(state, sharding_lib.put_batch(batch, run.mesh))
        if step % log_every == 0 or step == cfg.sft.steps:
            scalars = run.writer.write(step, jax.device_get(m))
            _bar_update(bar, step, f"sft loss {scalars['sft/loss']:.3f}")
        stopped = should_stop()  # asked once: the save and the stop agree
        if ckpt is not None and (step < cfg.sft.steps or stopped):
            ckpt.save(step, state, None, _meta(cfg, step, metrics_offset=run.writer.position()),
                      force=stopped)
        if stopped:
            break
    if bar is not None:
        bar.close()
    return None if stopped else state.params


def _progress(cfg, total, desc):
    if not cfg.train.progress_bar or jax.process_index() != 0:  # one bar in a multi-host run
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
    """Per-side histograms of the step's DelTA weights (workdir/delta_weights.jsonl, plots.py).
    Collective: every process computes the histograms of the global arrays; process 0 writes."""
    if run.cfg.method == "delta":
        from delta_jax.train import plots
        b = out.batch
        plots.append_weight_histogram(run.workdir, step, b["token_weights"], b["advantages"],
                                      b["response_mask"], run.cfg.delta.lam_min,
                                      run.cfg.delta.lam_max)


# What loop.train does after each step by default: the DelTA weight histograms and, every
# train.rollouts_every steps, the step's responses (train/generations.py).
DEFAULT_STEP_HOOKS: tuple[StepHook, ...] = (write_weight_histogram, generations.write_rollouts)


def train(cfg, workdir: str, *, run: Run | None = None,
          step_hooks: Sequence[StepHook] = DEFAULT_STEP_HOOKS,
          on_resumed: Callable[[str], None] | None = None) -> tuple[TrainState, Run]:
    """RL training (mode train); returns the final state and the run (caller closes it).

    Resumes from the newest checkpoint that reads back (metrics.jsonl cut back to what that
    checkpoint had written, so every step appears once). SIGINT / SIGTERM stop it cleanly: the
    step in hand is abandoned if its updates have not begun, else finished; a checkpoint is saved,
    the run closed and TrainingInterrupted raised (delta_jax.main exits 130 / 143).

    step_hooks: called as hook(run, step, StepOutput) after each RL step's metrics are written and
    before its checkpoint (default: DEFAULT_STEP_HOOKS).

    on_resumed: called once with what the run resumed from, "step_<N>" (an RL checkpoint;
    "step_0" when there is none and no warm start) or "sft_step_<N>" (run_sft's), once it has
    read back (delta_jax.main replaces config.json then, after a resume with changed fields)."""
    run = run or build_run(cfg, workdir)
    with StopOnSignal() as stop:
        try:
            return _train(cfg, workdir, run, step_hooks, stop, on_resumed), run
        except TrainingInterrupted:
            run.close()  # the reward workers go with the run
            raise


def _train(cfg, workdir: str, run: Run, step_hooks, stop: StopOnSignal,
           on_resumed: Callable[[str], None] | None) -> TrainState:
    found = run.ckpt.restore_latest(abstract_state(run))
    nonfinite_streak = 0

    def save(step, state, data_state, force=False):
        meta = _meta(cfg, step, nonfinite_streak, run.writer.position())
        run.ckpt.save(step, state, data_state, meta, force=force)

    def interrupted(step):
        return TrainingInterrupted(stop.signum, step, run.ckpt.directory)

    best = (BestPolicy(workdir, cfg.train.best_metric, cfg.train.best_mode)
            if cfg.train.best_metric else None)

    def evaluate(step, params, only_missing=False) -> bool:
        """The evaluations due at `step` (evals_due; only_missing: those whose rows
        metrics.jsonl lacks), each written, then offered to the best policy; False when a stop
        cut one short."""
        for kind in evals_due(cfg, step):
            if only_missing:
                if not benchmarks_of(run, kind) or eval_recorded(run, step, kind):
                    continue
                log.info("%s step %d: not recorded before the stop; evaluating it now", kind, step)
            metrics = write_eval(run, params, step, kind, should_stop=stop.requested)
            if metrics is None:
                return False
            if best is not None:
                best.offer(step, metrics, lambda path: export_policy(run, params, path))
        return True

    if found is not None:
        start, state, data_state, meta = found
        # The checkpoint's parameters stand in for the initial ones, which are never read.
        run.take_initial_params(read=False)
        run.sampler.update_params(run.model(state.params))
        run.data_iter.set_state(data_state)
        run.writer.truncate(int(meta.get("metrics_offset", -1)))
        nonfinite_streak = int(meta.get("nonfinite_streak", 0))
        if run.ref_pass is not None:
            run.ref_params = resumed_reference(run, state.params)
        log.info("resumed from %s at step %d", run.ckpt.directory, start)
        if on_resumed is not None:
            on_resumed(f"step_{start}")
        # The evals due at the checkpoint's step (before it was saved) that a stop cut short:
        # their rows are not in metrics.jsonl. (Those after the last step follow the loop.)
        if start < cfg.train.steps and not evaluate(start, state.params, only_missing=True):
            raise interrupted(start)
    else:
        # The RL state is built once its parameters are known: a warm start does not hold the
        # RL optimizer's fresh state beside its own.
        params = run.take_initial_params()
        if params is None:
            raise RuntimeError(f"{run.ckpt.directory} holds no checkpoint and this Run's initial "
                               "parameters were handed over to an earlier train(): build a new "
                               "Run to train from them")
        if cfg.sft.steps > 0:
            sft_ckpt = sft_checkpointer(run)
            params = run_sft(run, params, should_stop=stop.requested, ckpt=sft_ckpt,
                             on_resumed=on_resumed)
            if params is None:
                raise sft_interrupted(stop, sft_ckpt)
        elif on_resumed is not None:
            on_resumed("step_0")
        state = place_state(run, init_train_state(params, run.optimizer))
        del params  # the train step donates them with the state
        if run.ref_pass is not None:  # the KL reference is the policy at the start of RL
            run.ref_params = reference_part(state.params)
            if cfg.sft.steps > 0:  # after the warm start: kept for resumes
                save_reference(run, run.ref_params)
        evaluate(0, state.params)  # before checkpoint 0, whose metrics offset includes it
        # (train.eval_before; cut short by a stop: raised below)
        save(0, state, run.data_iter.get_state(), force=True)
        if cfg.sft.steps > 0:  # checkpoint 0 holds the warm start's result
            sft_ckpt.remove()  # each holds a whole optimizer state
        start = 0
    if stop.requested():
        raise interrupted(start)

    bar = _progress(cfg, cfg.train.steps, f"rl ({cfg.method})")
    for step in range(start + 1, cfg.train.steps + 1):
        data_before = run.data_iter.get_state()
        try:
            out = rl_step(run, state, step, should_stop=stop.requested)
        except StepAbandoned:  # the state is still that of step - 1
            save(step - 1, state, data_before, force=True)
            raise interrupted(step - 1) from None
        except BatchNotFilled as e:  # so is it here; the step's prompts are drawn again on resume
            save(step - 1, state, data_before, force=True)
            raise RunHalted(
                f"step {step}: {e} The run stopped with checkpoint {step - 1} saved in "
                f"{run.ckpt.directory}: the same command with a changed field and "
                "--config.train.allow_config_change=True resumes from it") from e
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
            save(step, state, run.data_iter.get_state(), force=True)
            raise NonFiniteError(
                f"step {step}: {nonfinite_streak} consecutive steps with non-finite loss or "
                f"gradients (rl.max_nonfinite={cfg.rl.max_nonfinite}); parameters were left "
                f"unchanged by those updates; the last checkpoint in {run.ckpt.directory} "
                "is usable")
        if step < cfg.train.steps and not stop.requested():  # the evals due (evals_due),
            evaluate(step, state.params)  # before the checkpoint, whose offset includes them
        stopping = stop.requested()  # asked once: the save and the stop agree
        save(step, state, run.data_iter.get_state(), force=step == cfg.train.steps or stopping)
        if stopping:
            raise interrupted(step)
    if bar is not None:
        bar.close()
    # After the last checkpoint, so not in its metrics offset: a rerun of a finished run (its
    # rows cut back to that checkpoint) or one stopped during them evaluates again.
    if not evaluate(cfg.train.steps, state.params, only_missing=start >= cfg.train.steps):
        raise interrupted(cfg.train.steps)
    if cfg.train.export_final:
        export_policy(run, state.params, os.path.join(workdir, "final"))
    if cfg.train.eval_best and not evaluate_best(run, workdir, should_stop=stop.requested):
        raise interrupted(cfg.train.steps)
    return state


def evaluate_best(run: Run, workdir: str, should_stop=None) -> bool:
    """train.eval_best: the best policy (workdir/best, as train.best_metric chose it) evaluated on
    data.eval as `--config.mode=eval --config.eval.checkpoint=none --config.model.path=<workdir>/
    best` would, in this run's sampler: printed and written to eval/best_step_<N>.json (N the step
    it was exported at). Read back from its export (LoRA runs: the merged weights, with adapters
    at B = 0), so it is the policy best/ holds. False when a stop cut it short; True otherwise,
    also when there is no best policy (logged)."""
    cfg = run.cfg
    record = read_best(workdir) if jax.process_index() == 0 else None
    step = int(sharding_lib.from_process_0(np.int64(-1 if record is None else record["step"])))
    path = os.path.join(workdir, BEST)
    if step < 0:
        log.warning("train.eval_best: %s holds no best policy (no evaluation scored a finite %s)",
                    path, cfg.train.best_metric)
        return True
    from_export = cfg.copy_and_resolve_references()
    from_export.model.random_init, from_export.model.path = False, path
    # straight to their shards, as model.path's tensors are
    _, params, _ = split_model(build_model(from_export, run.tokenizer.vocab_size, mesh=run.mesh))
    params = sharding_lib.shard_tree(params, run.state_shardings.params)
    from delta_jax.sampling import GenerationStopped
    try:
        _, result = evaluate_policy(run, params, step, file_stem=f"best_step_{step}",
                                    should_stop=should_stop)
    except GenerationStopped:
        log.warning("train.eval_best: stopped by the signal before it finished (not written)")
        return False
    if jax.process_index() == 0 and result is not None:
        print(f"eval of the best policy ({cfg.train.best_metric} at step {step}, {path}):\n"
              f"{result.to_markdown()}", flush=True)
    return True


def _file_safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "model"


def export_policy(run: Run, params, path: str):
    """The policy as a Hugging Face directory (weights + tokenizer; LoRA adapters merged into
    the weights), and with LoRA the adapters alone in PEFT's format in path/lora_adapter (for
    the base at model.path). Collective: every process calls it (models.save_pretrained gathers
    parameters that span processes); process 0 writes."""
    model = run.model(params)
    models.save_pretrained(model, path)
    if model.layers.lora_names():
        models.save_peft_adapter(model, os.path.join(path, "lora_adapter"),
                                 base_model_name_or_path=run.cfg.model.path)
    if jax.process_index() == 0:
        run.tokenizer.hf.save_pretrained(path)


def _meta(cfg, step, nonfinite_streak=0, metrics_offset=0) -> dict:
    return {"seed": int(cfg.seed), "step": int(step), "method": cfg.method,
            "nonfinite_streak": int(nonfinite_streak), "metrics_offset": int(metrics_offset)}


def sft_only(cfg, workdir: str, on_resumed: Callable[[str], None] | None = None):
    """Mode sft: the warm start alone, exported as a HF directory (workdir/sft); on_resumed as
    run_sft's."""
    run = build_run(cfg, workdir, need_scorer=False)
    try:
        sft_ckpt = sft_checkpointer(run)
        with StopOnSignal() as stop:
            params = run_sft(run, run.take_initial_params(), should_stop=stop.requested,
                             ckpt=sft_ckpt, on_resumed=on_resumed)
            if params is None:
                raise sft_interrupted(stop, sft_ckpt)
        export_policy(run, params, os.path.join(workdir, "sft"))
        sft_ckpt.remove()
        return params
    finally:
        run.close()


def eval_only(cfg, workdir: str) -> dict:
    """Mode eval: evaluate what eval.checkpoint names: the newest readable checkpoint in
    workdir, else model.path ("latest"); model.path itself ("none"); checkpoint N ("N"). Prints
    the results and writes eval/standalone_step_<n>.json (a checkpoint) or
    eval/standalone_<model.path's directory name>.json (training's own eval/step_<n>.json files
    and metrics.jsonl are left as they are)."""
    run = build_run(cfg, workdir, need_data=False)
    try:
        step = 0
        # The parameters alone, placed as the run places them: no optimizer state is built or
        # read (for a bfloat16 8B model it is 6x the parameters' bytes).
        target = {"params": abstract_state(run).params}
        which = str(cfg.eval.checkpoint)
        found = None
        if which == "latest":
            found = run.ckpt.restore_latest(target, partial=True)
        elif which != "none":
            if int(which) not in run.ckpt.all_steps():
                raise InputError(f"eval.checkpoint: {run.ckpt.directory} has no checkpoint "
                                 f"{which}; it has {run.ckpt.all_steps() or 'none'}")
            found = (int(which), *run.ckpt.restore(int(which), target, partial=True))
        # model.path's weights (or the random init) are read only when no checkpoint stands in
        params = run.take_initial_params(read=found is None)
        if found is not None:
            step, state = found[0], found[1]
            params = state["params"]
            stem = f"standalone_step_{step}"
        else:  # model.path's own weights: named after it, so two exports do not share a file
            if run.state_shardings is not None:
                params = sharding_lib.shard_tree(params, run.state_shardings.params)
            stem = "standalone_" + (_file_safe(os.path.basename(os.path.normpath(cfg.model.path)))
                                    if cfg.model.path else "random_init")
        metrics, result = evaluate_policy(run, params, step, file_stem=stem)
        if jax.process_index() == 0:
            source = (f"checkpoint {step} of {run.ckpt.directory}" if found is not None
                      else cfg.model.path or f"random init ({cfg.model.preset})")
            print(f"eval of {source}:\n{result.to_markdown() if result is not None else '-'}",
                  flush=True)
        return metrics
    finally:
        run.close()
