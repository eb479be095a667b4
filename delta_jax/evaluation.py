"""Evaluation: avg@k and unbiased pass@k over math and code benchmarks.

The policy is anything with `generate_fn(prompts: list[str], n: int) -> list[list[str]]` (n
response texts per prompt): `sampler_generate_fn` wraps a delta_jax Sampler with the paper's eval
settings (T = 1.0, top-p = 0.7, k = 16 samples); tests use fake policies.

    rows = load_benchmark("data/aime24.jsonl")            # [{"id", "problem", "answer"}, ...]
    result = evaluate(generate_fn, {"aime24": path, "amc23": rows}, k=16)
    print(result.to_markdown()); result.save(workdir)     # eval.json + eval.md

Code benchmarks (HumanEval, e.g. ../shared/data/humaneval.jsonl; MBPP / TACO / CodeContests
layouts; see data/records.py) are recognised by their rows and scored by RewardScorer("code"):
unit tests in the sandbox, pass@k over the k programs per problem.

Per benchmark: avg@k (mean accuracy over all k samples of all questions), pass@k' for each k'
in pass_ks (Chen et al. 2021's unbiased estimator from the k samples) and, for math benchmarks,
maj@k' for each k' in maj_ks (majority voting, also called cons@k': the accuracy of the answer
most of k' samples give; maj_at_k). The summary row is the question-count-weighted average over
benchmarks, as the paper reports.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import pathlib
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from delta_jax.data.templates import BOXED_INSTRUCTION, CODE_INSTRUCTION
from delta_jax.errors import InputError, MissingInputError
from delta_jax.stats import t_interval

# The paper's evaluation sampling (k samples per question at these settings).
EVAL_TEMPERATURE = 1.0
EVAL_TOP_P = 0.7
EVAL_K = 16

# generate_fn(prompts, n) -> texts[i][j], or an object with .texts and, for the response-length
# metrics, .response_lengths[i][j] (tokens) and .truncated[i][j], and for a batch reward's
# completion_ids=, .response_ids[i][j] (token ids) (a sampling.GenerationOutput).
GenerateFn = Callable[[list, int], Any]


def default_format_prompt(problem: str) -> str:
    """The problem followed by the usual "...put your final answer within \\boxed{}." line."""
    return f"{problem}\n{BOXED_INSTRUCTION}"


# ---------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------


def pass_at_k(n, c, k: int):
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), per question.

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the huge binomials.
    Args:
      n: samples per question (int or int array [Q]); c: correct samples (same shape); k <= n.
    Returns:
      float64 (scalar or [Q]).
    """
    n_arr = np.asarray(n, np.int64)
    c_arr = np.asarray(c, np.int64)
    n_arr, c_arr = np.broadcast_arrays(n_arr, c_arr)
    if k < 1 or np.any(k > n_arr):
        raise ValueError(f"pass@k needs 1 <= k <= n; got k={k}, n={np.unique(n_arr).tolist()}")
    if np.any(c_arr < 0) or np.any(c_arr > n_arr):
        raise ValueError("pass@k needs 0 <= c <= n")
    out = np.ones(n_arr.shape, np.float64)
    flat_n, flat_c, flat_out = n_arr.reshape(-1), c_arr.reshape(-1), out.reshape(-1)
    for q in range(flat_n.size):
        nq, cq = int(flat_n[q]), int(flat_c[q])
        if nq - cq >= k:  # else every k-subset holds a correct sample: pass@k = 1
            i = np.arange(nq - cq + 1, nq + 1, dtype=np.float64)
            flat_out[q] = 1.0 - np.prod(1.0 - k / i)
    return out if out.ndim else float(out)


def maj_at_k(votes: Sequence[Sequence[str | None]], correct, k: int) -> np.ndarray:
    """Majority-vote accuracy (maj@k, cons@k) per question: of k samples, the answer most of
    them give, right or wrong.

    The n samples of a question are split into n // k consecutive groups of k (the samples are
    drawn independently, so each group is a draw of k; with k = n, the one group of all); in a
    group the answer given most often wins, a tie going to the one given first, and the group
    scores that answer's verdict (the correct value of the first sample giving it). Samples
    without an answer (None) do not vote; a group with no answer scores 0. Votes compare as
    strings (rl.rewards.final_answer: the normalised boxed answer), as lighteval's and verl's
    maj@k do: two forms of one value ("0.5", "\\frac{1}{2}") are two answers. maj@1 is avg@n.

    Args:
      votes: [Q][n] each sample's answer (a hashable; None = none). correct: [Q, n] verdicts (1 =
        right). k: 1 <= k <= n.
    Returns:
      float64 [Q]: each question's mean over its groups.
    """
    correct = np.asarray(correct, np.float64)
    if correct.ndim != 2:
        raise ValueError(f"maj@k needs correct of shape [questions, samples], got "
                         f"{correct.shape}")
    num_q, n = correct.shape
    if len(votes) != num_q or any(len(v) != n for v in votes):
        raise ValueError(f"maj@k needs votes of shape [{num_q}][{n}] as correct")
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n; got k={k}, n={n}")
    groups = n // k
    out = np.zeros(num_q, np.float64)
    for q in range(num_q):
        for g in range(groups):
            counts: dict = {}
            first: dict = {}
            for j in range(g * k, (g + 1) * k):
                vote = votes[q][j]
                if vote is not None:
                    counts[vote] = counts.get(vote, 0) + 1
                    first.setdefault(vote, j)
            if counts:
                winner = max(counts, key=lambda v: (counts[v], -first[v]))
                out[q] += correct[q, first[winner]]
        out[q] /= groups
    return out


# ---------------------------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------------------------


def load_benchmark(path: str | os.PathLike, limit: int | None = None,
                   columns: Mapping[str, Mapping[str, bool]] | None = None) -> list[BenchmarkRow]:
    """BenchmarkRows (the first `limit`) from a JSONL, JSON-array or parquet file in any layout
    data/records.py reads (its rows, records.iter_rows): the project's {"problem", "answer"},
    DeepMath, DAPO / verl's parquet, MATH, and the code layouts (_checked_row). columns: {kind:
    {column: required}}, the data set columns a row of that kind keeps for its reward
    (records.columns_text; a row without a required one is an InputError)."""
    from delta_jax.data import records

    path = pathlib.Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path}: no such benchmark file")
    rows = []
    for where, row in records.iter_rows(str(path)):
        if limit is not None and len(rows) >= limit:
            break
        if isinstance(row, Exception):  # a line that is not a JSON object
            raise InputError(f"{where}: {row}") from None
        rows.append(_check_row(row, where, len(rows), columns))
    if not rows:
        raise InputError(f"{path}: the benchmark file has no rows")
    benchmark_kind(str(path), rows)
    return rows


def benchmark_kind(name: str, rows: Sequence[Mapping]) -> str:
    """"math" or "code": the kind of every row of a benchmark (a mix is an InputError)."""
    kinds = {r["kind"] for r in rows}
    if len(kinds) > 1:
        raise InputError(f"{name}: mixes math and code rows; split it in two benchmarks")
    return kinds.pop()


def default_code_prompt(problem: str) -> str:
    """The problem followed by the code instruction (one ```python block)."""
    return f"{problem}\n{CODE_INSTRUCTION}"


def _spec_row(row: Mapping, index: int) -> dict | None:
    """The project's layout of a code row, {"problem", "answer": a unit-test spec (JSON text or
    object)}, as {"id", "problem", "answer": spec JSON, "kind": "code"}; None otherwise."""
    from delta_jax.rl import sandbox

    answer = row.get("answer")
    if "problem" not in row or not isinstance(answer, (str, Mapping)):
        return None
    if isinstance(answer, str) and not answer.lstrip().startswith("{"):
        return None
    if not sandbox.is_spec(answer):
        return None
    spec = answer if isinstance(answer, str) else json.dumps(answer, sort_keys=True)
    return {"id": str(row.get("id", index)), "problem": row["problem"], "answer": spec,
            "kind": "code"}


class BenchmarkRow(dict):
    """A checked benchmark row, {"id", "problem", "answer", "solution", "kind", "data_source",
    "extra_info", "columns"} (the solution "" where the row has none; the last three, for a
    python_fn: the row's own values of those names as text, records.CONTEXT_FIELDS, and its
    columns the reward takes by name, records.COLUMNS): what load_benchmark returns, which
    evaluate() then takes as it is (checking it again would encode its texts a second time)."""


def _check_row(row: Any, where: str, index: int,
               columns: Mapping[str, Mapping[str, bool]] | None = None) -> BenchmarkRow:
    """The BenchmarkRow of a row; columns: as load_benchmark's."""
    from delta_jax.data import records

    if isinstance(row, BenchmarkRow):
        return row
    if not isinstance(row, Mapping):
        raise InputError(f"{where}: row must be an object, got {type(row).__name__}")
    checked = _checked_row(row, where, index)
    try:
        context = {name: as_text(row.get(name))
                   for name, as_text in records.CONTEXT_FIELDS.items()}
        context[records.COLUMNS] = records.columns_text(
            row, (columns or {}).get(checked["kind"]))
    except ValueError as e:
        raise InputError(f"{where}: {e}") from None
    return BenchmarkRow(**checked, **context)


def _checked_row(row: Mapping, where: str, index: int) -> dict:
    """{"id", "problem", "answer", "kind"} of a benchmark row: a code row of the project's layout
    (_spec_row), else the row in the layout data/records.py detects from its keys (its presets:
    math for deltajax / deepmath / dapo / math, code for the code layouts)."""
    from delta_jax.data import records

    spec = _spec_row(row, index)
    if spec is not None:
        return {**spec, "solution": ""}
    try:
        layout = records.detect_layout(row)
    except ValueError:
        missing = next(f for f in ("problem", "answer") if f not in row)
        raise InputError(f"{where}: row has no {missing!r} field, nor the keys of another layout "
                         f"data/records.py reads (keys: {sorted(row)})") from None
    try:
        rec = records.PRESETS[layout](row)
    except KeyError as e:
        raise InputError(f"{where}: {layout} row has no {e.args[0]!r} field") from None
    except (ValueError, TypeError) as e:
        raise InputError(f"{where}: {layout} row: {e}") from None
    return {"id": str(rec["id"] if rec["id"] not in (None, "") else index),
            "problem": rec["problem"], "answer": rec["answer"],
            "solution": rec.get("solution") or "",
            "kind": "code" if layout in records.CODE_PRESETS else "math"}


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BenchmarkResult:
    """One benchmark: num_correct[q] of k samples for each question q, and with maj_ks each
    question's maj@k' (maj[k'] float64 [Q], maj_at_k).

    When evaluate() made it, also what was generated (not in to_dict): prompts[q], answers[q],
    responses[q][j] (text), correct fp32 [Q, k] (1 = right) and with maj_ks votes[q][j] (each
    sample's final answer, None for none); and where the generate_fn reports them (the
    sampler's does), response_tokens int [Q, k] and truncated bool [Q, k] (cut at the token
    limit), whose means to_dict gives as response_len_mean, truncated_frac."""
    name: str
    ids: list
    num_correct: np.ndarray  # int [Q]
    k: int
    pass_ks: tuple
    num_no_box: int = 0
    num_timeouts: int = 0
    num_errors: int = 0
    prompts: list | None = None
    answers: list | None = None
    responses: list | None = None
    correct: np.ndarray | None = None
    response_tokens: np.ndarray | None = None
    truncated: np.ndarray | None = None
    maj: dict = dataclasses.field(default_factory=dict)  # {k': float64 [Q]}
    votes: list | None = None

    @property
    def num_questions(self) -> int:
        return len(self.ids)

    @property
    def avg_at_k(self) -> float:
        return float(np.mean(self.num_correct / self.k))

    @property
    def pass_at(self) -> dict:
        return {kk: float(np.mean(pass_at_k(self.k, self.num_correct, kk))) for kk in self.pass_ks}

    @property
    def maj_at(self) -> dict:
        return {kk: float(np.mean(v)) for kk, v in self.maj.items()}

    def to_dict(self) -> dict:
        return {
            "num_questions": self.num_questions,
            "k": self.k,
            f"avg@{self.k}": self.avg_at_k,
            **{f"pass@{kk}": v for kk, v in self.pass_at.items()},
            **{f"maj@{kk}": v for kk, v in self.maj_at.items()},
            "num_no_box": self.num_no_box,
            "num_timeouts": self.num_timeouts,
            "num_errors": self.num_errors,
            **({} if self.response_tokens is None else {
                "response_len_mean": float(np.mean(self.response_tokens)),
                "response_len_max": int(np.max(self.response_tokens)),
                "truncated_frac": float(np.mean(self.truncated))}),
            "per_question": [{"id": i, "num_correct": int(c),
                              **{f"maj@{kk}": float(v[q]) for kk, v in self.maj.items()}}
                             for q, (i, c) in enumerate(zip(self.ids, self.num_correct))],
        }


@dataclasses.dataclass
class EvalResult:
    """Per-benchmark results plus the question-weighted average; to_json / to_markdown / save."""
    benchmarks: dict  # name -> BenchmarkResult, in the order evaluated
    k: int
    pass_ks: tuple
    settings: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    maj_ks: tuple = ()

    def metric_names(self) -> list[str]:
        return ([f"avg@{self.k}"] + [f"pass@{kk}" for kk in self.pass_ks]
                + [f"maj@{kk}" for kk in self.maj_ks])

    def _row(self, b: BenchmarkResult) -> dict:
        return {f"avg@{self.k}": b.avg_at_k, **{f"pass@{kk}": v for kk, v in b.pass_at.items()},
                **{f"maj@{kk}": v for kk, v in b.maj_at.items()}}

    def average(self) -> dict:
        """Each metric averaged over benchmarks weighted by their question counts."""
        total = sum(b.num_questions for b in self.benchmarks.values())
        return {m: sum(self._row(b)[m] * b.num_questions for b in self.benchmarks.values()) / total
                for m in self.metric_names()}

    def to_dict(self) -> dict:
        return {
            "k": self.k,
            "pass_ks": list(self.pass_ks),
            **({"maj_ks": list(self.maj_ks)} if self.maj_ks else {}),
            "settings": self.settings,
            "seconds": self.seconds,
            "benchmarks": {name: b.to_dict() for name, b in self.benchmarks.items()},
            "average": {"num_questions": sum(b.num_questions for b in self.benchmarks.values()),
                        **self.average(), **self.lengths()},
        }

    def lengths(self) -> dict:
        """response_len_mean and truncated_frac over every sample of every benchmark, where
        the generate_fn reported the lengths ({} otherwise)."""
        parts = [b for b in self.benchmarks.values() if b.response_tokens is not None]
        if not parts or len(parts) < len(self.benchmarks):
            return {}
        return {"response_len_mean": float(np.mean(np.concatenate(
                    [b.response_tokens.ravel() for b in parts]))),
                "truncated_frac": float(np.mean(np.concatenate(
                    [b.truncated.ravel() for b in parts])))}

    def flat_metrics(self, prefix: str = "eval") -> dict:
        """Every number of to_dict() but the settings, as {"<prefix>/<path>": float}: e.g.
        "eval/benchmarks/<name>/avg@4", "eval/benchmarks/<name>/num_no_box",
        "eval/average/pass@4", "eval/seconds" (the metrics as fractions): what training logs."""
        out = {}

        def walk(path, value):
            if isinstance(value, dict):
                for key, item in value.items():
                    walk(f"{path}/{key}", item)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[path] = float(value)

        for key, value in self.to_dict().items():
            if key != "settings":
                walk(f"{prefix}/{key}", value)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_markdown(self) -> str:
        """A table in percent: one row per benchmark and a question-weighted average row."""
        metrics = self.metric_names()
        lines = ["| benchmark | questions | " + " | ".join(metrics) + " |",
                 "|---|---:|" + "---:|" * len(metrics)]
        for name, b in self.benchmarks.items():
            row = self._row(b)
            lines.append(f"| {name} | {b.num_questions} | "
                         + " | ".join(f"{100 * row[m]:.1f}" for m in metrics) + " |")
        avg = self.average()
        total = sum(b.num_questions for b in self.benchmarks.values())
        lines.append(f"| average (question-weighted) | {total} | "
                     + " | ".join(f"{100 * avg[m]:.1f}" for m in metrics) + " |")
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Running an evaluation
# ---------------------------------------------------------------------------------------------


def paired_change(before: Mapping, after: Mapping, confidence: float = 0.95) -> dict:
    """How each held-out metric moved between two evaluations of the same questions, paired by
    question: the change of the question-weighted average (the "average" row) with a Student-t
    interval of the mean per-question difference.

    before, after: EvalResult.to_dict() of two evaluations (e.g. eval/step_0.json and the last
    step's), each holding "per_question" counts. Questions are matched by (benchmark, id); only
    those in both count. Returns {metric: {"before", "after", "diff", "lo", "hi", "n"}} for avg@k
    and every pass@k' and maj@k' both evaluations report (fractions; maj@k' from the per-question
    values to_dict writes), or {} when no question is shared. The
    interval covers the variation from which questions were drawn and from the k samples per
    question; it says nothing of how another training run would land.
    """
    def per_question(result: Mapping) -> tuple[int, dict]:
        k = int(result["k"])
        out = {}
        for name, bench in result.get("benchmarks", {}).items():
            for q in bench.get("per_question", ()):
                out[(name, str(q["id"]))] = q
        return k, out

    kb, qb = per_question(before)
    ka, qa = per_question(after)
    shared = [key for key in qb if key in qa]
    if not shared:
        return {}
    cb = np.asarray([int(qb[key]["num_correct"]) for key in shared])
    ca = np.asarray([int(qa[key]["num_correct"]) for key in shared])
    metrics = {"avg": (cb / kb, ca / ka)}
    both = sorted(set(before.get("pass_ks", ())) & set(after.get("pass_ks", ())))
    for kk in both:  # each evaluation reports pass@kk only for kk <= its own k
        metrics[f"pass@{kk}"] = (pass_at_k(kb, cb, kk), pass_at_k(ka, ca, kk))
    for kk in sorted(set(before.get("maj_ks", ())) & set(after.get("maj_ks", ()))):
        metrics[f"maj@{kk}"] = tuple(np.asarray([q[key][f"maj@{kk}"] for key in shared])
                                     for q in (qb, qa))
    out = {}
    for name, (b, a) in metrics.items():
        diff, _, lo, hi = t_interval(np.asarray(a, np.float64) - np.asarray(b, np.float64),
                                     confidence)
        label = f"avg@{ka}" if name == "avg" and ka == kb else name
        out[label] = {"before": float(np.mean(b)), "after": float(np.mean(a)), "diff": diff,
                      "lo": lo, "hi": hi, "n": len(shared)}
    return out


def _generate_checked(generate_fn: GenerateFn, prompts: list[str], n: int, name: str):
    """(texts [Q][n], response tokens int [Q, n] or None, truncated bool [Q, n] or None,
    response token ids [Q * n] or None)."""
    got = generate_fn(prompts, n)
    ids = getattr(got, "response_ids", None)
    if ids is not None:
        ids = [seq for group in ids for seq in group]
    out = got.texts if hasattr(got, "texts") else got
    lengths = truncated = None
    if getattr(got, "response_lengths", None) is not None:
        lengths = np.asarray(got.response_lengths, np.int64).reshape(len(prompts), n)
        truncated = np.asarray(got.truncated, bool).reshape(len(prompts), n)
    if out is None:
        raise ValueError(f"{name}: generate_fn returned no response texts")
    if len(out) != len(prompts):
        raise ValueError(f"{name}: generate_fn returned {len(out)} groups for {len(prompts)} "
                         f"prompts")
    for i, group in enumerate(out):
        if len(group) != n:
            raise ValueError(f"{name}: generate_fn returned {len(group)} responses for prompt "
                             f"{i}, want n={n}")
        for text in group:
            if not isinstance(text, str):
                raise ValueError(f"{name}: generate_fn must return response texts (str), got "
                                 f"{type(text).__name__}")
    if ids is not None and len(ids) != len(prompts) * n:
        raise ValueError(f"{name}: generate_fn returned {len(ids)} response_ids for "
                         f"{len(prompts) * n} responses")
    return out, lengths, truncated, ids


def evaluate(generate_fn: GenerateFn, benchmarks: Mapping[str, Any], k: int = EVAL_K,
             pass_ks: Sequence[int] | None = None,
             format_prompt: Callable[[str], str] | Mapping[str, Callable[[str], str]] =
             default_format_prompt,
             scorer=None, limit: int | None = None,
             settings: Mapping[str, Any] | None = None, log: Callable[[str], None] | None = None,
             trainer_state=None, maj_ks: Sequence[int] = ()) -> EvalResult:
    """Samples k responses per question and scores them with the math (or code) reward.

    In a multi-host run every process calls it (generate_fn gives each the same responses) and
    each scores a share of them (rl.rewards.score_across_processes); all get the whole result.

    Args:
      generate_fn: prompts (list[str]) , n -> n response texts per prompt; called once per
        benchmark with all of its (limit) questions.
      benchmarks: name -> JSONL path or a list of rows: as in the file ({"id", "problem",
        "answer"[, "data_source", "extra_info"]} or a code layout) or as load_benchmark returns
        them.
      k: samples per question (avg@k is over these).
      pass_ks: k' values for pass@k' (each <= k); default 1, 2, 4, ... up to k, and k.
      format_prompt: problem -> prompt text (default: the boxed-answer instruction for math, the
        code instruction for code benchmarks), or {kind: that} per kind of benchmark ("math",
        "code"; a kind it lacks gets the default).
      scorer: a delta_jax.rl.rewards.RewardScorer to use for every benchmark (its accuracy, not
        its shaped reward), or {kind: scorer}; default (and for a kind the mapping lacks): a
        2-worker "math" or "code" scorer per kind of benchmark, created here and closed at the
        end.
      limit: first `limit` questions of each benchmark (quick runs).
      settings: recorded in the result (e.g. temperature, top_p, checkpoint step).
      log: optional callable for progress lines (e.g. logging.info).
      trainer_state: a user batch reward's trainer_state= (rl.rewards.TrainerState: the RL
        steps the evaluated policy has had), sent to a scorer's python_fn that takes it.
      maj_ks: k' values for maj@k' (each <= k; maj_at_k): the votes are the responses' final
        answers (rl.rewards.final_answer: the boxed answer the math rewards read; for a scorer
        with a python_fn, which reads its own, the majority boxed answer gets that function's
        verdict of its first response). A code benchmark with maj_ks is a ValueError: its
        programs are not answers to vote on.
    Returns:
      EvalResult.
    """
    # the pool is only needed when evaluating
    from delta_jax.rl.rewards import (RewardScorer, final_answer, reward_context,
                                      score_across_processes)

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if pass_ks is None:
        pass_ks = sorted({2 ** i for i in range(int(math.log2(k)) + 1)} | {k})
    pass_ks = tuple(int(x) for x in pass_ks)
    bad = [x for x in pass_ks if not 1 <= x <= k]
    if bad:
        raise ValueError(f"pass_ks must lie in [1, k={k}], got {bad}")
    maj_ks = tuple(int(x) for x in maj_ks)
    bad = [x for x in maj_ks if not 1 <= x <= k]
    if bad:
        raise ValueError(f"maj_ks must lie in [1, k={k}], got {bad}")
    if not benchmarks:
        raise ValueError("evaluate: no benchmarks given")

    own_scorers: dict[str, Any] = {}

    def scorer_for(kind: str):
        if isinstance(scorer, Mapping) and kind in scorer:
            return scorer[kind]
        if scorer is not None and not isinstance(scorer, Mapping):
            return scorer
        if kind not in own_scorers:
            own_scorers[kind] = RewardScorer(kind, num_workers=2)
        return own_scorers[kind]

    # {kind: the data set columns a given scorer's python_fn takes} (own scorers take none)
    given = scorer if isinstance(scorer, Mapping) else {
        kind: scorer for kind in ("math", "code")} if scorer is not None else {}
    columns = {kind: getattr(s, "columns", {}) for kind, s in given.items()}
    t0 = time.perf_counter()
    results = {}
    try:
        for name, source in benchmarks.items():
            if isinstance(source, (str, os.PathLike)):
                rows = load_benchmark(source, limit=limit, columns=columns)
            else:
                rows = [_check_row(r, f"benchmark {name!r} row {i}", i, columns)
                        for i, r in enumerate(source)][:limit]
            kind = benchmark_kind(name, rows)
            if maj_ks and kind == "code":
                raise ValueError(f"{name}: maj@k votes on final answers; a code benchmark's "
                                 "responses are programs (evaluate it without maj_ks)")
            default = default_code_prompt if kind == "code" else default_format_prompt
            if isinstance(format_prompt, Mapping):
                fmt = format_prompt.get(kind, default)
            else:
                fmt = default if format_prompt is default_format_prompt else format_prompt
            prompts = [fmt(r["problem"]) for r in rows]
            responses, response_tokens, truncated, ids = _generate_checked(
                generate_fn, prompts, k, name)
            flat = [text for group in responses for text in group]
            golds = [r["answer"] for r in rows for _ in range(k)]
            _, info = score_across_processes(scorer_for(kind).score, flat, golds,
                                             **reward_context(rows, k), response_ids=ids,
                                             trainer_state=trainer_state)
            correct = np.asarray(info["accuracy"], np.float32).reshape(len(rows), k)
            votes = [[final_answer(text) for text in group] for group in responses] \
                if maj_ks else None
            results[name] = BenchmarkResult(
                name=name, ids=[r["id"] for r in rows],
                num_correct=correct.sum(axis=1).round().astype(int), k=k,
                pass_ks=pass_ks, num_no_box=info["num_no_box"],
                num_timeouts=info["num_timeouts"], num_errors=info["num_errors"],
                prompts=prompts, answers=[r["answer"] for r in rows], responses=responses,
                correct=correct, response_tokens=response_tokens, truncated=truncated,
                maj={kk: maj_at_k(votes, correct, kk) for kk in maj_ks}, votes=votes)
            if log is not None:
                log(f"eval {name}: {len(rows)} questions, avg@{k} = "
                    f"{100 * results[name].avg_at_k:.1f}")
    finally:
        for own in own_scorers.values():
            own.close()
    return EvalResult(results, k=k, pass_ks=pass_ks, settings=dict(settings or {}),
                      seconds=time.perf_counter() - t0, maj_ks=maj_ks)


def sampler_generate_fn(sampler, temperature: float = EVAL_TEMPERATURE, top_p: float = EVAL_TOP_P,
                        top_k: int = -1, max_new_tokens: int = 4096, seed: int = 0,
                        stop_token_ids=None, seeds: Callable[[int], int] | None = None,
                        progress: Callable[[dict], None] | None = None,
                        should_stop: Callable[[], bool] | None = None) -> GenerateFn:
    """Adapts a delta_jax.sampling.Sampler (built with a tokenizer) to the generate_fn protocol.

    Call i (from 0) samples with seed `seeds(i)` when given, else `seed + i`, so repeated calls
    draw fresh samples. stop_token_ids, progress, should_stop: as Sampler.generate (default:
    the tokenizer's EOS; progress and should_stop are given to every call).
    The function's `sampler_counters` sums the calls' GenerationOutput.counters().
    """
    calls = [0]
    totals = collections.Counter()

    def generate_fn(prompts: list[str], n: int):
        call_seed = seeds(calls[0]) if seeds is not None else seed + calls[0]
        out = sampler.generate(list(prompts), n=n, temperature=temperature, top_p=top_p,
                               top_k=top_k, max_new_tokens=max_new_tokens,
                               stop_token_ids=stop_token_ids, seed=call_seed,
                               progress=progress, should_stop=should_stop)
        calls[0] += 1
        if hasattr(out, "counters"):
            totals.update(out.counters())
        if out.texts is None:
            raise ValueError("sampler_generate_fn needs a Sampler built with a tokenizer "
                             "(it returns response texts)")
        return out  # its texts, response_lengths and truncated (GenerateFn)

    generate_fn.sampler_counters = totals  # GenerationOutput.counters, summed over the calls
    return generate_fn
