"""Tests for delta_jax.rl.rewards and delta_jax.rl.verify_pool.

One scorer (2 worker processes) is shared by the module to keep start-up cost low.
"""
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from delta_jax.errors import InputError
from delta_jax.rl import rewards as R
from delta_jax.rl import verify_pool as vp
from tests.rl_fixtures import python_path


# (response, gold, expected reward, why). Labels are what a careful human grader would give.
CASES = [
    # fractions and decimals
    (r"so $\boxed{\frac{1}{2}}$", "0.5", 1, "fraction vs decimal"),
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1, "dfrac"),
    (r"\boxed{\frac{6}{8}}", r"\frac34", 1, "unreduced fraction, brace-less gold frac"),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0, "different fraction"),
    (r"\boxed{3.0}", "3", 1, "trailing .0"),
    (r"\boxed{0.333}", r"\frac{1}{3}", 0, "3-digit rounding is not 1/3"),
    (r"\boxed{2.0001}", "2", 0, "close but different"),
    (r"\boxed{-\frac{1}{2}}", r"\frac{-1}{2}", 1, "sign placement"),
    # LaTeX spacing and formatting
    (r"\boxed{ \frac { 1 } { 2 } }", r"\frac{1}{2}", 1, "spaces inside frac"),
    (r"\boxed{1{,}000}", "1000", 1, "LaTeX thousands separator"),
    (r"\boxed{1,000,000}", "1000000", 1, "comma thousands separators"),
    (r"\boxed{10^6}", "1000000", 1, "power of ten"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", 1, r"\left( \right)"),
    (r"\boxed{6.}", "6", 1, "trailing sentence period inside the box"),
    (r"\boxed{{(2,4)}}", "(2,4)", 1, "redundant grouping braces"),
    # units, money, percent, degrees
    (r"\boxed{12 \text{ inches}}", "12", 1, "unit text"),
    (r"\boxed{5\text{ cm}^2}", "5", 1, "unit with superscript"),
    (r"\boxed{\$1.50}", "1.5", 1, "dollar sign"),
    (r"\boxed{25\%}", "25", 1, "percent sign vs bare number"),
    (r"\boxed{50\%}", r"\frac{1}{2}", 1, "percent vs fraction"),
    (r"\boxed{90^\circ}", "90", 1, "degrees"),
    ("\\boxed{90°}", "90", 1, "unicode degree sign"),
    # negative numbers
    (r"\boxed{-5}", "-5", 1, "negative"),
    (r"\boxed{5}", "-5", 0, "sign error"),
    ("\\boxed{\u22123}", "-3", 1, "unicode minus"),
    # roots, pi, expressions
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1, "simplified root"),
    (r"\boxed{\sqrt{50}}", r"5\sqrt{2}", 1, "simplified root 2"),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0, "different root"),
    (r"\boxed{\pi \cdot 2}", r"2\pi", 1, "pi product order"),
    (r"\boxed{3.14159}", r"\pi", 0, "decimal approximation of an exact answer"),
    (r"\boxed{\frac{1+\sqrt{5}}{2}}", r"\frac{1}{2}+\frac{\sqrt5}{2}", 1, "split fraction"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1, "factored polynomial"),
    (r"\boxed{2^{25}\times 26!}", r"2^{25} \cdot 26!", 1, "factorial, times vs cdot"),
    (r"\boxed{17}", "71", 0, "digits swapped"),
    # equations
    (r"\boxed{x=3}", "3", 1, "x=3 vs 3"),
    (r"\boxed{3}", "x=3", 1, "3 vs x=3"),
    (r"\boxed{y = 2x+1}", "2x+1", 1, "line equation"),
    (r"\boxed{x=4}", "x=3", 0, "wrong equation"),
    (r"\boxed{3x}", "3", 0, "extra variable"),
    # intervals, tuples, sets
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3]", 1, "interval spacing"),
    (r"\boxed{(1,2)}", "[1,2)", 0, "open vs half-open interval"),
    (r"\boxed{(1,\infty)\cup(-\infty,0)}", r"(-\infty,0)\cup(1,\infty)", 1, "union order"),
    (r"\boxed{x \in [1,2]}", "[1,2]", 1, r"x \in interval"),
    (r"\boxed{[2,\infty)}", r"k \ge 2", 1, "inequality vs interval"),
    (r"\boxed{(3, -1)}", "(3,-1)", 1, "tuple spacing"),
    (r"\boxed{(-1,3)}", "(3,-1)", 0, "ordered pair swapped"),
    (r"\boxed{(1,3,2)}", "(1,2,3)", 0, "triple permuted"),
    (r"\boxed{\{2,1\}}", r"\{1,2\}", 1, "set order, escaped braces"),
    (r"\boxed{\{1,2,3\}}", r"\{1,2\}", 0, "superset"),
    (r"\boxed{5, 3}", "3, 5", 1, "list of solutions in any order"),
    (r"\boxed{3}", "3, 5", 0, "only one of two solutions"),
    (r"\boxed{\pm 1}", r"\{-1, 1\}", 1, "plus-minus"),
    (r"\boxed{\varnothing}", r"\emptyset", 1, "empty set spellings"),
    (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", 1,
     "column vector"),
    # text answers and multiple choice
    (r"\boxed{\text{Monday}}", r"\text{Monday}", 1, "text answer"),
    (r"\boxed{Monday}", r"\text{Monday}", 1, r"text answer without \text"),
    (r"\boxed{\text{Tuesday}}", r"\text{Monday}", 0, "wrong text answer"),
    (r"\boxed{C}", r"\text{(C)}", 1, "choice letter"),
    (r"\boxed{\text{(B)}}", r"\text{(C)}", 0, "wrong choice"),
    (r"\boxed{\text{10}}", "10", 1, r"number in \text"),
    (r"\boxed{\textbf{5}}", "5", 1, r"number in \textbf"),
    # extraction: last box wins, \fbox, brace-less, no box, malformed
    (r"First \boxed{2}. Wait, I made an error: \boxed{3}", "3", 1, "last box wins"),
    (r"\boxed{3} is wrong, the answer is \boxed{2}", "3", 0, "last box wins (wrong)"),
    (r"<think>maybe \boxed{4}</think> The answer is $\boxed{5}$.", "5", 1, "box after think"),
    (r"\fbox{42}", "42", 1, "fbox"),
    (r"so $\boxed 7$.", "7", 1, "brace-less boxed"),
    (r"hence \boxed 5.", "5", 1, "brace-less boxed with period"),
    (r"$$\boxed{12}$$", "12", 1, "display math"),
    ("The answer is 3.", "3", 0, "no box"),
    (r"\boxed{}", "0", 0, "empty box"),
    (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0, "unclosed box (truncated)"),
    (r"\boxed{7} then \boxed{\frac{1}{2", "7", 0, "last box unclosed: no answer"),
    (r"\boxed{\frac{1}{2}}}}", r"\frac{1}{2}", 1, "extra closing braces after the box"),
    (r"\boxed{\frac{1}{}}", r"\frac{1}{2}", 0, "malformed LaTeX"),
    (r"\boxed{\sqrt{}", "2", 0, "malformed and unclosed"),
]
assert len(CASES) >= 40  # the table covers enough cases (checked once, at import)


@pytest.fixture(scope="module")
def scorer():
    with R.RewardScorer("math", num_workers=2, timeout_s=3.0) as s:
        yield s


@pytest.fixture(scope="module")
def table_results(scorer):
    responses = [c[0] for c in CASES]
    golds = [c[1] for c in CASES]
    rewards, info = scorer.score(responses, golds)
    return rewards, info


@pytest.mark.parametrize("idx", range(len(CASES)), ids=[c[3] for c in CASES])
def test_reward_table(table_results, idx):
    rewards, info = table_results
    response, gold, expected, why = CASES[idx]
    assert rewards[idx] == expected, (why, response, gold, rewards[idx])
    assert not info["timed_out"][idx] and not info["errored"][idx]


# --- extraction --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (r"\boxed{1}", "1"),
    (r"a \boxed{1} b \boxed{\frac{2}{3}} c", r"\frac{2}{3}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed{a_{b_{c}}}", "a_{b_{c}}"),
    (r"\fbox{x}", "x"),
    (r"\boxed{1} and \fbox{2}", "2"),
    (r"$\boxed 5$", "5"),
    (r"so \boxed 9.", "9"),
    (r"\boxed .", None),
    (r"\boxed  {7}", "7"),
    (r"\boxed{}", ""),
    ("no box here", None),
    (r"\boxed{1} then \boxed{2", None),
    (r"\boxedx{3}", None),
    (r"\boxed", None),
    (r"\boxed{\text{a \} b}}", r"\text{a \} b}"),
])
def test_extract_last_boxed(text, expected):
    assert R.extract_last_boxed(text) == expected


def test_count_boxes():
    assert R.count_boxes("none") == 0
    assert R.count_boxes(r"\boxed{1} \fbox{2} \boxed 3") == 3
    assert R.count_boxes(r"\boxedx{1}") == 0


# --- reward functions, overlong penalty -----------------------------------------------------


def _overlong_reference(length, max_len, buffer_len, factor):
    if length <= max_len - buffer_len:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer_len) - length) / buffer_len * factor
    return -factor


def test_overlong_penalty_matches_piecewise_definition():
    lengths = np.arange(0, 140)
    got = R.overlong_penalty(lengths, max_len=100, buffer_len=20, factor=0.5)
    want = [_overlong_reference(int(n), 100, 20, 0.5) for n in lengths]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert got[80] == 0.0 and got[90] == pytest.approx(-0.25) and got[100] == pytest.approx(-0.5)
    with pytest.raises(ValueError):
        R.overlong_penalty(lengths, max_len=10, buffer_len=20)


def test_reward_registry():
    acc = np.array([1, 0, 0, 1], np.float32)
    boxes = np.array([1, 1, 0, 2], np.int32)
    np.testing.assert_array_equal(R.get_reward_fn("math")(acc, boxes), [1, 0, 0, 1])
    np.testing.assert_array_equal(R.get_reward_fn("math_pm1")(acc, boxes), [1, -1, -1, 1])
    np.testing.assert_array_equal(R.get_reward_fn("math_format")(acc, boxes), [1, 0, -1, 1])
    np.testing.assert_allclose(
        R.get_reward_fn("math_format")(acc, boxes, one_box_bonus=0.1, no_box_penalty=0.5),
        [1.1, 0.1, -0.5, 1.0], rtol=1e-6)
    with pytest.raises(ValueError, match="unknown reward.name"):
        R.get_reward_fn("nope")


def test_score_with_overlong_penalty_and_info(scorer):
    responses = [r"\boxed{4}", r"\boxed{5}", "no answer", r"\boxed{4}"]
    golds = ["4", "4", "4", 4]  # a non-string gold is str()-ed
    lengths = [10, 95, 100, 120]
    scorer_ol = R.RewardScorer("math", max_response_len=100, overlong_buffer_len=20,
                               overlong_penalty_factor=1.0, pool=scorer.pool)
    rewards, info = scorer_ol.score(responses, golds, response_lengths=lengths,
                                    truncated=[False, False, True, True])
    acc = np.array([1, 0, 0, 1], np.float32)
    pen = np.array([_overlong_reference(n, 100, 20, 1.0) for n in lengths], np.float32)
    np.testing.assert_allclose(rewards, acc + pen, atol=1e-6)
    np.testing.assert_array_equal(info["accuracy"], acc)
    np.testing.assert_array_equal(info["num_boxes"], [1, 1, 0, 1])
    assert info["num_no_box"] == 1 and info["num_truncated"] == 2
    assert info["num_timeouts"] == 0 and info["num_errors"] == 0
    with pytest.raises(ValueError, match="response_lengths"):
        scorer_ol.score(responses, golds)
    with pytest.raises(ValueError, match="golds"):
        scorer.score(responses, golds[:2])
    with pytest.raises(ValueError, match="sandbox"):  # a code scorer cannot share a math pool
        R.RewardScorer("code", pool=scorer.pool)
    scorer_ol.close()  # does not own the shared pool
    assert scorer.score([r"\boxed{1}"], ["1.0"])[0].tolist() == [1.0]


def test_huge_answer_scores_zero_without_verification(scorer):
    huge = "+".join(["1"] * 2000)
    rewards, info = scorer.score([rf"\boxed{{{huge}}}", r"\boxed{2}"], ["2000", "2"])
    np.testing.assert_array_equal(rewards, [0, 1])
    assert info["num_answer_too_long"] == 1 and info["num_timeouts"] == 0


def test_scorer_config_errors():
    with pytest.raises(ValueError, match="max_response_len"):
        R.RewardScorer("math", overlong_buffer_len=10)
    with pytest.raises(ValueError, match="unknown reward.name"):
        R.RewardScorer("no_such_reward")


# --- robustness: timeouts, crashes, threads, throughput -------------------------------------


def test_pathological_answer_times_out_and_pool_recovers(scorer):
    responses = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\frac{2}{4}}", r"\boxed{7}", r"\boxed{8}"]
    golds = ["1", "0.5", "7", "7"]
    rewards, info = scorer.score(responses, golds)
    np.testing.assert_array_equal(rewards, [0, 1, 1, 0])
    assert info["timed_out"].tolist() == [True, False, False, False]
    assert info["num_timeouts"] == 1


HOSTILE = r"\boxed{9^{9^{9^{9}}}}"  # sympy evaluates the tower in C: only a timeout stops it


def test_timeout_is_not_cached_as_a_verdict(scorer):
    # A timeout says nothing about the answer (the host may have been busy): the next batch
    # checks it again, where a real verdict would come from the cache.
    before = scorer.pool.stats["timeouts"]
    _, info = scorer.score([HOSTILE, r"\boxed{3}"], ["12", "4"])
    assert info["timed_out"].tolist() == [True, False]
    assert scorer.pool.stats["timeouts"] == before + 1
    rewards, info = scorer.score([HOSTILE, r"\boxed{3}"], ["12", "4"])
    np.testing.assert_array_equal(rewards, [0, 0])
    assert info["timed_out"].tolist() == [True, False]
    assert info["cache_hits"] == 1  # only the real verdict (3 vs 4)
    assert scorer.pool.stats["timeouts"] == before + 2


def test_hostile_answer_costs_one_timeout_per_batch(scorer):
    # The same hostile answer against six different golds (six prompts): one timeout, the other
    # five are reported as timeouts without being run again.
    golds = ["11", "12", "13", "14", "15", "16"]
    before = scorer.pool.stats["timeouts"]
    rewards, info = scorer.score([HOSTILE] * 6 + [r"\boxed{2}"], golds + ["2"])
    np.testing.assert_array_equal(rewards, [0] * 6 + [1])
    assert info["num_timeouts"] == 6
    assert scorer.pool.stats["timeouts"] == before + 1  # run (and timed out) once, not six times


# A plain script, as a user writes one: no `if __name__ == "__main__":` guard, a thread.
PLAIN_SCRIPT = '''
import threading
from delta_jax.rl.rewards import RewardScorer, math_reward
print("one-off", math_reward(r"\\boxed{\\frac{1}{2}}", "0.5"))
with RewardScorer("math", num_workers=1) as scorer:
    print("batch", scorer.score([r"\\boxed{1}", r"\\boxed{2}"], ["1", "3"])[0].tolist())
out = {}
thread = threading.Thread(target=lambda: out.update(r=math_reward(r"\\boxed{3}", "3")))
thread.start()
thread.join()
print("thread", out["r"])
'''


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_rewards_from_a_plain_script(tmp_path, how):
    script = tmp_path / "score.py"
    script.write_text(PLAIN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=python_path())
    if how == "file":
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=180)
    else:
        proc = subprocess.run([sys.executable, "-"], input=PLAIN_SCRIPT, capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["one-off 1.0", "batch [1.0, 0.0]", "thread 1.0"], (
        proc.stdout, proc.stderr[-3000:])


def test_pool_kills_hung_worker_and_recovers():
    # time.sleep blocks in C, where no in-process signal handler could stop it quickly.
    with vp.VerifyPool("time:sleep", num_workers=1, timeout_s=1.0) as pool:
        out = pool.map([(0,), (60,), (0,), (0,)])
        assert [o.status for o in out] == ["ok", "timeout", "ok", "ok"]
        assert pool.stats["restarts"] == 1
        assert [o.status for o in pool.map([(0,)] * 3)] == ["ok"] * 3


def test_pool_survives_worker_crash():
    with vp.VerifyPool("signal:raise_signal", num_workers=2, timeout_s=10.0) as pool:
        items = [(signal.SIGCHLD,), (signal.SIGKILL,), (signal.SIGCHLD,), (signal.SIGCHLD,)]
        out = pool.map(items)
        assert [o.status for o in out] == ["ok", "error", "ok", "ok"]
        assert "crashed" in out[1].value


def test_pool_rejects_fork_and_reports_bad_fn():
    with pytest.raises(ValueError, match="fork"):
        vp.VerifyPool("time:sleep", start_method="fork")
    pool = vp.VerifyPool("no_such_module_xyz:f", num_workers=1)
    try:
        with pytest.raises(RuntimeError, match="no_such_module_xyz"):
            pool.map([(1,)])
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.map([(1,)])


def test_scoring_from_a_non_main_thread(scorer):
    results = {}

    def work():
        results["simple"] = R.math_reward(r"the answer is \boxed{\dfrac{2}{4}}", r"\frac12")
        results["wrong"] = R.math_reward(r"\boxed{3}", "4")
        results["batch"] = scorer.score([r"\boxed{x = 2}", r"\boxed{3}"], ["2", "2"])[0]

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive()
    assert results["simple"] == 1.0 and results["wrong"] == 0.0
    np.testing.assert_array_equal(results["batch"], [1, 0])


def test_math_reward_main_thread():
    assert R.math_reward(r"\boxed{10\%}", "10") == 1.0
    assert R.math_reward("no box 10", "10") == 0.0


def test_2048_responses_finish_with_expected_labels(scorer):
    # 128 prompts x 16 samples: exact, equivalent, wrong and missing answers with known labels.
    rng = np.random.default_rng(0)
    responses, golds, labels = [], [], []
    for p in range(128):
        gold = str(int(rng.integers(-500, 500))) if p % 2 else rf"\frac{{{p + 1}}}{{{p + 2}}}"
        value = int(gold) if p % 2 else (p + 1) / (p + 2)
        for s in range(16):
            kind = s % 5
            if kind == 0:
                ans, ok = gold, 1
            elif kind == 1:
                ok = 1
                ans = f"x = {gold}" if p % 2 else rf"\dfrac{{{2 * (p + 1)}}}{{{2 * (p + 2)}}}"
            elif kind == 2:
                ans, ok = (f"{value}.0" if p % 2 else f"{value + 1:.6f}"), int(p % 2 == 1)
            elif kind == 3:
                ans, ok = str(int(rng.integers(1000, 2000)) + s), 0
            else:
                ans, ok = None, 0
            text = "Some reasoning. " * 50 + ("" if ans is None else rf"So $\boxed{{{ans}}}$.")
            responses.append(text)
            golds.append(gold)
            labels.append(ok)
    rewards, info = scorer.score(responses, golds)
    assert rewards.shape == (2048,) and rewards.dtype == np.float32
    np.testing.assert_array_equal(rewards, np.array(labels, np.float32))
    assert info["num_timeouts"] == 0 and info["num_errors"] == 0


# ------------------------------------------------------------------ rewards.name = "python"

USER_REWARD_FILE = '''
import time

def length_parity(response, answer):
    """1 for an even-length response, 0 otherwise; "boom" raises, "slow" overruns."""
    if response == "boom":
        raise ValueError("no reward for boom")
    if response == "slow":
        time.sleep(30)
    if response == "text":
        return "not a number"
    return float(len(response) % 2 == 0)

def verl_style(response, answer):
    return {"score": -0.5 if response != answer else 2.0, "acc": response == answer}

def mentions_problem(response, answer, problem):
    """1 when the response names the problem's first word."""
    return float(problem.split()[0] in response)

def with_kwargs(response, answer, **info):
    return float(info["problem"] == response)

class Grader:
    def __call__(self, response, answer, *, problem=None):
        return float(problem is None)

grader = Grader()

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward signature: called by keyword as verl calls it."""
    if extra_info is None:
        return {"score": -1.0, "acc": False}
    target = extra_info["targets"][extra_info["pick"]]
    right = target in solution_str and ground_truth == "x" and data_source == "zoo"
    return {"score": float(right), "acc": right}

def echo_keywords(response, answer, **kw):
    """Raises unless the keywords it gets are the comma-separated names of the response."""
    if sorted(kw) != (response.split(",") if response else []):
        raise ValueError(f"got {sorted(kw)}")
    return 1.0

def trl_batch(prompts, completions, ground_truth, **kwargs):
    """A TRL reward function in the standard form (strings): 10 x the call's size, + 1 when the
    completion is its ground truth and its prompt the problem "p<ground truth>"; "none" gets
    None, "boom" fails the call, "short" returns a reward too few, "slow" overruns."""
    if not all(isinstance(c, str) for c in completions):
        raise TypeError(f"completions are not strings: {completions[0]!r}")
    if "boom" in completions:
        raise ValueError("no rewards for boom")
    if "slow" in completions:
        time.sleep(30)
    out = [None if c == "none" else 10.0 * len(completions) + (c == g and p == "p" + g)
           for p, c, g in zip(prompts, completions, ground_truth)]
    return out[:-1] if "short" in completions else out

def trl_accuracy(completions, solution, **kwargs):
    """open-r1's accuracy reward's shape: TRL's conversational completions, the answer as
    `solution`; 1 for the solution, else a dict asking for -1 and not correct."""
    contents = [completion[0]["content"] for completion in completions]
    assert all(c[0]["role"] == "assistant" for c in completions)
    assert all(p[0] == {"role": "user", "content": "q"} for p in kwargs["prompts"])
    return [1.0 if c == s else {"reward": -1.0, "correct": False}
            for c, s in zip(contents, solution)]

def trl_echo(completions, **kwargs):
    """1 when the keywords it gets are the comma-separated names of its completion."""
    return [float(sorted(kwargs) == (c.split(",") if c else [])) for c in completions]

def trl_ids(completions, completion_ids, trainer_state):
    """The span's token ids and the run's step, as TRL gives them: ints, one list a completion,
    one TrainerState a call."""
    assert all(type(t) is int for ids in completion_ids for t in ids), completion_ids
    return [len(completions) + 10 * trainer_state.global_step + 100 * trainer_state.max_steps
            + 1000 * sum(ids) for ids in completion_ids]

def trl_one_number(completions, **kwargs):
    return 1.0

def trl_columns(completions, level, tag=None, **kwargs):
    """Reads data set columns as TRL passes them: level (required) and tag (its default when no
    record of the call has one, else None for those without); **kwargs holds no column named."""
    assert "level" not in kwargs and "tag" not in kwargs, sorted(kwargs)
    tags = tag if tag is not None else [None] * len(completions)
    return [lv + (10 if t is not None else 0) + (1000 if tag is None else 0)
            for lv, t in zip(level, tags)]

def trl_kwargs_columns(completions, **kwargs):
    """Every column the run keeps reaches **kwargs: 1 where topic is "algebra"."""
    return [float(t == "algebra") for t in kwargs["topic"]]

def plain_weighted(response, answer, weight, bonus=0):
    """A per-response reward reading columns: weight (required) and bonus (when it has one)."""
    return weight * float(response == answer) + bonus

def trl_solution(completions, solution, **kwargs):
    """1 where the completion is the solution= it gets."""
    return [float(c == s) for c, s in zip(completions, solution)]

def trl_format(completions, **kwargs):
    """A format reward: 1 for a completion that starts with "<think>"; "boom" fails the call."""
    if "boom" in completions:
        raise ValueError("no format for boom")
    return [float(c.startswith("<think>")) for c in completions]
'''


@pytest.fixture(scope="module")
def user_reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_reward") / "my_reward.py"
    path.write_text(USER_REWARD_FILE)
    return path


@pytest.mark.parametrize("value, want", [
    (1, (1.0, 1.0)), (0.0, (0.0, 0.0)), (-1.0, (-1.0, 0.0)), (True, (1.0, 1.0)),
    (np.float32(0.25), (0.25, 1.0)), ({"reward": 0.0, "correct": True}, (0.0, 1.0)),
    ({"score": 3, "acc": False}, (3.0, 0.0)), ({"score": 0.5}, (0.5, 1.0))])
def test_user_reward_values_become_reward_and_correct(value, want):
    assert R.user_reward_value(value) == want


@pytest.mark.parametrize("value, why", [
    ("1", "not a number"), (None, "not a number"), (float("nan"), "non-finite"),
    ({"value": 1}, "without 'reward' or 'score'")])
def test_user_reward_values_that_are_refused(value, why):
    with pytest.raises(ValueError, match=why):
        R.user_reward_value(value)


def test_user_reward_specs_that_do_not_load_say_why(tmp_path, user_reward_file):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    for spec, why in [("my_reward.py", "is not '<file.py>:<function>'"),
                      (f"{tmp_path}/none.py:f", "no such file"),
                      (f"{broken}:f", "does not import: SyntaxError"),
                      (f"{user_reward_file}:missing", "has no function 'missing'"),
                      ("no_such_module_xyz:f", "module 'no_such_module_xyz' does not import")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            R.load_user_reward(spec)
    with pytest.raises(R.InputError, match="^rewards.python_fn: .*no such file"):
        R.RewardScorer("python", num_workers=1, python_fn=f"{tmp_path}/none.py:f")


def test_a_user_reward_scores_in_the_workers_with_overlong_shaping(user_reward_file, caplog,
                                                                    monkeypatch):
    """Its rewards and correctness per response; a raise, a wrong type and an overrun score 0 and
    are counted (the first error logged); DAPO's overlong penalty adds to the rewards; a relative
    file path is resolved where the scorer starts."""
    monkeypatch.chdir(user_reward_file.parent)
    responses = ["ab", "abc", "boom", "text", "slow", "abcd"]
    with caplog.at_level(logging.WARNING, logger="delta_jax.rewards"), R.RewardScorer(
            "python", num_workers=2, timeout_s=3.0, python_fn="my_reward.py:length_parity",
            max_response_len=10, overlong_buffer_len=4) as scorer:
        assert scorer.python_fn == f"{user_reward_file}:length_parity"
        lengths = np.array([1, 2, 3, 4, 5, 9])  # the last is 3 tokens into the 4-token buffer
        rewards, info = scorer.score(responses, ["x"] * 6, lengths)
    np.testing.assert_allclose(rewards, [1, 0, 0, 0, 0, 1 - 0.75])
    np.testing.assert_array_equal(info["accuracy"], [1, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(info["errored"], [0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(info["timed_out"], [0, 0, 0, 0, 1, 0])
    assert info["num_errors"] == 2 and info["num_timeouts"] == 1 and info["num_no_box"] == 0
    warning = [r.getMessage() for r in caplog.records if "python_fn" in r.getMessage()]
    assert warning and "2 of 6 responses scored 0 on an error" in warning[0]
    assert "ValueError: no reward for boom" in warning[0]


def test_a_user_reward_returning_a_verl_style_dict(user_reward_file):
    with R.RewardScorer("python", num_workers=1,
                        python_fn=f"{user_reward_file}:verl_style") as scorer:
        rewards, info = scorer.score(["4", "5"], ["4", "4"])
    np.testing.assert_allclose(rewards, [2.0, -0.5])
    np.testing.assert_array_equal(info["accuracy"], [1, 0])


@pytest.mark.parametrize("fn, verl, takes", [
    (lambda response, answer: 0, False, ()),
    (lambda response, answer, problem: 0, False, ("problem",)),
    (lambda response, answer, *, problem=None: 0, False, ("problem",)),
    (lambda r, a, **kw: 0, False, ("problem", "data_source", "extra_info")),
    (lambda r, a, extra_info=None: 0, False, ("extra_info",)),
    (lambda r, a, *, extra_info, problem: 0, False, ("problem", "extra_info")),
    (lambda data_source, solution_str, ground_truth, extra_info=None: 0, True,
     ("data_source", "extra_info")),
    (lambda solution_str, ground_truth, **kw: 0, True, ("problem", "data_source", "extra_info")),
    (lambda solution_str, answer: 0, False, ()),
    (lambda r, a, *problem: 0, False, ()), (len, False, ())])
def test_user_reward_call_reads_the_signature(fn, verl, takes):
    assert R.user_reward_call(fn) == R.UserRewardCall(  # **kw: every keyword, every column
        verl, takes, all_columns=takes == R.USER_REWARD_KEYWORDS)


@pytest.mark.parametrize("fn, call", [
    (lambda r, a, level, tag=None: 0, R.UserRewardCall(False, (), False, ("level", "tag"),
                                                       ("level",))),
    (lambda r, a, *, problem, level: 0, R.UserRewardCall(False, ("problem",), False, ("level",),
                                                         ("level",))),
    (lambda problem, /, r, a: 0, R.UserRewardCall(False, (), False, ("a",), ("a",))),
    (lambda extra_info, /, r, a=1: 0, R.UserRewardCall(False, (), False, ("a",), ())),
    (lambda data_source, solution_str, ground_truth, difficulty=1: 0,
     R.UserRewardCall(True, ("data_source",), False, ("difficulty",), ())),
    (lambda completions, level, tag=None, **kw: 0,
     R.UserRewardCall(False, R.TRL_REWARD_KEYWORDS, True, ("level", "tag"), ("level",), True)),
    (lambda prompts, completions, completion_mask: 0,
     R.UserRewardCall(False, ("prompts",), True, ("completion_mask",), ("completion_mask",))),
    (lambda completions, *, response, label=0: 0,
     R.UserRewardCall(False, (), True, ("response", "label"), ("response",))),
    (lambda completions, solution_str=None, ground_truth=None: 0,
     R.UserRewardCall(False, ("ground_truth",), True, ("solution_str",), ()))])
def test_a_reward_s_other_parameters_are_data_set_columns(fn, call):
    """The parameters a call does not fill (completions, verl's two, a plain call's first two
    positional ones) and that are none of its keywords are data set columns, required without
    a default; reward_columns joins several functions' and python_columns (required)."""
    assert R.user_reward_call(fn) == call
    calls = [R.user_reward_call(lambda r, a, level=0, tag=None: 0),
             R.user_reward_call(lambda completions, tag: 0)]
    assert R.reward_columns(calls) == {"level": False, "tag": True}
    assert R.reward_columns(calls, ("topic", "level")) == {"level": True, "tag": True,
                                                          "topic": True}
    assert R.user_reward_columns(" topic, level ,") == ("topic", "level")
    assert R.user_reward_columns("") == ()
    with pytest.raises(ValueError, match="not column names"):
        R.user_reward_columns("topic,2x")


@pytest.mark.parametrize("fn, takes", [
    (lambda completions, **kwargs: 0, R.TRL_REWARD_KEYWORDS),
    (lambda prompts, completions, **kwargs: 0, R.TRL_REWARD_KEYWORDS),
    (lambda completions, solution: 0, ("solution",)),
    (lambda prompts, completions, ground_truth, completion_ids=None: 0,
     ("prompts", "completion_ids", "ground_truth")),
    (lambda completions, *, extra_info, answer, trainer_state=None: 0,
     ("answer", "extra_info", "trainer_state")),
    (lambda completions, trainer_state, completion_ids: 0, ("completion_ids", "trainer_state")),
    (lambda completions, ground_truth=None: 0, ("ground_truth",))])
def test_a_reward_taking_completions_is_a_trl_batch_reward(fn, takes):
    assert R.user_reward_call(fn) == R.UserRewardCall(  # **kwargs: every keyword and column
        False, takes, batch=True, all_columns=takes == R.TRL_REWARD_KEYWORDS)


@pytest.mark.parametrize("fn, unsent", [
    (lambda x, /, completions: 0, "x"),
    (lambda x, y=0, /, *, completions, **kw: 0, "x, y")])
def test_a_batch_reward_with_parameters_that_get_nothing_is_refused(fn, unsent):
    """A batch reward with positional-only parameters (called by keyword, they would get
    nothing) stops the start naming them."""
    with pytest.raises(ValueError, match=f"parameter\\(s\\) {unsent} would get nothing"):
        R.user_reward_call(fn)


def test_a_python_fn_gets_the_data_set_columns_it_names(user_reward_file):
    """score()'s columns= (each record's JSON text of {name: value}) reach a function by the
    names its parameters give: a batch call a span's list, None for a record without it, and
    nothing (the default) when no record of the span has it; a per-response call its record's
    value where it has one; **kwargs every column the scorer keeps (python_fn's and
    python_columns); scorer.columns says which, required when a function has no default."""
    f = str(user_reward_file)
    rows = [{"level": 1, "tag": "a"}, {"level": 2}, {"level": 3}, {"level": 4, "tag": "b"},
            {"level": 5}]
    texts = [json.dumps(r) for r in rows]
    with R.RewardScorer("python", num_workers=2, python_batch_size=2,
                        python_fn=f"{f}:trl_columns") as scorer:
        assert scorer.columns == {"level": True, "tag": False}
        rewards, info = scorer.score(list("abcde"), ["x"] * 5, columns=texts)
        assert info["num_errors"] == 0
        # spans [0, 1], [2, 3], [4]: the last has no tag, so tag= is not sent (1000)
        np.testing.assert_array_equal(rewards, [11, 2, 3, 14, 1005])
        _, info = scorer.score(list("ab"), ["x"] * 2)  # no columns given: level= is missing
        assert info["num_errors"] == 2
        with pytest.raises(ValueError, match="2 responses but 1 columns"):
            scorer.score(list("ab"), ["x"] * 2, columns=texts[:1])
    with R.RewardScorer("python", num_workers=1, python_fn=f"{f}:plain_weighted") as scorer:
        assert scorer.columns == {"weight": True, "bonus": False}
        rewards, info = scorer.score(["x", "y", "x"], ["x"] * 3, columns=[
            '{"weight": 2}', '{"weight": 3, "bonus": 0.5}', '{"weight": 4, "bonus": 1}'])
        np.testing.assert_allclose(rewards, [2, 0.5, 5])
    with R.RewardScorer("python", num_workers=1, python_batch_size=3, python_columns="topic",
                        python_fn=f"{f}:trl_kwargs_columns,{f}:trl_columns") as scorer:
        assert scorer.columns == {"level": True, "tag": False, "topic": True}
        rewards, info = scorer.score(list("abc"), ["x"] * 3, columns=[
            '{"topic": "algebra", "level": 0}', '{"topic": "geometry", "level": 0}',
            '{"topic": "algebra", "level": 0}'])
        assert info["num_errors"] == 0
        np.testing.assert_array_equal(info[R.REWARD_FNS_KEY]["trl_kwargs_columns"], [1, 0, 1])
    with pytest.raises(InputError, match="rewards.python_columns: .* not column names"):
        R.RewardScorer("python", num_workers=1, python_fn=f"{f}:trl_one_number",
                       python_columns="a-b")


def test_a_batch_reward_s_solution_is_the_record_s_own(user_reward_file):
    """solution= is a record's own solution where score() is given one (TRL passes the data
    set's "solution" column), else the gold answer; answer= stays the gold answer."""
    with R.RewardScorer("python", num_workers=1, python_batch_size=4,
                        python_fn=f"{user_reward_file}:trl_solution") as scorer:
        responses = ["worked \\boxed{4}", "4", "4", "5"]
        rewards, _ = scorer.score(responses, ["4"] * 4,
                                  solutions=["worked \\boxed{4}", "", "worked", ""])
        np.testing.assert_array_equal(rewards, [1, 1, 0, 0])
        rewards, _ = scorer.score(responses, ["4"] * 4)
        np.testing.assert_array_equal(rewards, [0, 1, 1, 0])


def test_a_trl_batch_reward_scores_spans_of_responses_in_the_workers(user_reward_file, caplog):
    """A TRL-style reward is called once a python_batch_size span of responses, by keyword, with
    the spans' completions (strings), prompts (the problems) and answers: its rewards land on
    their responses; None scores 0; a call that raises, returns a reward too few or overruns
    scores its whole span 0, counted (the first error logged); a short last span."""
    problems = [f"p{i}" for i in range(7)]
    golds = [str(i) for i in range(7)]
    with R.RewardScorer("python", num_workers=2, timeout_s=3.0, python_batch_size=3,
                        python_fn=f"{user_reward_file}:trl_batch") as scorer:
        assert scorer.user_calls[0].batch and scorer.pool.fn == R._USER_FN
        responses = ["0", "x", "2", "3", "none", "5", "6"]
        rewards, info = scorer.score(responses, golds, problems=problems)
        np.testing.assert_array_equal(rewards, [31, 30, 31, 31, 0, 31, 11])
        np.testing.assert_array_equal(info["accuracy"], [1, 1, 1, 1, 0, 1, 1])
        assert info["num_errors"] == info["num_timeouts"] == info["num_no_box"] == 0
        wrong = ["0", "x", "2", "3", "9", "5", "6"]
        rewards, _ = scorer.score(wrong, golds, problems=["q"] + problems[1:])
        np.testing.assert_array_equal(rewards, [30, 30, 31, 31, 30, 31, 11])
        with caplog.at_level(logging.WARNING, logger="delta_jax.rewards"):
            rewards, info = scorer.score(["0", "boom", "2", "3", "short", "5", "slow"], golds,
                                         problems=problems)
        np.testing.assert_array_equal(rewards, [0] * 7)
        np.testing.assert_array_equal(info["errored"], [1] * 6 + [0])
        np.testing.assert_array_equal(info["timed_out"], [0] * 6 + [1])
        warning = [r.getMessage() for r in caplog.records if "python_fn" in r.getMessage()]
        assert "6 of 7 responses scored 0 on an error; the first: " in warning[0]
        assert "ValueError: no rewards for boom" in warning[0]
        _, info = scorer.score(responses, golds)  # no problems: no prompts= for its parameter
        assert info["num_errors"] == 7
    with R.RewardScorer("python", num_workers=1, python_batch_size=3,
                        python_fn=f"{user_reward_file}:trl_one_number") as scorer:
        _, info = scorer.score(["a", "b"], ["a", "b"])
        assert info["num_errors"] == 2


def test_a_trl_batch_reward_gets_completion_ids_and_trainer_state(user_reward_file):
    """completion_ids= is each response's token ids, sliced with its span (numpy ids become
    ints), and trainer_state= the one TrainerState score() is given, whole in every call; a
    reward that needs them scores 0 (an error, counted) when score() is given neither."""
    ids = [[1], [2, 3], np.array([4, 5, 6]), [], [7]]
    state = R.TrainerState(global_step=3, max_steps=8)
    with R.RewardScorer("python", num_workers=2, python_batch_size=2,
                        python_fn=f"{user_reward_file}:trl_ids") as scorer:
        assert scorer.user_calls[0].keywords == ("completion_ids", "trainer_state")
        rewards, info = scorer.score(list("abcde"), ["x"] * 5, response_ids=ids,
                                     trainer_state=state)
        assert info["num_errors"] == 0
        span = np.array([2, 2, 2, 2, 1])  # spans of 2: the last holds one completion
        np.testing.assert_array_equal(rewards, span + 830 + 1000 * np.array([1, 5, 15, 0, 7]))
        with pytest.raises(ValueError, match="5 responses but 4 response_ids"):
            scorer.score(list("abcde"), ["x"] * 5, response_ids=ids[:4], trainer_state=state)
        _, info = scorer.score(list("abcde"), ["x"] * 5)
        assert info["num_errors"] == 5
    single = R.score_across_processes  # one process: its score() gets both as they are
    got = {}
    single(lambda *a, **kw: got.update(kw) or (np.zeros(1), {}), ["a"], ["x"],
           response_ids=[[9]], trainer_state=state)
    assert got["response_ids"] == [[9]] and got["trainer_state"] is state


def test_a_trl_batch_reward_in_the_conversational_form(user_reward_file):
    """completion_format="messages": completions as [{"role": "assistant", "content": text}] and
    prompts as [{"role": "user", "content": problem}] (TRL's conversational form), the answer as
    `solution`; a dict reward gives its own correctness."""
    with R.RewardScorer("python", num_workers=2, python_batch_size=2,
                        completion_format="messages",
                        python_fn=f"{user_reward_file}:trl_accuracy") as scorer:
        rewards, info = scorer.score(["a", "b", "c"], ["a", "x", "c"], problems=["q"] * 3)
        assert info["num_errors"] == 0
        np.testing.assert_array_equal(rewards, [1, -1, 1])
        np.testing.assert_array_equal(info["accuracy"], [1, 0, 1])
    with R.RewardScorer("python", num_workers=1, completion_format="text",
                        python_fn=f"{user_reward_file}:trl_accuracy") as scorer:
        _, info = scorer.score(["a"], ["a"], problems=["q"])
        assert info["num_errors"] == 1  # strings where it reads messages
    for bad, why in (({"completion_format": "chat"}, "completion_format must be one of"),
                     ({"python_batch_size": 0}, "python_batch_size must be an int >= 1")):
        with pytest.raises(ValueError, match=why):
            R.RewardScorer("python", python_fn=f"{user_reward_file}:trl_accuracy", **bad)


def test_a_trl_batch_reward_gets_every_keyword_given_for_kwargs(user_reward_file):
    """**kwargs gets prompts, the three answer names and the context score() was given."""
    with R.RewardScorer("python", num_workers=1,
                        python_fn=f"{user_reward_file}:trl_echo") as scorer:
        every = ",".join(sorted(R.TRL_REWARD_KEYWORDS))
        rewards, _ = scorer.score([every], ["x"], problems=["p"], data_sources=["s"],
                                  extra_infos=[""], response_ids=[[3]],
                                  trainer_state=R.TrainerState(0, 1))
        assert rewards.tolist() == [1]
        rewards, _ = scorer.score(["answer,ground_truth,solution", every], ["x", "y"])
        assert rewards.tolist() == [1, 0]


def test_several_reward_functions_are_summed_with_their_weights(user_reward_file):
    """python_fn naming several functions (TRL's reward_funcs with reward_weights), of every
    call kind: a response's reward is the weighted sum of theirs, its correctness the first
    function's, each function's unweighted rewards are in info["reward_fns"] under its name
    (the same name twice made unique); a failed call of any of them fails its responses (0 from
    each, counted)."""
    f = str(user_reward_file)
    fns = f"{f}:verl_style, {f}:trl_format,{f}:length_parity,{f}:trl_format"
    with R.RewardScorer("python", num_workers=2, python_fn=fns, python_batch_size=2,
                        python_weights=[1.0, 0.5, -2.0, 0.25]) as scorer:
        assert scorer.reward_fn_names == ("verl_style", "trl_format", "length_parity",
                                          "trl_format_2")
        assert [c.kind for c in scorer.user_calls] == ["plain", "batch", "plain", "batch"]
        responses = ["<think>x", "x", "<think>", "4"]
        rewards, info = scorer.score(responses, ["<think>x", "4", "4", "4"])
        verl = np.array([2.0, -0.5, -0.5, 2.0])
        fmt = np.array([1.0, 0.0, 1.0, 0.0])
        parity = np.array([1.0, 0.0, 0.0, 0.0])  # "<think>x" has 8 characters
        np.testing.assert_allclose(rewards, verl + 0.75 * fmt - 2.0 * parity)
        np.testing.assert_array_equal(info["accuracy"], [1, 0, 0, 1])  # verl_style's "acc"
        each = info[R.REWARD_FNS_KEY]
        assert list(each) == list(scorer.reward_fn_names)
        np.testing.assert_array_equal(each["verl_style"], verl)
        np.testing.assert_array_equal(each["trl_format"], fmt)
        np.testing.assert_array_equal(each["trl_format_2"], fmt)
        np.testing.assert_array_equal(each["length_parity"], parity)
        assert info["num_errors"] == 0
        rewards, info = scorer.score(["4", "boom", "4", "4"], ["4"] * 4)
        np.testing.assert_array_equal(info["errored"], [1, 1, 0, 0])  # trl_format's first span
        np.testing.assert_allclose(rewards, [0, 0, 2.0, 2.0])
        np.testing.assert_array_equal(info["accuracy"], [0, 0, 1, 1])
        np.testing.assert_array_equal(info[R.REWARD_FNS_KEY]["verl_style"], [0, 0, 2, 2])
        np.testing.assert_array_equal(info[R.REWARD_FNS_KEY]["trl_format"], [0, 0, 0, 0])
    with R.RewardScorer("python", num_workers=1,
                        python_fn=f"{f}:verl_style") as scorer:  # one function: no reward_fns
        assert R.REWARD_FNS_KEY not in scorer.score(["4"], ["4"])[1]
    for fns, weights, why in ((f"{f}:verl_style,{f}:trl_format", [1.0],
                               "rewards.python_weights: 1 weights"),
                              (f"{f}:verl_style", [float("nan")], "one finite weight each"),
                              (f"{f}:verl_style,,{f}:trl_format", None, "names no function"),
                              (f"{f}:verl_style,{f}:missing", None, "has no function 'missing'")):
        with pytest.raises(R.InputError, match=re.escape(why)):
            R.RewardScorer("python", python_fn=fns, python_weights=weights)


def test_a_verl_reward_function_gets_each_records_data_source_and_extra_info(user_reward_file):
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) runs
    unchanged: called by keyword with the response, its answer and its record's data_source and
    extra_info (JSON text decoded; None for ""), through the worker pool; a count that does not
    match the responses is refused; without the context its call fails and is counted."""
    extra = [json.dumps({"targets": ["cat", "dog"], "pick": 1}), "",
             json.dumps({"targets": ["cat", "dog"], "pick": 0}),
             json.dumps({"targets": ["bird"], "pick": 0})]
    responses = ["a dog", "a dog", "a dog", "a bird"]
    sources = ["zoo", "zoo", "zoo", "farm"]
    with R.RewardScorer("python", num_workers=2,
                        python_fn=f"{user_reward_file}:compute_score") as scorer:
        rewards, info = scorer.score(responses, ["x"] * 4, problems=["p"] * 4,
                                     data_sources=sources, extra_infos=extra)
        np.testing.assert_array_equal(rewards, [1, -1, 0, 0])
        np.testing.assert_array_equal(info["accuracy"], [1, 0, 0, 0])
        assert info["num_errors"] == 0
        rewards, _ = scorer.score(responses[:1], ["y"], data_sources=["zoo"], extra_infos=extra[:1])
        assert rewards.tolist() == [0]  # its ground_truth is the answer given
        _, info = scorer.score(responses, ["x"] * 4)  # no data_source: it cannot be called
        assert info["num_errors"] == 4
        for name in ("data_sources", "extra_infos"):
            with pytest.raises(ValueError, match=f"4 responses but 2 {name}"):
                scorer.score(responses, ["x"] * 4, **{name: extra[:2]})


def test_a_user_reward_gets_only_the_keywords_it_takes_and_was_given(user_reward_file):
    """**kwargs gets every context keyword score() was given, none it was not."""
    with R.RewardScorer("python", num_workers=1,
                        python_fn=f"{user_reward_file}:echo_keywords") as scorer:
        _, every = scorer.score(["data_source,extra_info,problem"], ["x"], problems=["p"],
                                data_sources=[""], extra_infos=[""])
        _, one = scorer.score(["extra_info"], ["x"], extra_infos=["[1, 2]"])
        _, none = scorer.score([""], ["x"])
        _, wrong = scorer.score(["problem"], ["x"], extra_infos=["[1, 2]"])
    assert every["num_errors"] == one["num_errors"] == none["num_errors"] == 0
    assert wrong["num_errors"] == 1


def test_reward_context_repeats_each_records_fields_for_its_responses():
    records = [{"problem": "p1", "data_source": "s", "extra_info": "{}", "solution": "w",
                "columns": '{"x": 1}'}, {"problem": "p2"}]
    assert R.reward_context(records, 2) == {
        "problems": ["p1", "p1", "p2", "p2"], "data_sources": ["s", "s", "", ""],
        "extra_infos": ["{}", "{}", "", ""], "solutions": ["w", "w", "", ""],
        "columns": ['{"x": 1}', '{"x": 1}', "", ""]}


def test_a_slow_importing_user_reward_loads_before_the_workers_take_work(tmp_path):
    """A reward module whose import takes longer than rewards.timeout_s (a heavy library) is
    loaded by each worker before it is ready (VerifyPool's initializer with its argument), so
    the first responses do not time out on the import."""
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(1.5)\n\ndef f(response, answer):\n"
                    "    return float(response == answer)\n")
    with R.RewardScorer("python", num_workers=2, timeout_s=1.0,
                        python_fn=f"{path}:f") as scorer:
        rewards, info = scorer.score(["1", "2", "3", "4"], ["1", "0", "3", "0"])
    assert info["num_timeouts"] == 0 and info["num_errors"] == 0
    np.testing.assert_array_equal(rewards, [1, 0, 1, 0])
