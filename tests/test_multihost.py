"""Two processes on CPU (jax.distributed with a local coordinator, gloo collectives), each with
2 local CPU devices, run an old-policy pass, DelTA coefficients, a train step and a rollout
(Sampler.generate, slots over both processes) on one (data=1, fsdp=2, tensor=2) mesh spanning
both processes; the updated parameters, DelTA weights and sampled tokens equal the
single-process result, and evaluation splits its scoring between them. The same pair also keeps
the DelTA features in the host cache (each process holds its own shards), exports the policy
from both processes into one directory and reads it back by shards, each process its own (one
launch serves both tests).
A second pair is the product itself: `python -m delta_jax.main` in two processes sharing a
workdir (a DelTA run with eval before and after), against the same config in this process.

The workers are this file run as a script, in a fresh environment with 2 devices each instead
of the test session's 8; they are killed if they do not finish in time.
"""
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROWS, PROMPT, RESP = 8, 4, 6
TIMEOUT_S = 240
GRACE_S = 20  # a survivor's wait for its partner's collective, once the partner failed


def model_config():
    from delta_jax import models
    return models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_layers=2, num_heads=4, num_kv_heads=2,
                                             head_dim=16)


def host_batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 64, (ROWS, PROMPT + RESP)).astype(np.int32)
    attn = np.ones((ROWS, PROMPT + RESP), np.int32)
    attn[0, :2] = 0
    resp = np.ones((ROWS, RESP), np.float32)
    resp[1, 3:] = 0
    attn[1, PROMPT + 3:] = 0
    adv = np.asarray([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25], np.float32)
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp, "advantages": adv}


def one_step(mesh):
    """Old-policy pass -> DelTA weights -> one AdamW train step. mesh=None: one device."""
    import jax
    import optax
    from flax import nnx

    from delta_jax import models, sharding
    from delta_jax.rl import losses
    from delta_jax.rl.delta import delta_coefficients
    from delta_jax.train import features
    from delta_jax.train.state import init_train_state, split_model
    from delta_jax.train.step import make_train_step

    model = models.Transformer(model_config(), rngs=nnx.Rngs(0))
    if mesh is not None:
        sharding.shard_model(model, mesh)
    graphdef, params, rest = split_model(model)
    optimizer = optax.adamw(1e-3, weight_decay=0.0)
    state = init_train_state(params, optimizer)
    state_sh = None
    if mesh is not None:
        state_sh = sharding.tree_shardings(state, mesh)
        state = sharding.shard_tree(state, state_sh)
    batch = sharding.put_batch(host_batch(), mesh)
    old_pass = features.make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=4,
                                             mesh=mesh)
    logp, _, hidden = old_pass(state.params, batch["input_ids"], batch["attention_mask"], RESP)
    weights, _ = delta_coefficients(hidden, jax.numpy.exp(logp), batch["advantages"],
                                    batch["response_mask"])
    batch.update(old_logp=logp, token_weights=weights)

    def loss_fn(logp, old_logp, adv, mask, w, ent):
        return losses.policy_loss(logp, old_logp, adv, mask, token_weights=w,
                                  cfg=losses.PolicyLossConfig(), entropy=ent)

    step = make_train_step(graphdef, rest, optimizer, loss_fn, temperature=1.0, chunk_size=4,
                           micro_batch_size=4, mesh=mesh, state_shardings=state_sh)
    new_state, metrics = step(state, batch)
    return new_state, weights, metrics


# Rollout prompts: 3 prompts x 2 samples in 4 slots (2 per fsdp batch shard of the (1, 2, 2)
# mesh, whose devices span both processes), so slots are refilled; STOP_IDS end some early.
ROLLOUT_PROMPTS = [[7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
ROLLOUT_NEW = 6


# Eight stop ids of the 64-token vocabulary: about one token in eight stops its sample, so some
# of the six samples stop early and some run to ROLLOUT_NEW whatever the random stream.
STOP_IDS = tuple(range(1, 9))


def rollout(mesh):
    """Sampler.generate of ROLLOUT_PROMPTS (temperature 1) on the mesh, or on one device:
    (response ids [6, ROLLOUT_NEW] padded with -1, their log-probs padded with 0)."""
    from flax import nnx

    from delta_jax import models, sharding
    from delta_jax.sampling import Sampler

    model = models.Transformer(model_config(), rngs=nnx.Rngs(0))
    if mesh is not None:
        sharding.shard_model(model, mesh)
    out = Sampler(model, max_batch_size=4, mesh=mesh, page_size=4).generate(
        ROLLOUT_PROMPTS, n=2, temperature=1.0, max_new_tokens=ROLLOUT_NEW, stop_token_ids=STOP_IDS,
        seed=3)
    ids = np.full((6, ROLLOUT_NEW), -1, np.int32)
    logp = np.zeros((6, ROLLOUT_NEW), np.float32)
    for row, (r, lp) in enumerate(zip([r for g in out.response_ids for r in g],
                                      [x for g in out.logprobs for x in g])):
        ids[row, :len(r)], logp[row, :len(lp)] = r, lp
    return ids, logp


def flat_params(params):
    import jax
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(params)}


def host_cache_and_export(mesh, new_state, export_dir):
    """On the mesh: DelTA weights from the host feature cache (phases, keep_hidden="host") and
    from the device cache; the updated policy exported with models.save_pretrained."""
    from flax import nnx

    from delta_jax import models, sharding
    from delta_jax.train import features, phases
    from delta_jax.train.state import split_model

    model = models.Transformer(model_config(), rngs=nnx.Rngs(0))
    sharding.shard_model(model, mesh)
    graphdef, _, rest = split_model(model)
    batch = sharding.put_batch(host_batch(), mesh)
    old_pass = features.make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=4,
                                             mesh=mesh)
    weights = {}
    for mode in ("device", "host"):
        settings = phases.DeltaSettings(feature_cache=mode, recompute_chunk=4)
        old = phases.old_policy_features(old_pass, new_state.params, batch["input_ids"],
                                         batch["attention_mask"], RESP, row_chunk=4,
                                         keep_hidden=mode)
        source = phases.delta_feature_source(old, settings)
        weights[mode], _ = phases.delta_weights(source, batch["advantages"],
                                                batch["response_mask"], settings)
    models.save_pretrained(nnx.merge(graphdef, new_state.params, rest), export_dir)
    return weights


# Tensors whose elements each process reads when it loads the export by shards.
READ_TENSORS = ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight",
                "model.norm.weight")


def load_by_shards(mesh, export_dir):
    """models.from_pretrained of the export, placed on the mesh by the run's rules (its
    parameters fsdp-split over the two processes); the elements of READ_TENSORS this process
    read."""
    from delta_jax import models, sharding
    from delta_jax.models import hf_io

    read, real_read = dict.fromkeys(READ_TENSORS, 0), hf_io._TensorReader.read

    def counting_read(self, name, shape, where, index=None):
        out = real_read(self, name, shape, where, index)
        if name in read:
            read[name] += out.size
        return out

    hf_io._TensorReader.read = counting_read
    try:
        model = models.from_pretrained(export_dir, shardings=sharding.param_sharding_fn(mesh))
    finally:
        hf_io._TensorReader.read = real_read
    return _param_state(model), np.asarray([read[n] for n in READ_TENSORS], np.int64)


def stop_agreement(index: int) -> int:
    """A SIGTERM that reaches process 1 alone stops both: StopOnSignal.requested() is false on
    both before it and true on both after it; process 0's own SIGTERM arriving after that is
    its first, not a second one that exits at once (a pod's hosts get theirs at different
    times). Returns the signal this process stops with."""
    from delta_jax.train.preemption import StopOnSignal
    with StopOnSignal() as stop:
        assert not stop.requested()
        if index == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            while stop.signum is None:  # the handler runs between bytecodes, soon
                time.sleep(0.001)
        assert stop.requested()
        if index == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # an exit here would fail the test (exit code 143)
        assert stop.requested()
        return stop.signum


class RecordingScorer:
    """Accuracy 1 for a response that is its gold answer; records what it was asked to score."""

    def __init__(self):
        self.seen, self.problems = [], []

    def score(self, texts, golds, response_lengths=None, truncated=None, problems=None,
              data_sources=None, extra_infos=None, response_ids=None, trainer_state=None,
              solutions=None, columns=None):
        self.seen += list(texts)
        self.problems += list(problems)
        acc = np.asarray([float(t == g) for t, g in zip(texts, golds)], np.float32)
        return acc, {"accuracy": acc, "num_timeouts": 0, "num_no_box": int((acc == 0).sum()),
                     "num_errors": len(texts)}


def eval_scoring_shares(index: int):
    """evaluation.evaluate in two processes: 3 questions x k 3 = 9 responses, each process
    scores its own share (5 and 4), with their problems, and both get every question's count
    and the summed counts."""
    from delta_jax import evaluation
    rows = [{"id": str(i), "problem": f"q{i}", "answer": str(i)} for i in range(3)]

    def generate_fn(prompts, n):  # question i: i of its n responses are right
        return [[str(i) if j < i else "wrong" for j in range(n)] for i in range(len(prompts))]

    scorer = RecordingScorer()
    result = evaluation.evaluate(generate_fn, {"b": rows}, k=3, scorer=scorer)
    share = [str(i) if j < i else "wrong" for i in range(3) for j in range(3)]
    assert scorer.seen == (share[:5] if index == 0 else share[5:]), (index, scorer.seen)
    problems = [f"q{i}" for i in range(3) for _ in range(3)]
    assert scorer.problems == (problems[:5] if index == 0 else problems[5:]), scorer.problems
    got = result.benchmarks["b"]
    assert list(got.num_correct) == [0, 1, 2], got.num_correct
    assert (got.num_no_box, got.num_timeouts, got.num_errors) == (6, 0, 9)


def reward_fns_across_processes(index: int):
    """score_across_processes over two processes: each process's score() gives its own share's
    rewards of each of several python_fn functions (info "reward_fns"); every process gets every
    function's rewards of all 9 responses, in order (and no other key of info); each share's
    score() gets its responses' token ids and the one trainer_state."""
    from delta_jax.rl.rewards import TrainerState, score_across_processes

    state = TrainerState(global_step=4, max_steps=9)

    def score(texts, golds, response_lengths=None, truncated=None, response_ids=None,
              trainer_state=None):
        assert response_ids == [[len(t), 7] for t in texts], (texts, response_ids)
        assert trainer_state == state, trainer_state
        lengths = np.asarray([len(t) for t in texts], np.float32)
        return lengths, {"accuracy": lengths > 1, "num_timeouts": 0, "num_no_box": 0,
                         "num_errors": 0, "seconds": 1.0 + index,
                         "reward_fns": {"length": lengths, "one": np.ones(len(texts))}}

    texts = ["a" * i for i in range(9)]
    rewards, info = score_across_processes(score, texts, ["x"] * 9,
                                           response_ids=[[i, 7] for i in range(9)],
                                           trainer_state=state)
    assert rewards.tolist() == list(range(9)), rewards
    assert sorted(info) == ["accuracy", "num_errors", "num_no_box", "num_timeouts",
                            "reward_fns"], info
    each = info["reward_fns"]
    assert list(each) == ["length", "one"], each
    assert each["length"].tolist() == list(range(9)) and each["one"].tolist() == [1] * 9, each


def worker(process_id: int, port: int, out_path: str, export_dir: str):
    from delta_jax import sharding
    index, count = sharding.initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    import jax
    from jax.experimental import multihost_utils
    assert count == 2 and index == process_id
    assert len(jax.local_devices()) == 2 and len(jax.devices()) == 4
    mesh = sharding.make_mesh(1, 2, 2)
    signum = stop_agreement(index)
    # What process 0 alone read (best/best.json, metrics.jsonl) becomes every process's answer.
    # (to the bit: 11 / 24 is no float32, 2**40 + 1 no int32)
    from_0 = (sharding.from_process_0(np.float64(11 / 24 if index == 0 else 2.0)),
              sharding.from_process_0(np.int64(2**40 + 1 if index == 0 else -1)),
              sharding.from_process_0(np.int32(index == 0)))
    assert from_0 == (11 / 24, 2**40 + 1, 1), from_0
    eval_scoring_shares(index)
    reward_fns_across_processes(index)
    new_state, weights, metrics = one_step(mesh)
    q = new_state.params["layers"]["q_proj"][...]
    assert not q.is_fully_addressable  # the parameters really span both processes
    cached = host_cache_and_export(mesh, new_state, export_dir)
    multihost_utils.sync_global_devices("exported")  # the export's files are whole
    loaded, reads = load_by_shards(mesh, export_dir)
    roll = rollout(mesh)  # the sampler's slots span both processes
    gathered = multihost_utils.process_allgather(
        {"params": new_state.params, "weights": weights, "cached": cached, "loaded": loaded},
        tiled=True)
    reads = multihost_utils.process_allgather(reads)  # [process, tensor]
    if index == 0:
        out = {"s/signum": np.asarray(signum), "w/weights": np.asarray(gathered["weights"]),
               "m/loss": np.asarray(jax.device_get(metrics["loss"]))}
        out.update({"c/" + k: np.asarray(v) for k, v in gathered["cached"].items()})
        out.update({"p/" + k: v for k, v in flat_params(gathered["params"]).items()})
        out.update({"l/" + k: v for k, v in flat_params(gathered["loaded"]).items()})
        out["n/reads"] = np.asarray(reads)
        out["r/ids"], out["r/logp"] = roll
        np.savez(out_path, **out)
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(tmp_path, export_dir):
    """Runs worker() in two processes; returns the arrays process 0 saved."""
    out_path = tmp_path / "result.npz"
    port = _free_port()
    launch_two(lambda pid: [sys.executable, __file__, str(pid), str(port), str(out_path),
                            str(export_dir)])
    return dict(np.load(out_path))


def launch_two(command, while_running=None, returncode=0):
    """Runs command(process_id) for process ids 0 and 1 (2 CPU devices each, no inherited
    jax.distributed settings); while_running(processes), if given, is called once they have
    started. Fails the test unless both exit with `returncode` (or returncode[process id]; None:
    any failure of its own) within TIMEOUT_S; once one has exited with a nonzero code, the other
    (perhaps left waiting in a collective) gets GRACE_S before it is killed. Returns their
    outputs."""
    want = tuple(returncode) if isinstance(returncode, (tuple, list)) else (returncode,) * 2

    def wrong(code, wanted):
        return code != wanted if wanted is not None else code in (0, -signal.SIGKILL)

    from tests.rl_fixtures import cpu_process_env, python_path
    env = cpu_process_env(2)
    env.update(PYTHONPATH=python_path())
    outs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    procs = [subprocess.Popen(command(pid), env=env, cwd=str(REPO), stdout=outs[pid],
                              stderr=subprocess.STDOUT, text=True) for pid in range(2)]
    try:
        if while_running is not None:
            while_running(procs)
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = []
    for out in outs:
        out.seek(0)
        logs.append(out.read())
        out.close()
    for pid, (p, log) in enumerate(zip(procs, logs)):
        if wrong(p.returncode, want[pid]):
            tails = "\n".join(f"process {i}, exit {q.returncode}:\n{text[-3000:]}"
                              for i, (q, text) in enumerate(zip(procs, logs)))
            wanted = want[pid] if want[pid] is not None else "a failure of its own"
            pytest.fail(f"process {pid} exited {p.returncode}, want {wanted} (negative: "
                        f"killed, e.g. after {TIMEOUT_S} s or {GRACE_S} s after the other "
                        f"failed)\n{tails}")
    return logs


@pytest.fixture(scope="module")
def two_process_result(tmp_path_factory):
    """worker() in two processes, once for the two tests below; its export directory."""
    tmp_path = tmp_path_factory.mktemp("two_processes")
    export_dir = tmp_path / "export"
    return run_two_processes(tmp_path, export_dir), export_dir


def test_two_processes_match_one(two_process_result, on_cpu):
    # on_cpu: the one-process reference runs where the two worker processes do, on the CPU
    # (its first device, the default device there).
    got, _ = two_process_result
    assert int(got["s/signum"]) == 15  # process 0 stops with process 1's SIGTERM
    ref_state, ref_weights, ref_metrics = one_step(None)
    np.testing.assert_allclose(got["w/weights"], np.asarray(ref_weights), atol=1e-4)
    np.testing.assert_allclose(got["m/loss"], float(ref_metrics["loss"]), rtol=1e-4, atol=1e-6)
    ref = flat_params(ref_state.params)
    assert {k[2:] for k in got if k.startswith("p/")} == set(ref)
    from flax import nnx

    from delta_jax import models
    before = flat_params(nnx.state(models.Transformer(model_config(), rngs=nnx.Rngs(0)),
                                   nnx.Param))
    assert max(np.abs(ref[k] - before[k]).max() for k in ref) > 5e-4  # the step did move
    for name, value in ref.items():
        # One AdamW step of lr 1e-3 moves each weight by ~1e-3; allow 2% of that.
        np.testing.assert_allclose(got["p/" + name], value, atol=2e-5, err_msg=name)
    # The rollout engine over the same two processes: per-sample randomness, so the same tokens
    # (and log-probs) as one device, whatever the slots, shards and processes.
    ref_ids, ref_logp = rollout(None)
    assert (ref_ids >= 0).sum() > 12 and (ref_ids == -1).any()  # real work; some stop early
    np.testing.assert_array_equal(got["r/ids"], ref_ids)
    np.testing.assert_allclose(got["r/logp"], ref_logp, atol=1e-4)


def test_host_feature_cache_and_export_across_processes(two_process_result):
    """Parameters and features that span two processes: the host feature cache gives the device
    cache's DelTA weights, and save_pretrained called by both processes writes one directory
    that loads back to the gathered parameters, whole in this process and by shards in both
    (as a run loads model.path), where each process reads its own devices' shards: half of an
    fsdp-split tensor each, a replicated one whole."""
    from delta_jax import models

    got, export_dir = two_process_result
    np.testing.assert_allclose(got["c/host"], got["c/device"], atol=1e-5)
    valid = host_batch()["response_mask"] > 0
    np.testing.assert_allclose(got["c/host"][valid].mean(), 1.0, atol=1e-5)
    loaded = flat_params(_param_state(models.from_pretrained(str(export_dir))))
    params = {k[2:]: v for k, v in got.items() if k.startswith("p/")}
    assert loaded.keys() == params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
        np.testing.assert_array_equal(got["l/" + name], value, err_msg=name)
    cfg = model_config()
    H = cfg.hidden_size
    whole = {"model.layers.0.self_attn.q_proj.weight": H * cfg.num_heads * cfg.head_dim,
             "model.embed_tokens.weight": cfg.vocab_size * H, "model.norm.weight": H}
    reads = got["n/reads"]  # [process, tensor]
    assert reads.shape == (2, len(READ_TENSORS))
    for i, name in enumerate(READ_TENSORS):
        # q_proj [embed: fsdp, heads: tensor] and embed [vocab: tensor, embed: fsdp]: half each
        want = whole[name] if name == "model.norm.weight" else whole[name] // 2
        assert list(reads[:, i]) == [want, want], (name, reads[:, i], whole[name])


def test_main_across_two_processes_trains_as_one(tmp_path, on_cpu):
    """`python -m delta_jax.main` in two processes on one workdir, the parameters fsdp-sharded
    over both (mesh 1 x 4 x 1). A SIGTERM to process 1 alone stops both at the same step with a
    checkpoint (exit 143); the same command resumes. Each process scores half the responses
    (rewards.score_across_processes); the gathered rewards are the one-process run's, row for row
    (the parameters below move 3e-3 when the halves are swapped). Process 0 alone writes the
    metrics, the DelTA weight histograms, the eval files and the report, each step once, and
    prints the progress bar and the info log lines (process 1: warnings and errors only);
    mode=eval in both processes then evaluates checkpoint 2 as training's last eval did. The
    final checkpoint reads back into this process and holds the parameters of the same run done
    here, without a stop, in one process on 4 of its devices (the same mesh)."""
    import json

    import jax

    from delta_jax import sharding
    from delta_jax.train import loop
    from delta_jax.train import run as run_lib
    from delta_jax.train.checkpoint import Checkpointer
    from delta_jax.train.config import validate_config
    from tests.rl_fixtures import tree_max_abs_diff, tree_max_relative_change
    from tests.test_main import TEST_CONFIG, load_config

    config_path = tmp_path / "config.py"
    config_path.write_text(TEST_CONFIG)
    settings = dict(method="delta", train__steps=2, train__save_every=2, sft__steps=0,
                    train__eval_before=True, train__eval_after=True, train__progress_bar=True,
                    train__rollouts_every=1, mesh__data=1, mesh__fsdp=-1)
    flags = [f"--config.{k.replace('__', '.')}={v}" for k, v in settings.items()]
    workdir = tmp_path / "two"
    port = _free_port()

    def command(pid):
        return [sys.executable, "-m", "delta_jax.main", f"--config={config_path}",
                f"--workdir={workdir}", *flags,
                f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                "--config.distributed.num_processes=2", f"--config.distributed.process_id={pid}"]

    def preempt_process_1(procs):
        """SIGTERM to process 1 alone, once checkpoint 0 is on disk (mid-run, at whatever
        point of its step process 1 then is)."""
        deadline = time.monotonic() + TIMEOUT_S
        while (not (workdir / "checkpoints" / "0").is_dir() and procs[0].poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)

    first = launch_two(command, preempt_process_1, returncode=143)  # both stop, none hangs
    assert "SIGTERM received by another process" in first[0]
    stopped_at = [int(re.search(r"checkpoint step (\d+) saved", log).group(1)) for log in first]
    assert stopped_at[0] == stopped_at[1] < 2, stopped_at
    logs = launch_two(command)  # the same command resumes and finishes
    assert "metrics: " in logs[0] and "metrics: " not in logs[1]  # the report: process 0's
    for text in ("rl (delta)", "step 2 | ", "eval step 2: "):  # one console: process 0's bar
        assert text in logs[0] and text not in logs[1], text  # and its info log lines

    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows if "policy/loss" in r] == [1, 2]  # once each, not twice
    hist = [json.loads(line) for line in open(workdir / "delta_weights.jsonl")]
    assert [h["step"] for h in hist] == [1, 2]
    assert sorted(p.name for p in (workdir / "eval").iterdir()) == [
        "step_0.json", "step_0_responses.jsonl", "step_2.json", "step_2_responses.jsonl"]
    # the responses of each step, once (process 0 writes; a redone step rewrites its file)
    dumped = {n: [json.loads(line) for line in open(workdir / "rollouts" / f"step_{n}.jsonl")]
              for n in (1, 2)}
    assert sorted(p.name for p in (workdir / "rollouts").iterdir()) == [
        "step_1.jsonl", "step_2.jsonl"]
    # mode=eval in both processes reads checkpoint 2's parameters alone, each process its own
    # shards (orbax's partial restore), and evaluates them as training's eval after step 2 did.
    evaluate = launch_two(lambda pid: [*command(pid), "--config.mode=eval"])
    assert "eval of checkpoint 2 of" in evaluate[0]
    standalone = json.loads((workdir / "eval" / "standalone_step_2.json").read_text())
    trained = json.loads((workdir / "eval" / "step_2.json").read_text())
    assert standalone["benchmarks"] == trained["benchmarks"]

    cfg = validate_config(load_config(config_path, **settings))
    for n, got in dumped.items():
        assert [r["row"] for r in got] == list(range(
            cfg.rollout.batch_prompts * cfg.rollout.group_size)) and {r["step"] for r in got} == {n}
    mesh = sharding.mesh_from_config(cfg.mesh, devices=jax.devices("cpu")[:4])  # as the workers
    run = run_lib.build_run(cfg, str(tmp_path / "one"), mesh=mesh)
    initial = jax.device_get(run.read_initial_params())  # what the run starts from
    ref_state, run = loop.train(cfg, str(tmp_path / "one"), run=run)
    run.close()
    one = [json.loads(line) for line in open(tmp_path / "one" / "metrics.jsonl")]
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):  # the same rollouts
        assert [r[key] for r in rows if key in r] == [r[key] for r in one if key in r], key
    for n, got in dumped.items():  # and the whole batch's responses, not process 0's share
        alone = [json.loads(line) for line in open(tmp_path / "one" / "rollouts" / f"step_{n}.jsonl")]
        assert [r["response"] for r in got] == [r["response"] for r in alone]
    ckpt = Checkpointer(str(workdir / "checkpoints"))
    restored, _, meta = ckpt.restore(2, ref_state)
    ckpt.close()
    assert meta["step"] == 2
    # 2 steps x 2 AdamW updates of lr 1e-3 move weights by up to ~4e-3; the cross-process
    # reductions (gloo) add in another order, which Adam's normalisation magnifies in the few
    # weights whose gradients nearly cancel (a sign flips: up to ~2e-4 apart). So each parameter
    # tensor as a whole must end within 2% of its own movement (L2): measured on an AMD EPYC,
    # 2026-11-26, at most 0.17% (q_proj; XLA:CPU's default emitters) and 0.31% (the elemental
    # emitter the suite compiles with); with the two processes' score halves swapped, 51-113%
    # per tensor. (The former bound, the largest single-weight difference within 5% of the
    # largest movement, followed rounding's tail: 9e-5 and 2.4e-4 of 4e-3 on those two emitters.)
    moved = tree_max_abs_diff(ref_state.params, initial)
    assert moved > 2e-3  # the run did move
    off = tree_max_relative_change(restored.params, ref_state.params, initial)
    assert off <= 0.02, off


def test_a_process_failing_alone_stops_the_other_at_once(tmp_path):
    """`python -m delta_jax.main` as two processes where one fails alone: it reports its error
    and exits at once, and the other, left waiting for it in a collective, is stopped soon
    after, instead of both waiting (Python's exit waits in jax.distributed's shutdown barrier,
    300 s, for a partner that waits for it: past TIMEOUT_S here). Process 1 failing mid-run
    (an error in its evaluation, raised by the test's wrapper, at the eval before step 1;
    process 0 is sampling by then): its traceback. Process 0 failing (the workdir is held by
    another run; only process 0 takes the lock): process 1 is stopped by the distributed
    runtime because the coordination service (process 0's) went away (or says so in one line,
    sharding.PartnerGone, where that happened during its start-up barrier), not by an error of
    its own (no traceback) nor by a wait that timed out (gloo's set-up, a barrier: a
    DEADLINE_EXCEEDED)."""
    from delta_jax.train.workdir_lock import WorkdirLock
    from tests.test_main import TEST_CONFIG

    config_path = tmp_path / "config.py"
    config_path.write_text(TEST_CONFIG)
    workdir = tmp_path / "run"
    workdir.mkdir()
    failing_main = ("import runpy\nfrom delta_jax import evaluation\n"
                    "def evaluate(*args, **kwargs):\n"
                    "    raise RuntimeError('an evaluation bug in process 1')\n"
                    "evaluation.evaluate = evaluate\n"
                    "runpy.run_module('delta_jax.main', run_name='__main__', alter_sys=True)\n")

    def command_for(port):
        def command(pid):
            main = ["-c", failing_main] if pid == 1 else ["-m", "delta_jax.main"]
            return [sys.executable, *main, f"--config={config_path}",
                    f"--workdir={workdir}", "--config.train.steps=2", "--config.sft.steps=0",
                    "--config.train.eval_before=True", "--config.mesh.data=1",
                    "--config.mesh.fsdp=-1", "--config.distributed.heartbeat_timeout_s=5",
                    "--config.data.eval=synthetic",
                    f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                    "--config.distributed.num_processes=2", f"--config.distributed.process_id={pid}"]
        return command

    logs = launch_two(command_for(_free_port()), returncode=(None, 1))
    assert "Traceback" in logs[1] and "RuntimeError: an evaluation bug in process 1" in logs[1]
    assert not (workdir / "checkpoints" / "0").exists()  # stopped before checkpoint 0

    lock = WorkdirLock(str(workdir))
    lock.acquire()
    try:
        logs = launch_two(command_for(_free_port()), returncode=(1, None))
    finally:
        lock.release()
    assert "is in use by another run" in logs[0]
    # Stopped by the distributed runtime, or (process 0 gone right after the start-up barrier,
    # before its reply reached process 1) by sharding.PartnerGone's one line: either way
    # because its partner's service is gone, at once.
    assert ("Terminating process because the JAX distributed service detected fatal errors"
            in logs[1] or "the coordination service (process 0's) went away" in logs[1]), (
        logs[1][-3000:])
    assert "UNAVAILABLE: Failed to send RPC to coordination service" in logs[1], logs[1][-3000:]
    assert "DEADLINE_EXCEEDED" not in logs[1] and "Traceback" not in logs[1], logs[1][-3000:]


def _param_state(model):
    from flax import nnx
    return nnx.state(model, nnx.Param)


if __name__ == "__main__":
    try:
        worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    except BaseException:  # leave at once: the partner, waiting in a collective, is stopped by
        import traceback   # the distributed runtime (Python's exit would wait minutes for it)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
