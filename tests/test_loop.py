"""delta_jax.train.loop on the tiny RL config in-process: a resumed run writes every step once,
resumes past an unreadable newest checkpoint, eval mode reports without touching training's
eval files, sft mode exports its warm start, and a code task runs with unit-test rewards."""
import json
import logging
import os
import shutil
import signal
import time

import jax
import numpy as np
import pytest

from delta_jax.rl import sandbox
from delta_jax.train import loop
from delta_jax.train import rl_step as rl_step_lib
from delta_jax.train import run as run_lib
from delta_jax.train.preemption import TrainingInterrupted
from delta_jax.train.config import validate_config
from tests.rl_fixtures import (LOOP_WITHOUT_EVAL, build_scored_run, live_device_bytes,
                               tiny_rl_config)


def _config(steps, **train):
    return tiny_rl_config("dapo", train=dict(LOOP_WITHOUT_EVAL, steps=steps, keep=10, **train))


def _train(cfg, workdir):
    run = build_scored_run(cfg, workdir)
    try:
        state, run = loop.train(cfg, str(workdir), run=run)
    finally:
        run.close()
    return state


def _rl_steps(workdir):
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    return [r["step"] for r in rows if "policy/loss" in r]


def test_resume_writes_each_step_once_after_a_crash_past_the_last_checkpoint(tmp_path):
    """A crash after steps 3 and 4 were logged but before checkpoint 4 (simulated by removing
    it): the resumed run redoes steps 3 and 4 and metrics.jsonl holds each step once."""
    _train(_config(4, save_every=2), tmp_path)
    assert _rl_steps(tmp_path) == [1, 2, 3, 4]
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    _train(_config(5, save_every=2), tmp_path)
    assert _rl_steps(tmp_path) == [1, 2, 3, 4, 5]


def test_a_stop_before_the_updates_abandons_the_step_and_the_resume_redoes_it(tmp_path,
                                                                             monkeypatch):
    """SIGTERM while step 2's batch is being prepared (before any of its updates): train() saves
    checkpoint 1 with the data position from before step 2 and raises TrainingInterrupted; the
    same run resumed redoes step 2 on the same prompts and ends with the parameters of an
    uninterrupted run (a wrong data position or a half-applied step 2 would not)."""
    import jax

    ref = jax.device_get(_train(_config(3, save_every=10), tmp_path / "ref").params)
    prepare = rl_step_lib.prepare_batch

    def prepare_then_signal(run, params, step, should_stop=None):
        out = prepare(run, params, step, should_stop)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs at the next bytecode boundary
        return out

    monkeypatch.setattr(rl_step_lib, "prepare_batch", prepare_then_signal)
    with pytest.raises(TrainingInterrupted) as stopped:
        _train(_config(3, save_every=10), tmp_path / "cut")
    assert stopped.value.step == 1 and stopped.value.signum == signal.SIGTERM
    assert _rl_steps(tmp_path / "cut") == [1]  # step 2 wrote nothing
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["0", "1"]
    monkeypatch.undo()
    resumed = jax.device_get(_train(_config(3, save_every=10), tmp_path / "cut").params)
    assert _rl_steps(tmp_path / "cut") == [1, 2, 3]
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), ref, resumed))
    assert max(moved) <= 1e-6, max(moved)


def _signal_in_generate(monkeypatch, when):
    """SIGTERM to this process at the first should_stop check (after the first decode call) of
    the sampler's generate() calls for which when(call number from 1) is true; returns the
    list of how each generate() call ended ("done" or "stopped")."""
    from delta_jax.sampling import GenerationStopped, Sampler
    real, ended = Sampler.generate, []

    def generate(self, *args, should_stop=None, **kwargs):
        number = len(ended) + 1

        def check():
            if when(number) and not getattr(check, "sent", False):
                check.sent = True
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)  # the handler runs at the next bytecode boundary
            return should_stop() if should_stop is not None else False

        try:
            out = real(self, *args, should_stop=check, **kwargs)
        except GenerationStopped:
            ended.append("stopped")
            raise
        ended.append("done")
        return out

    monkeypatch.setattr(Sampler, "generate", generate)
    return ended


def test_a_stop_during_a_rollout_ends_it_within_a_decode_call(tmp_path, monkeypatch):
    """SIGTERM during step 2's rollout (after its first decode call of 4 steps; the responses
    take up to 16): the rollout stops there (sampling.GenerationStopped) instead of running to
    its end, step 2 is abandoned with checkpoint 1 saved, and the resumed run trains step 2 from
    scratch to the parameters of an uninterrupted run."""
    import jax

    cfg = lambda: tiny_rl_config("dapo", train=dict(LOOP_WITHOUT_EVAL, steps=2, keep=10,
                                                    save_every=10),
                                 rollout=dict(decode_steps_per_call=4))
    ref = jax.device_get(_train(cfg(), tmp_path / "ref").params)
    ended = _signal_in_generate(monkeypatch, lambda number: number == 2)  # step 2's rollout
    with pytest.raises(TrainingInterrupted) as stopped:
        _train(cfg(), tmp_path / "cut")
    assert ended == ["done", "stopped"]
    assert stopped.value.step == 1 and _rl_steps(tmp_path / "cut") == [1]
    monkeypatch.undo()
    resumed = jax.device_get(_train(cfg(), tmp_path / "cut").params)
    assert _rl_steps(tmp_path / "cut") == [1, 2]
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), ref, resumed))
    assert max(moved) <= 1e-6, max(moved)


def test_a_stop_during_the_scoring_skips_the_old_policy_pass(tmp_path, monkeypatch):
    """SIGTERM while step 2's responses are scored (the rollout done): the step is abandoned
    before its old-policy pass starts (that pass, over every response token, takes minutes at
    the 8B recipe's lengths), checkpoint 1 saved."""
    from delta_jax.train import phases

    score, passes = rl_step_lib.rewards_lib.score_across_processes, []

    def score_then_signal(*args, **kwargs):
        out = score(*args, **kwargs)
        if len(passes) == 1:  # step 1 had its old-policy pass: this is step 2's scoring
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs at the next bytecode boundary
        return out

    old_pass = phases.old_policy_features

    def counted(*args, **kwargs):
        passes.append(1)
        return old_pass(*args, **kwargs)

    monkeypatch.setattr(rl_step_lib.rewards_lib, "score_across_processes", score_then_signal)
    monkeypatch.setattr(phases, "old_policy_features", counted)
    with pytest.raises(TrainingInterrupted) as stopped:
        _train(tiny_rl_config("dapo", train=dict(LOOP_WITHOUT_EVAL, steps=2, save_every=10)),
               tmp_path)
    assert stopped.value.step == 1 and _rl_steps(tmp_path) == [1]
    assert len(passes) == 1  # step 2's old-policy pass never started


def test_a_stop_during_the_old_policy_pass_ends_it_between_chunks(tmp_path, monkeypatch):
    """SIGTERM during the first of step 2's four old-policy chunks (rl.old_pass_rows=4 of 16
    rows): the pass stops after that chunk (phases.PassStopped), the step is abandoned with
    checkpoint 1 saved."""
    from delta_jax.train import phases

    real, chunks = phases.old_policy_features, []

    def signalling(old_pass, *args, **kwargs):
        def one_chunk(*a, **k):
            chunks.append(1)
            if len(chunks) == 5:  # step 1 ran 4 chunks: the first of step 2
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)  # the handler runs at the next bytecode boundary
            return old_pass(*a, **k)
        return real(one_chunk, *args, **kwargs)

    monkeypatch.setattr(phases, "old_policy_features", signalling)
    with pytest.raises(TrainingInterrupted) as stopped:
        _train(tiny_rl_config("dapo", train=dict(LOOP_WITHOUT_EVAL, steps=2, save_every=10),
                              rl=dict(old_pass_rows=4)), tmp_path)
    assert stopped.value.step == 1 and _rl_steps(tmp_path) == [1]
    assert len(chunks) == 5  # step 2's pass stopped after its first chunk


def _eval_steps(workdir):
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    return [r["step"] for r in rows if "eval/average/avg@2" in r]


def test_a_stopped_eval_is_evaluated_again_on_resume(tmp_path, monkeypatch):
    """An eval cut short by SIGTERM is done again by the resumed run: the periodic eval of step 1
    (stopped after its first decode call; checkpoint 1 saved, no eval rows) is evaluated when
    the run resumes from checkpoint 1, before step 2; and a finished run run again, whose
    after-training eval is not in its last checkpoint's metrics, evaluates step 2 again instead
    of losing it (it was left out of metrics.jsonl before)."""
    cfg = lambda: tiny_rl_config(
        "dapo", train=dict(steps=2, keep=10, save_every=10, eval_every=1, eval_before=True,
                           eval_after=True, export_final=False),
        data=dict(eval="synthetic"), eval=dict(k=2, pass_k="1,2", limit=2, max_new_tokens=8),
        rollout=dict(decode_steps_per_call=4), rewards=dict(num_workers=1))
    workdir = tmp_path / "w"
    # generate() calls: 1 eval step 0, 2 step 1's rollout, 3 the eval of step 1
    ended = _signal_in_generate(monkeypatch, lambda number: number == 3)
    with pytest.raises(TrainingInterrupted) as stopped:
        _train(cfg(), workdir)
    assert ended == ["done", "done", "stopped"]
    assert stopped.value.step == 1 and _rl_steps(workdir) == [1]
    assert _eval_steps(workdir) == [0] and not (workdir / "eval" / "step_1.json").exists()
    monkeypatch.undo()
    _train(cfg(), workdir)
    assert _rl_steps(workdir) == [1, 2] and _eval_steps(workdir) == [0, 1, 2]
    assert (workdir / "eval" / "step_1.json").is_file()
    _train(cfg(), workdir)  # finished: resumed at checkpoint 2, its after-training eval again
    assert _rl_steps(workdir) == [1, 2] and _eval_steps(workdir) == [0, 1, 2]


def test_validations_of_their_own_run_between_the_evals_and_pick_the_best(tmp_path):
    """data.val + eval.val_k (the paper: AIME25 avg@8 every 4 steps to pick the checkpoint,
    seven benchmarks at avg@16 to report): the periodic evaluations validate on data.val at
    val_k, logged as val/... in eval/val_step_N.json, and data.eval is evaluated before and
    after training at eval.k; the last step has both, the validation first; best_metric may name
    a validation metric; a finished run run again redoes the two after-training evaluations
    once each."""
    val = tmp_path / "v.jsonl"
    val.write_text("".join(json.dumps({"id": f"v{i}", "problem": f"What is {i} + 1?",
                                       "answer": str(i + 1)}) + "\n" for i in range(3)))
    cfg = tiny_rl_config(
        "dapo", train=dict(steps=2, keep=10, save_every=10, eval_every=1, eval_before=True,
                           eval_after=True, export_final=False,
                           best_metric="val/benchmarks/v/avg@2"),
        data=dict(eval="synthetic", val=str(val)),
        eval=dict(k=4, val_k=2, pass_k="1,4", limit=2, max_new_tokens=8),
        rewards=dict(num_workers=1))
    workdir = tmp_path / "w"

    def evals():
        rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
        return [(r["step"], kind) for r in rows for kind in ("eval", "val")
                if any(k.startswith(f"{kind}/average/") for k in r)]

    _train(cfg, workdir)
    assert evals() == [(0, "eval"), (1, "val"), (2, "val"), (2, "eval")]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    val_row = next(r for r in rows if "val/average/avg@2" in r)
    assert "val/benchmarks/v/pass@1" in val_row and "val/average/pass@4" not in val_row
    assert not any(k.startswith("val/benchmarks/synthetic") for k in val_row)
    assert sorted(p.name for p in (workdir / "eval").iterdir()) == [
        "step_0.json", "step_2.json", "val_step_1.json", "val_step_2.json"]
    validated = json.loads((workdir / "eval" / "val_step_1.json").read_text())
    assert list(validated["benchmarks"]) == ["v"] and validated["k"] == 2
    assert validated["benchmarks"]["v"]["num_questions"] == 2  # eval.limit
    final = json.loads((workdir / "eval" / "step_2.json").read_text())
    assert list(final["benchmarks"]) == ["synthetic_test"] and final["k"] == 4
    best = json.loads((workdir / "best" / "best.json").read_text())
    assert best["metric"] == "val/benchmarks/v/avg@2" and best["step"] in (1, 2)
    _train(cfg, workdir)  # finished: its after-training evaluations again, once each
    assert evals() == [(0, "eval"), (1, "val"), (2, "val"), (2, "eval")]


def test_a_stopped_validation_is_validated_again_on_resume(tmp_path, monkeypatch):
    """SIGTERM during step 1's validation (generate() calls: 1 the eval before, 2 step 1's
    rollout, 3 the validation): checkpoint 1 holds no val rows, and the resumed run validates
    step 1 before step 2, each evaluation once."""
    val = tmp_path / "v.jsonl"
    val.write_text("".join(json.dumps({"id": f"v{i}", "problem": f"What is {i} + 1?",
                                       "answer": str(i + 1)}) + "\n" for i in range(2)))
    cfg = lambda: tiny_rl_config(  # noqa: E731
        "dapo", train=dict(steps=2, keep=10, save_every=10, eval_every=1, eval_before=True,
                           eval_after=True, export_final=False),
        data=dict(eval="synthetic", val=str(val)), rollout=dict(decode_steps_per_call=4),
        eval=dict(k=2, val_k=2, pass_k="1,2", limit=2, max_new_tokens=8),
        rewards=dict(num_workers=1))
    workdir = tmp_path / "w"
    ended = _signal_in_generate(monkeypatch, lambda number: number == 3)
    with pytest.raises(TrainingInterrupted) as stopped:
        _train(cfg(), workdir)
    assert ended == ["done", "done", "stopped"] and stopped.value.step == 1
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert not any(k.startswith("val/") for r in rows for k in r)
    monkeypatch.undo()
    _train(cfg(), workdir)
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    order = [(r["step"], kind) for r in rows for kind in ("eval", "val", "policy")
             if any(k.startswith(f"{kind}/") for k in r)]
    assert order == [(0, "eval"), (1, "policy"), (1, "val"), (2, "policy"), (2, "val"),
                     (2, "eval")]


def test_the_best_eval_keeps_its_policy_in_best(tmp_path, monkeypatch, capsys):
    """train.best_metric: the loop offers every eval (before, periodic, after) to the best
    policy; with the metric's values made 0.1, 0.5, 0.3 at steps 0, 1, 2, workdir/best holds
    step 1's policy (its parameters as checkpoint 1 holds them) with best.json naming step 1,
    and the end-of-run report says so. The real evaluation logs the metric (the values are only
    replaced). train.eval_best evaluates that policy, read back from best/, after the last step:
    with step 1's eval seeds, so eval/best_step_1.json is step 1's own evaluation again, holding
    as much more device memory than the evaluations during training as plan mode says."""
    from flax import nnx

    from delta_jax import main as main_lib
    from delta_jax import models, plan
    from delta_jax.train.checkpoint import Checkpointer

    metric = "eval/average/avg@2"
    made = {0: 0.1, 1: 0.5, 2: 0.3}
    real, real_policy = loop.write_eval, loop.evaluate_policy
    held = []  # device 0's memory held as each evaluation starts: (step, best?, bytes)

    def write_eval(run, params, step, kind="eval", should_stop=None):
        held.append((step, False, live_device_bytes(jax.devices()[0])))
        metrics = real(run, params, step, kind, should_stop=should_stop)
        assert metric in metrics
        return {**metrics, metric: made[step]}

    def evaluate_policy(run, params, step, **kw):
        held.append((step, True, live_device_bytes(jax.devices()[0])))
        return real_policy(run, params, step, **kw)

    monkeypatch.setattr(loop, "write_eval", write_eval)
    monkeypatch.setattr(loop, "evaluate_policy", evaluate_policy)
    cfg = tiny_rl_config(
        "dapo", train=dict(steps=2, keep=10, save_every=1, eval_every=1, eval_before=True,
                           eval_after=True, export_final=False, best_metric=metric,
                           eval_best=True),
        data=dict(eval="synthetic"),
        eval=dict(k=2, pass_k="1,2", limit=2, max_new_tokens=8, save_responses=True),
        rewards=dict(num_workers=1))
    main_lib.run(cfg, str(tmp_path))
    record = json.loads((tmp_path / "best" / "best.json").read_text())
    assert record == {"metric": metric, "value": 0.5, "step": 1, "mode": "max"}
    out = capsys.readouterr().out
    assert "best eval/average/avg@2 (max): 50.0% at step 1; that policy: " in out
    assert f"eval of the best policy ({metric} at step 1, {tmp_path / 'best'}):" in out
    again = json.loads((tmp_path / "eval" / "best_step_1.json").read_text())
    step_1 = json.loads((tmp_path / "eval" / "step_1.json").read_text())
    assert again["benchmarks"] == step_1["benchmarks"] and again["k"] == 2
    responses = lambda stem: (tmp_path / "eval" / f"{stem}_responses.jsonl").read_text()  # noqa: E731
    assert responses("best_step_1") == responses("step_1")
    run = run_lib.build_run(cfg, str(tmp_path / "shapes"), need_scorer=False)
    try:
        ckpt = Checkpointer(str(tmp_path / "checkpoints"))
        want = ckpt.restore(1, run_lib.abstract_state(run))[0].params
        ckpt.close()
        model_cfg, mesh_shape = run.model(run.initial_params).cfg, run_lib._mesh_shape(run.mesh)
    finally:
        run.close()
    got = nnx.state(models.from_pretrained(str(tmp_path / "best")), nnx.Param)
    got, want = jax.tree.leaves(got), jax.tree.leaves(jax.device_get(want))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # What the best policy's evaluation holds on a device beyond the evaluations during
    # training (the same state, sampler and data) is what plan mode's "eval of the best policy"
    # phase adds to the eval phase on the run's mesh: one copy of the parameters.
    assert [(s, b) for s, b, _ in held] == [(0, False), (1, False), (2, False), (1, True)]
    during = {n for _, b, n in held if not b}
    assert len(during) == 1, held
    memory_plan = plan.plan_from_config(cfg, mesh_shape=mesh_shape, model_cfg=model_cfg)
    assert held[-1][2] - during.pop() == (memory_plan.phases[plan.BEST_EVAL]
                                          - memory_plan.phases["eval"]) > 0


# What a state's scalars (the step counter, the optimizer's counts) and an SFT step's batch (4 x
# 32 tokens, 1.5 KB) add on a device: far below one copy of the tiny model's parameters (~190 KB).
_SMALL_SLACK = 4096


def test_a_run_holds_one_state_warm_started_resumed_or_evaluated(tmp_path, monkeypatch):
    """The device memory held as each SFT step, RL step and mode=eval generation starts is one
    state: the parameters and the optimizer state of plan mode's figures (the parameters alone
    in mode=eval), whether the run warm-starts, resumes from a checkpoint or evaluates one. No
    fresh RL state waits beside the warm start's, no initial parameters (or fresh state to
    restore into) beside a restored state, no model weights beside a checkpoint's."""
    from delta_jax import plan
    from delta_jax.sampling import Sampler

    device = jax.devices()[0]
    held = []  # (what, device 0's bytes)
    real_sft_step, real_rl_step, real_generate = (loop.sft_lib.make_sft_step, loop.rl_step,
                                                  Sampler.generate)

    def make_sft_step(*args, **kw):
        step = real_sft_step(*args, **kw)

        def probed(state, batch):
            held.append(("sft", live_device_bytes(device)))
            return step(state, batch)
        return probed

    def rl_step(run, state, step, **kw):
        held.append((f"rl {step}", live_device_bytes(device)))
        return real_rl_step(run, state, step, **kw)

    def generate(sampler, *args, **kw):
        held.append(("eval", live_device_bytes(device)))
        return real_generate(sampler, *args, **kw)

    monkeypatch.setattr(loop.sft_lib, "make_sft_step", make_sft_step)
    monkeypatch.setattr(loop, "rl_step", rl_step)

    def config(steps):
        return tiny_rl_config("dapo", sft=dict(steps=2, batch_size=4, max_len=32, warmup_steps=0),
                              train=dict(LOOP_WITHOUT_EVAL, steps=steps, save_every=1))

    _train(config(1), tmp_path)  # the warm start, then step 1
    run = build_scored_run(config(2), tmp_path)
    try:
        mesh_shape, model_cfg = run_lib._mesh_shape(run.mesh), run.model(run.initial_params).cfg
        loop.train(run.cfg, str(tmp_path), run=run)  # resumed from checkpoint 1: step 2
    finally:
        run.close()
    train_plan = plan.plan_from_config(config(2), mesh_shape=mesh_shape, model_cfg=model_cfg)
    state = train_plan.params + train_plan.optimizer
    assert [w for w, _ in held] == ["sft", "sft", "rl 1", "rl 2"]
    for what, n in held:
        assert 0 <= n - state <= _SMALL_SLACK, (what, n, state)
    # mode=eval on checkpoint 2, sampling on the eval run's own mesh
    held.clear()
    monkeypatch.setattr(Sampler, "generate", generate)
    eval_cfg = tiny_rl_config("dapo", data=dict(eval="synthetic"),
                              eval=dict(k=2, pass_k="1,2", limit=2, max_new_tokens=8),
                              rewards=dict(num_workers=1))
    with eval_cfg.unlocked():
        eval_cfg.mode = "eval"
    eval_cfg = validate_config(eval_cfg)
    meshes = []
    real_evaluate_policy = loop.evaluate_policy

    def evaluate_policy(run, params, step, **kw):
        meshes.append(run_lib._mesh_shape(run.mesh))
        return real_evaluate_policy(run, params, step, **kw)

    monkeypatch.setattr(loop, "evaluate_policy", evaluate_policy)
    loop.eval_only(eval_cfg, str(tmp_path))
    eval_plan = plan.plan_from_config(eval_cfg, mesh_shape=meshes[0], model_cfg=model_cfg)
    assert [w for w, _ in held] == ["eval"] and eval_plan.optimizer > 0
    assert 0 <= held[0][1] - eval_plan.params <= _SMALL_SLACK, (held, eval_plan.params)


def test_resume_from_the_older_checkpoint_when_the_newest_is_corrupt(tmp_path, caplog):
    _train(_config(2, save_every=1), tmp_path)
    state_dir = tmp_path / "checkpoints" / "2" / "state"
    biggest = max((p for p in state_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:biggest.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="delta_jax.train"):
        _train(_config(3, save_every=1), tmp_path)
    assert "skipping checkpoint 2" in caplog.text and "resuming from checkpoint 1" in caplog.text
    assert _rl_steps(tmp_path) == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "unreadable-2").is_dir()


def test_model_paths_weights_are_read_to_start_from_not_to_resume_or_evaluate(tmp_path,
                                                                              monkeypatch):
    """model.path's weights are read when a run starts from them, not when it resumes from a
    checkpoint or mode=eval evaluates one (for a bfloat16 8B model, 16 GB read again on every
    host and held on the devices while the checkpoint was read, then dropped): as the checkpoint
    is read the devices hold nothing, and the resumed run trains on from the checkpoint's
    parameters. With a KL term (no SFT) a resume reads them again for its reference, the
    initial policy as the fresh run had it; with LoRA that reference is the initial adapters,
    made again from the seed without reading the base weights."""
    from flax import nnx
    from safetensors import safe_open

    from delta_jax import models
    from delta_jax.models import hf_io
    from delta_jax.train.checkpoint import Checkpointer
    from delta_jax.train.state import split_trainable
    from tests.rl_fixtures import tree_max_abs_diff

    # model.path: the tiny run's own random init, saved
    run = build_scored_run(tiny_rl_config("dapo"), tmp_path / "init")
    models.save_pretrained(run.model(run.take_initial_params()), tmp_path / "hf")
    run.close()
    device = jax.devices()[0]
    reads, held = [], []  # tensors read from model.path; device 0's bytes as a restore starts
    real_read, real_restore = hf_io._TensorReader.read, Checkpointer.restore

    def read(self, name, *args):
        reads.append(name)
        return real_read(self, name, *args)

    def restore(self, *args, **kw):
        held.append(live_device_bytes(device))
        return real_restore(self, *args, **kw)

    monkeypatch.setattr(hf_io._TensorReader, "read", read)
    monkeypatch.setattr(Checkpointer, "restore", restore)

    def config(steps, kl=0.0, lora=0):
        return tiny_rl_config("dapo", model=dict(random_init=False, path=str(tmp_path / "hf"),
                                                 lora_rank=lora, lora_alpha=8.0),
                              rl=dict(kl_coef=kl, kl_type="k3"),
                              data=dict(eval="synthetic"),
                              eval=dict(k=2, pass_k="1,2", limit=2, max_new_tokens=8),
                              rewards=dict(num_workers=1),
                              train=dict(LOOP_WITHOUT_EVAL, steps=steps, save_every=1))

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="numpy") as f:
        n_tensors = len(list(f.keys()))  # every tensor of the file, read once to start from it
    for kl, lora, workdir in ((0.0, 0, tmp_path / "plain"), (0.1, 0, tmp_path / "kl"),
                              (0.1, 4, tmp_path / "kl_lora")):
        _train(config(1, kl, lora), workdir)
        assert len(reads) == n_tensors and held == [], (kl, reads, held)  # a fresh start
        reads.clear()
        run = build_scored_run(config(2, kl, lora), workdir)
        try:
            state, run = loop.train(run.cfg, str(workdir), run=run)
            resumed_ref = run.ref_params
            if kl:  # the reference the fresh run had: the initial policy's trainable part
                reads_before = len(reads)
                initial = jax.device_get(split_trainable(run.read_initial_params())[0])
                del reads[reads_before:]
        finally:
            run.close()
        assert _rl_steps(workdir) == [1, 2] and int(state.step) == 2
        assert held[0] <= _SMALL_SLACK, held  # no initial parameters beside the restore
        if kl and not lora:  # read again for the reference: the initial policy's, exactly
            assert len(reads) == n_tensors
        else:  # nothing read; a LoRA reference's adapters come from the seed alone
            assert reads == [], reads
        if kl:
            assert tree_max_abs_diff(jax.device_get(resumed_ref), initial) == 0.0
            names = {path[-1] for path, _ in nnx.to_flat_state(resumed_ref)}
            assert (all("_lora_" in n for n in names) and len(names) == 14 if lora
                    else "embed" in names), names  # the adapters alone, or the whole policy
            del initial
        else:
            assert resumed_ref is None
        del state, resumed_ref, run  # not beside the next restore (its sampler's weights)
        reads.clear(), held.clear()
    eval_cfg = config(2).copy_and_resolve_references()
    with eval_cfg.unlocked():
        eval_cfg.mode = "eval"
    metrics = loop.eval_only(validate_config(eval_cfg), str(tmp_path / "plain"))
    assert reads == [] and len(held) == 1 and held[0] <= _SMALL_SLACK, (reads, held)
    assert json.loads((tmp_path / "plain" / "eval" / "standalone_step_2.json").read_text())
    assert metrics
    # eval.checkpoint=none evaluates model.path itself: read
    with eval_cfg.unlocked():
        eval_cfg.eval.checkpoint = "none"
    loop.eval_only(validate_config(eval_cfg), str(tmp_path / "plain"))
    assert len(reads) == n_tensors


def test_eval_mode_prints_and_keeps_trainings_eval_files(tmp_path, capsys, monkeypatch, caplog):
    cfg = tiny_rl_config("dapo", train=dict(steps=1, eval_before=False, eval_after=True,
                                            export_final=False),
                         data=dict(eval="synthetic"), eval=dict(k=2, pass_k="1,2", limit=2,
                                                                max_new_tokens=8),
                         rewards=dict(num_workers=1))
    _train(cfg, tmp_path)
    trained = (tmp_path / "eval" / "step_1.json").read_bytes()
    rows_before = (tmp_path / "metrics.jsonl").read_bytes()
    eval_cfg = cfg.copy_and_resolve_references()
    with eval_cfg.unlocked():
        eval_cfg.mode = "eval"
        eval_cfg.train.progress_every_s = 1e-9  # a progress line after each decode call
    evaluated = []

    def evaluate_policy(run, params, step, **kw):
        evaluated.append((run, params))
        return real_evaluate_policy(run, params, step, **kw)

    def no_optimizer_state(*args):
        raise AssertionError("mode=eval built a train state")

    real_evaluate_policy = loop.evaluate_policy
    monkeypatch.setattr(loop, "evaluate_policy", evaluate_policy)
    monkeypatch.setattr(loop, "init_train_state", no_optimizer_state)
    with caplog.at_level(logging.INFO, logger="delta_jax.sampling"):
        metrics = loop.eval_only(validate_config(eval_cfg), str(tmp_path))
    progress = [r.getMessage() for r in caplog.records if r.name == "delta_jax.sampling"]
    assert progress and all(line.startswith("eval step 1: ") for line in progress), progress
    assert progress[-1].startswith("eval step 1: 4 / 4 samples done, ")  # 2 questions x k = 2
    out = capsys.readouterr().out
    assert "eval of checkpoint 1 of" in out and "synthetic_test" in out
    assert (tmp_path / "eval" / "step_1.json").read_bytes() == trained
    assert json.loads((tmp_path / "eval" / "standalone_step_1.json").read_text())
    # It evaluated the checkpoint's parameters, read alone (no optimizer state is built): those
    # of the whole train state read back as a resumed run reads it, bit for bit, and unlike the
    # model's initial ones.
    run, params = evaluated[0]
    from delta_jax.train.checkpoint import Checkpointer
    ckpt = Checkpointer(str(tmp_path / "checkpoints"))
    whole = ckpt.restore(1, run_lib.abstract_state(run))[0].params
    ckpt.close()
    # (the evaluation let go of the model's own parameters: those of a run built again, the
    # same random init)
    again = run_lib.build_run(validate_config(eval_cfg), str(tmp_path / "again"), need_data=False)
    initial = again.take_initial_params()
    again.close()
    assert jax.tree.structure(params) == jax.tree.structure(whole)
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole)))
    assert not all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(initial)))
    assert (tmp_path / "metrics.jsonl").read_bytes() == rows_before
    assert metrics and all(np.isfinite(v) for v in metrics.values())
    # The sampler's side of the evaluation: 2 questions x k = 2 samples of at most 8 tokens.
    assert 0 < metrics["eval/generated_tokens"] <= 2 * 2 * 8
    assert 0 < metrics["eval/slot_utilization"] <= 1 and metrics["eval/preemptions"] == 0
    # A workdir without a checkpoint: the configured model itself (here a random init).
    fresh = tmp_path / "fresh"
    loop.eval_only(validate_config(eval_cfg), str(fresh))
    assert "eval of random init (tiny)" in capsys.readouterr().out
    assert json.loads((fresh / "eval" / "standalone_random_init.json").read_text())
    # it wrote its eval file and the run's assets (the synthetic task, its tokenizer) only
    assert not {"checkpoints", "metrics.jsonl", "tensorboard"} & {p.name for p in fresh.iterdir()}

    def evaluated_params(checkpoint):
        with eval_cfg.unlocked():
            eval_cfg.eval.checkpoint = checkpoint
        evaluated.clear()
        loop.eval_only(validate_config(eval_cfg), str(tmp_path))
        return evaluated[0][1]

    def same(a, b):
        return all(np.array_equal(np.asarray(x), np.asarray(y))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    # eval.checkpoint: the model itself in a workdir with checkpoints, or checkpoint N
    assert same(evaluated_params("none"), initial)
    assert "eval of random init (tiny)" in capsys.readouterr().out
    assert (tmp_path / "eval" / "standalone_random_init.json").is_file()
    assert same(evaluated_params("0"), initial)  # checkpoint 0: the state before RL step 1
    assert "eval of checkpoint 0 of" in capsys.readouterr().out
    assert (tmp_path / "eval" / "standalone_step_0.json").is_file()
    assert same(evaluated_params("1"), whole)
    from delta_jax.errors import InputError
    with pytest.raises(InputError, match=r"^eval\.checkpoint: .* has no checkpoint 7; it has "
                                         r"\[0, 1\]"):
        evaluated_params("7")


def _sft_config(steps=12, save_every=5):
    cfg = tiny_rl_config("dapo", sft=dict(steps=steps, batch_size=4, max_len=32, warmup_steps=0,
                                          save_every=save_every), train=dict(keep=5))
    with cfg.unlocked():
        cfg.mode = "sft"
    return validate_config(cfg)


def _signal_at_sft_step(monkeypatch, stop_step):
    """SIGTERM to this process while SFT step `stop_step`'s batch is drawn."""
    from delta_jax.train import sft as sft_lib
    draw = sft_lib.sft_batch

    def draw_then_signal(examples, batch_size, seed, step):
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs at the next bytecode boundary
        return draw(examples, batch_size, seed, step)

    monkeypatch.setattr(sft_lib, "sft_batch", draw_then_signal)


def test_a_stopped_sft_saves_its_state_and_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Mode sft stopped by SIGTERM at step 11 of 12 (sft.save_every=3): checkpoints 3, 6, 9
    (the interval) and 11 (the stop) in workdir/sft_checkpoints, and TrainingInterrupted naming
    step 11 there (before, nothing was saved and every step was lost). With checkpoint 11 then
    removed (a crash after the metrics row of step 10 and before the next checkpoint), the same
    run resumes from 9, cuts metrics.jsonl back to it, ends with the parameters of an
    uninterrupted warm start bit for bit (its batches follow (seed, step)), writes each metrics
    row once, and removes its checkpoints after the export."""
    import jax

    resumed_from = []
    ref = jax.device_get(loop.sft_only(_sft_config(save_every=3), str(tmp_path / "ref"),
                                       on_resumed=resumed_from.append))
    assert not (tmp_path / "ref" / loop.SFT_CHECKPOINTS).exists()
    assert resumed_from == ["sft_step_0"]  # nothing to restore
    cut = tmp_path / "cut"
    _signal_at_sft_step(monkeypatch, 11)
    with pytest.raises(TrainingInterrupted) as stopped:
        loop.sft_only(_sft_config(save_every=3), str(cut))
    assert stopped.value.step == 11 and stopped.value.signum == signal.SIGTERM
    assert stopped.value.checkpoint_dir == str(cut / loop.SFT_CHECKPOINTS)
    assert sorted(int(p.name) for p in (cut / loop.SFT_CHECKPOINTS).iterdir()
                  if p.name.isdigit()) == [3, 6, 9, 11]
    assert not (cut / "sft").exists()  # no export of a half-done warm start
    monkeypatch.undo()
    shutil.rmtree(cut / loop.SFT_CHECKPOINTS / "11")
    rows = [json.loads(line) for line in open(cut / "metrics.jsonl")]
    assert [r["step"] for r in rows if "sft/loss" in r] == [10]
    resumed = jax.device_get(loop.sft_only(_sft_config(save_every=3), str(cut),
                                           on_resumed=resumed_from.append))
    assert resumed_from == ["sft_step_0", "sft_step_9"]
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = [json.loads(line) for line in open(cut / "metrics.jsonl")]
    assert [r["step"] for r in rows if "sft/loss" in r] == [10, 12]
    assert (cut / "sft" / "config.json").is_file()
    assert not (cut / loop.SFT_CHECKPOINTS).exists()


def test_a_warm_start_stopped_in_a_train_run_resumes_then_trains(tmp_path, monkeypatch):
    """The train mode's SFT warm start stopped at step 3 of 4: the rerun resumes the warm start
    from its checkpoint 3 (metrics.jsonl cut back to it) and goes on to RL step 1; the warm
    start's checkpoints are gone once RL checkpoint 0 holds its result."""
    sections = dict(sft=dict(steps=4, batch_size=4, max_len=32, warmup_steps=0),
                    train=dict(steps=1, save_every=10, **LOOP_WITHOUT_EVAL))
    workdir = tmp_path / "w"
    _signal_at_sft_step(monkeypatch, 3)
    with pytest.raises(TrainingInterrupted) as stopped:
        _train(tiny_rl_config("dapo", **sections), workdir)
    assert stopped.value.step == 3
    assert stopped.value.checkpoint_dir == str(workdir / loop.SFT_CHECKPOINTS)
    assert not (workdir / "checkpoints" / "0").exists()
    monkeypatch.undo()
    _train(tiny_rl_config("dapo", **sections), workdir)
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows if "sft/loss" in r] == [4]  # the last SFT step, once
    assert _rl_steps(workdir) == [1]
    assert not (workdir / loop.SFT_CHECKPOINTS).exists()


def test_sft_mode_trains_the_warm_start_and_exports_it(tmp_path):
    """Mode sft: sft.steps steps of the warm start alone (a metrics row every 10 steps and at
    the last; no RL), exported as a Hugging Face directory (workdir/sft) that loads back to the
    returned parameters."""
    import jax
    from flax import nnx

    from delta_jax import models

    cfg = tiny_rl_config("dapo", sft=dict(steps=12, batch_size=4, max_len=32, warmup_steps=0))
    with cfg.unlocked():
        cfg.mode = "sft"
    params = jax.device_get(loop.sft_only(validate_config(cfg), str(tmp_path)))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "sft/loss" in r] == [10, 12]
    assert not any("policy/loss" in r for r in rows)
    exported = tmp_path / "sft"
    assert (exported / "config.json").is_file() and (exported / "tokenizer.json").is_file()
    loaded = nnx.state(models.from_pretrained(str(exported)), nnx.Param)
    got, want = jax.tree.leaves(loaded), jax.tree.leaves(params)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_code_task_trains_and_evaluates_with_unit_test_rewards(tmp_path):
    """rewards.name=code end to end: MBPP-style training rows, a code and a math benchmark go
    through loop.train; the training scorer gets each response with its own record's unit tests
    as the gold (it gives a right program 1 and a wrong one 0 for them), and the evaluation
    grades each benchmark with its own kind's reward."""
    ops = {"plus": "+", "times": "*", "minus": "-"}
    rows = []
    for i, (word, op) in enumerate(ops.items()):
        for k in (2, 3):
            tests = [f"assert f({x}) == {eval(f'{x} {op} {k}')}" for x in (1, 5)]
            rows.append({"task_id": 10 * i + k, "text": f"Write f(x) that returns x {word} {k}.",
                         "test_list": tests, "code": f"def f(x):\n    return x {op} {k}"})
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    math_bench = tmp_path / "math_bench.jsonl"
    math_bench.write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    cfg = tiny_rl_config(
        "dapo", data=dict(train=str(train), eval=f"{bench},{math_bench}", template="code",
                          max_prompt_len=256),
        rewards=dict(name="code", num_workers=1),
        train=dict(steps=1, eval_before=False, eval_after=True, export_final=False),
        eval=dict(k=2, pass_k="1,2", max_new_tokens=8))
    run = run_lib.build_run(cfg, str(tmp_path / "w"))
    # One accuracy scorer per kind of benchmark, started with the run (a code sandbox that
    # cannot start stops the run then, not at the first evaluation).
    assert {kind: s.name for kind, s in run.eval_scorers.items()} == {"code": "code",
                                                                       "math": "math"}
    seen = []
    score = run.scorer.score

    def recording(responses, golds, *args, **kwargs):
        seen.append((list(responses), list(golds)))
        return score(responses, golds, *args, **kwargs)

    run.scorer.score = recording
    checked = []

    def check_golds(run_, step, out):
        responses, golds = seen[-1]
        # Response i is sample i % G of prompt i // G (the prompt it was generated from, decoded:
        # its task text names its record); its gold must be that record's tests.
        samples, G = out.prepared.rollout.samples, cfg.rollout.group_size
        assert responses == [text for group in samples.texts for text in group]
        prompts = [run_.tokenizer.decode(ids) for ids in samples.prompt_ids]
        sources = [[r for r in rows if r["text"] in prompt] for prompt in prompts]
        assert all(len(s) == 1 for s in sources), prompts  # each prompt names one record
        assert len({s[0]["task_id"] for s in sources}) > 1  # a mix-up would show
        assert [sandbox.parse_spec(g)["tests"] for g in golds] == [
            sources[i // G][0]["test_list"] for i in range(len(golds))]
        specs = {json.dumps(r["test_list"]): r["code"] for r in rows}
        right, wrong = [], []
        for gold in golds:
            spec = sandbox.parse_spec(gold)
            code = specs[json.dumps(spec["tests"])]  # the gold is one record's own tests
            right.append(f"```python\n{code}\n```")
            wrong.append(f"```python\n{code.replace('return x', 'return 100 + x')}\n```")
        rewards, _ = run_.scorer.score(right + wrong, golds + golds,
                                       response_lengths=np.ones(2 * len(golds), np.int32))
        checked.append(rewards)

    try:
        loop.train(cfg, str(tmp_path / "w"), run=run, step_hooks=(check_golds,))
    finally:
        run.close()
    n = cfg.rollout.batch_prompts * cfg.rollout.group_size
    assert len(seen[0][0]) == n and len(checked) == 1
    np.testing.assert_array_equal(checked[0], [1.0] * n + [0.0] * n)
    result = json.loads((tmp_path / "w" / "eval" / "step_1.json").read_text())
    bench_result = result["benchmarks"]["bench"]
    assert [q["id"] for q in bench_result["per_question"]] == ["2", "3"]
    assert bench_result["k"] == 2 and "pass@2" in bench_result
    assert result["benchmarks"]["math_bench"]["num_questions"] == 1


def test_a_lora_run_trains_the_adapters_resumes_and_exports_them_merged(tmp_path):
    """model.lora_rank=4 through loop.train (SFT warm start, two DelTA steps with a KL term,
    checkpoints): the base weights come out bit for bit as they went in, the adapters moved, the
    optimizer state holds Adam's moments of the adapters alone; the KL reference is the post-SFT
    policy, kept as a copy of its adapters alone (the base is the live policy's); a resume from
    the checkpoint restores it and trains a third step; the exported directory (no adapters)
    gives the trained policy's logits."""
    import jax
    import jax.numpy as jnp

    from delta_jax import models
    from delta_jax.train.checkpoint import Checkpointer
    from delta_jax.train.state import split_trainable
    from tests.rl_fixtures import tree_max_abs_diff

    def config(steps):
        return tiny_rl_config("delta", model=dict(lora_rank=4, lora_alpha=8.0),
                              sft=dict(steps=2, batch_size=4, max_len=32, warmup_steps=0),
                              rl=dict(kl_coef=0.1, kl_type="k3"),
                              train=dict(LOOP_WITHOUT_EVAL, steps=steps, save_every=1,
                                         export_final=True))

    run = build_scored_run(config(2), tmp_path)
    try:
        lora0, base0 = jax.device_get(split_trainable(run.read_initial_params()))
        assert len(jax.tree.leaves(lora0)) == 14  # A and B on q, k, v, o, gate, up, down
        state, run = loop.train(run.cfg, str(tmp_path), run=run)
        assert _rl_steps(tmp_path) == [1, 2]
        lora, base = jax.device_get(split_trainable(state.params))
        assert tree_max_abs_diff(base, base0) == 0.0
        assert tree_max_abs_diff(lora, lora0) > 1e-4
        opt_elems = sum(x.size for x in jax.tree.leaves(state.opt_state))
        lora_elems = sum(x.size for x in jax.tree.leaves(lora))
        assert 2 * lora_elems <= opt_elems <= 2 * lora_elems + 8
        ckpt = Checkpointer(str(tmp_path / "checkpoints"))
        lora_sft = jax.device_get(split_trainable(ckpt.restore(0, state)[0].params)[0])
        ckpt.close()
        assert tree_max_abs_diff(lora_sft, lora0) > 1e-4  # SFT moved the adapters
        assert tree_max_abs_diff(jax.device_get(run.ref_params), lora_sft) == 0.0
        rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        kl = {r["step"]: r["policy/kl"] for r in rows if "policy/kl" in r}
        assert abs(kl[1]) < 1e-7 and kl[2] > 1e-6  # reference == the policy at step 1 only
        run.ref_params = jax.tree.map(jnp.zeros_like, run.ref_params)
        state3, run = loop.train(config(3), str(tmp_path), run=run)
        assert _rl_steps(tmp_path) == [1, 2, 3] and int(state3.step) > int(state.step)
        assert tree_max_abs_diff(jax.device_get(run.ref_params), lora_sft) == 0.0
        lora3, base3 = jax.device_get(split_trainable(state3.params))
        assert tree_max_abs_diff(base3, base0) == 0.0 and tree_max_abs_diff(lora3, lora) > 0
        exported = models.from_pretrained(str(tmp_path / "final"))
        assert not exported.layers.lora_names() and exported.cfg.lora_rank == 0
        # ... and the adapters alone in PEFT's format (tests/test_hf_io.py applies one by peft).
        adapter = json.loads((tmp_path / "final" / "lora_adapter" / "adapter_config.json")
                             .read_text())
        assert (adapter["r"], adapter["lora_alpha"], len(adapter["target_modules"])) == (4, 8.0, 7)
        ids = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 12)), jnp.int32)
        np.testing.assert_allclose(exported(ids).logits, run.model(state3.params)(ids).logits,
                                   atol=2e-5)
    finally:
        run.close()


def test_an_offloaded_optimizer_state_trains_like_one_on_the_device(tmp_path, monkeypatch):
    """optim.offload=True on bfloat16 parameters (so the float32 master copy moves too): the
    optimizer state rests in pinned host memory between steps, the updates get it on the device,
    and a run resumed in between ends with the parameters and optimizer state of a run that kept
    it on the device throughout. No pinned host memory is held while the updates run."""
    import jax

    from delta_jax.train import phases

    def config(steps, offload):
        return tiny_rl_config("dapo", model=dict(param_dtype="bfloat16"),
                              optim=dict(offload=offload),
                              train=dict(LOOP_WITHOUT_EVAL, steps=steps, keep=10, save_every=1))

    ref = jax.device_get(_train(config(3, False), tmp_path / "ref"))
    seen, pinned = [], []
    update = phases.update_policy

    def recording_update(train_step, state, *args, **kwargs):
        seen.append({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
        pinned.append(live_device_bytes(jax.devices()[0], "pinned_host"))
        return update(train_step, state, *args, **kwargs)

    monkeypatch.setattr(phases, "update_policy", recording_update)
    _train(config(2, True), tmp_path / "off")
    state = _train(config(3, True), tmp_path / "off")  # resumes from checkpoint 2
    assert _rl_steps(tmp_path / "off") == [1, 2, 3]
    assert seen == [{"device"}] * 3
    # the host copy freed while the updates run (not beside the one they write back after)
    assert pinned == [0] * 3
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    assert jax.tree.leaves(state.opt_state.master), "bfloat16 parameters have a master copy"
    got = jax.device_get(state)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)


class _EqualRewards:
    """A scorer under which every sample of a group gets reward 0: no group has signal."""

    def score(self, texts, golds, response_lengths=None, truncated=None, problems=None,
              data_sources=None, extra_infos=None, response_ids=None, trainer_state=None,
              solutions=None, columns=None):
        rewards = np.zeros(len(texts), np.float32)
        return rewards, {"accuracy": rewards, "num_timeouts": 0, "num_no_box": len(texts),
                         "num_errors": 0}

    def close(self):
        pass


def test_a_batch_dynamic_sampling_cannot_fill_halts_with_a_checkpoint(tmp_path):
    """Dynamic sampling that cannot fill step 2's batch (every group's rewards equal from then
    on) halts the run with RunHalted, naming the step and the fields that decide it, after
    saving checkpoint 1 (train.save_every=10 would have kept only checkpoint 0: step 1 was lost
    before); the same run resumed with rl.dynamic_sampling_on_max_rounds=pad trains steps 2 and
    3 from it, their batches padded with zero-signal groups."""
    from delta_jax.errors import RunHalted
    from delta_jax.train.checkpoint import Checkpointer

    sections = dict(model=dict(num_layers=1),
                    rl=dict(dynamic_sampling=True, dynamic_sampling_max_rounds=2),
                    train=dict(steps=3, save_every=10, keep=5, **LOOP_WITHOUT_EVAL))
    cfg = tiny_rl_config("dapo", **sections)
    run = build_scored_run(cfg, tmp_path)

    def equal_rewards_after_step_1(run, step, out):
        run.scorer = _EqualRewards()

    with pytest.raises(RunHalted, match=r"^step 2: dynamic sampling: only 0 of 4 groups with "
                       r"reward signal after 2 rounds .*rl\.dynamic_sampling_max_rounds=2 .*"
                       r"rl\.dynamic_sampling_on_max_rounds=pad .*checkpoint 1 saved in "):
        loop.train(cfg, str(tmp_path), run=run, step_hooks=[equal_rewards_after_step_1])
    ckpt = Checkpointer(str(tmp_path / "checkpoints"))
    assert ckpt.all_steps() == [0, 1]
    ckpt.close()

    sections["rl"]["dynamic_sampling_on_max_rounds"] = "pad"
    padded = tiny_rl_config("dapo", **sections)
    resumed = build_scored_run(padded, tmp_path)
    resumed.scorer = _EqualRewards()
    _, resumed = loop.train(padded, str(tmp_path), run=resumed)
    resumed.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rl_rows = [r for r in rows if "policy/loss" in r]
    assert [r["step"] for r in rl_rows] == [1, 2, 3]
    assert [r["rollout/padded_groups"] for r in rl_rows] == [0.0, 4.0, 4.0]
