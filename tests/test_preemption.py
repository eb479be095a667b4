"""Stopping on SIGINT / SIGTERM (train/preemption.py and its use by loop.train / delta_jax.main).

End to end (the issue's acceptance): `python -m delta_jax.main` on a tiny 12-step run gets SIGTERM
during step 5: it saves a checkpoint at step >= 4 and exits 143 with a one-line message; the same
command then finishes, and metrics.jsonl holds steps 1..12 once each.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from delta_jax.train.preemption import StopOnSignal, TrainingInterrupted

REPO = pathlib.Path(__file__).resolve().parents[1]

CONFIG = '''
from tests.rl_fixtures import tiny_rl_config

def get_config():
    return tiny_rl_config("delta", train=dict(steps=12, save_every=3, keep=20,
                                               eval_before=False, eval_after=False,
                                               export_final=False),
                          rewards=dict(num_workers=1))
'''


def test_first_signal_sets_a_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs at the next bytecode boundary
            if stop.requested():
                break
            time.sleep(0.01)
        assert stop.requested() and stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    e = TrainingInterrupted(signal.SIGINT, 7, "/w/checkpoints")
    assert e.exit_code == 130
    assert str(e) == ("stopped by SIGINT: checkpoint step 7 saved in /w/checkpoints; run the "
                      "same command to resume")


def test_second_signal_exits_at_once():
    """The second SIGINT ends the process with 130 during the sleep that follows it: the line
    printed once that sleep is over (still inside the block) never comes."""
    code = ("import os, signal, time\n"
            "from delta_jax.train.preemption import StopOnSignal\n"
            "with StopOnSignal():\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(0.2)\n"
            "    print('first signal survived', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n"
            "    print('slept after the second signal', flush=True)\n"
            "print('not reached')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 130, (out.returncode, out.stderr[-2000:])
    assert out.stdout == "first signal survived\n", out.stdout  # nothing after the 2nd signal
    assert "second SIGINT" in out.stderr


def _rl_steps(metrics_path):
    if not metrics_path.exists():
        return []
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "policy/loss" in r]


def test_sigterm_during_a_step_saves_exits_143_and_the_rerun_finishes(tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text(CONFIG)
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "delta_jax.main", f"--config={config}", f"--workdir={workdir}"]
    metrics = workdir / "metrics.jsonl"
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group
        deadline = time.monotonic() + 600
        while 4 not in _rl_steps(metrics) and proc.poll() is None:
            assert time.monotonic() < deadline, "step 4 never finished"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # during step 5
        proc.wait(timeout=300)
    text = (tmp_path / "first.log").read_text()
    assert proc.returncode == 143, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM: checkpoint step ") and "resume" in last, last
    saved = int(last.split("checkpoint step ")[1].split()[0])
    # The reward workers went with the trainer: nothing is left in its process group.
    for _ in range(100):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("processes of the stopped run outlived it")
    assert saved >= 4 and (workdir / "checkpoints" / str(saved)).is_dir()
    assert _rl_steps(metrics) == list(range(1, saved + 1))

    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert _rl_steps(metrics) == list(range(1, 13))
