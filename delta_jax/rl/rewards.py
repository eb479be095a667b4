"""Verifiable math rewards: the last \\boxed{} of a response checked against the gold answer.

    math_reward(response, gold) -> 1.0 | 0.0        simple, synchronous, any thread
    extract_last_boxed(text) -> str | None          content of the last \\boxed{} / \\fbox{}
    RewardScorer(name="math", ...).score(responses, golds, response_lengths, truncated)
        -> (rewards float32 [N], info)              batch scoring in a process pool
    score_across_processes(scorer.score, ...)       the same, each host of a multi-host run
                                                    scoring a share, all getting every reward

Correctness is decided by math-verify (`verify(parse(gold), parse(pred))`, gold first: the check
is not symmetric). math-verify's own timeouts use SIGALRM, which only works on a main thread and
cannot interrupt sympy stuck in C code, so every check runs in a `VerifyPool` worker process: a
soft SIGALRM timeout inside the worker (keeps the worker) and a hard wall-clock kill by the parent
(replaces the worker). A timeout or a crash scores 0 and is counted; it never hangs the run.

Reward functions are pluggable by name (`REWARD_FNS`, config `reward.name`), and DAPO's soft
overlong penalty can be added on top of any of them.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import re
import signal
import threading
import time
import warnings
from typing import Callable, Mapping, Sequence

import numpy as np

from delta_jax.errors import InputError
from delta_jax.rl import verify_pool as vp

# ---------------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _is_escaped(text: str, i: int) -> bool:
    """True if text[i] is preceded by an odd number of backslashes (e.g. the brace in \\{)."""
    n = 0
    while i - 1 - n >= 0 and text[i - 1 - n] == "\\":
        n += 1
    return n % 2 == 1


def _box_content(text: str, start: int) -> str | None:
    """Content of the box whose command ends at `start` (just after "\\boxed"), or None."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # Brace-less form "\boxed 5": only valid with a space after the command; the answer is
        # the next token (up to whitespace or the closing $ of the math span), without a
        # sentence-final period ("\boxed 9." is 9).
        if i == start:
            return None
        m = re.match(r"[^\s$]+", text[i:])
        return (m.group(0).rstrip(".") or None) if m else None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c in "{}" and _is_escaped(text, j):
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: a truncated or malformed box has no answer


def extract_last_boxed(text: str) -> str | None:
    """Content of the LAST \\boxed{...} / \\fbox{...} (or brace-less "\\boxed 5") in `text`.

    Braces are matched (nested and escaped braces handled). Returns None if there is no box or
    the last box is not closed (a truncated answer is no answer; earlier boxes are not used).
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_last_boxed expects str, got {type(text).__name__}")
    last = None
    for m in _BOX_RE.finditer(text):
        last = m
    if last is None:
        return None
    return _box_content(text, last.end())


def count_boxes(text: str) -> int:
    """Number of \\boxed / \\fbox commands in `text` (nested boxes count separately)."""
    return len(_BOX_RE.findall(text))


# ---------------------------------------------------------------------------------------------
# Normalisation and grading (run inside the pool workers)
# ---------------------------------------------------------------------------------------------

# Trailing sentence punctuation and LaTeX spacing: "\boxed{6.}" means 6.
_TRAILING_JUNK_RE = re.compile(r"(?:\s|\\[,;:! ]|\\quad|\\qquad|~|[.,;:])+$")
_REPLACEMENTS = (
    ("\\varnothing", "\\emptyset"),   # math-verify parses \varnothing as a symbol
    ("°", "^\\circ"),                  # unicode degree sign: math-verify leaves "90°" a string
    ("\\displaystyle", ""),
)


def normalize_answer(answer: str) -> str:
    """Light, safe clean-up of an extracted answer before math-verify sees it."""
    s = answer.strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s.strip("$").strip()
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    s = _TRAILING_JUNK_RE.sub("", s)
    # Redundant outer grouping braces ("{(2,4)}" renders as "(2,4)"; math-verify reads a set).
    while len(s) >= 2 and s[0] == "{" and _box_content(s, 0) == s[1:-1]:
        s = s[1:-1].strip()
    return s


def final_answer(text: str, max_chars: int = 1000) -> str | None:
    """The answer a response gives, as the math rewards grade it: its last \\boxed{} content,
    normalised (normalize_answer); None without one, for an empty one or one over max_chars
    (RewardScorer's max_answer_chars: graded 0 unverified). Two responses with the same final
    answer get the same verdict, so it is the vote of majority voting (evaluation.maj_at_k)."""
    answer = extract_last_boxed(text)
    if answer is None or len(answer) > max_chars:
        return None
    return normalize_answer(answer) or None


class _SoftTimeout(BaseException):
    """Raised by SIGALRM inside a worker. A BaseException, so that math-verify's broad
    `except Exception` handlers cannot swallow it."""


_alarm_armed = False


def _on_alarm(signum, frame):
    if _alarm_armed:
        raise _SoftTimeout()


@functools.lru_cache(maxsize=4096)
def _parse_cached(latex_answer: str):
    from math_verify import parse
    # Wrapped in \boxed{} so math-verify's LaTeX extraction takes the whole string as the answer.
    return parse("\\boxed{" + latex_answer + "}", parsing_timeout=None)


def verify_answer(gold: str, pred: str) -> bool:
    """math-verify equivalence of two answer strings (no timeout; gold first).

    Both are normalised, wrapped in \\boxed{} and parsed; `verify(gold, pred)`.
    """
    from math_verify import verify
    gold_n, pred_n = normalize_answer(gold), normalize_answer(pred)
    if not gold_n or not pred_n:
        return False
    if gold_n == pred_n:
        return True
    return bool(verify(_parse_cached(gold_n), _parse_cached(pred_n), timeout_seconds=None))


def _quiet_math_verify_logs() -> None:
    # Workers run with math-verify's own timeouts off; its "timeout disabled" warning is noise.
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)


def grade_in_worker(gold: str, pred: str, soft_timeout_s: float) -> bool:
    """Pool entry point: verify_answer under a SIGALRM soft timeout (main thread of a worker).

    Raises TimeoutError on timeout (the pool reports it as a timeout).
    """
    global _alarm_armed
    if threading.current_thread() is not threading.main_thread():
        # No signals off the main thread; the parent's hard kill still applies.
        return verify_answer(gold, pred)
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        try:
            _alarm_armed = True
            signal.setitimer(signal.ITIMER_REAL, soft_timeout_s)
            return verify_answer(gold, pred)
        finally:
            _alarm_armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:
        raise TimeoutError(f"math-verify took over {soft_timeout_s} s") from None


def init_worker() -> None:
    """Pool initializer: import math-verify and warm its regex caches before taking work."""
    _quiet_math_verify_logs()
    verify_answer("\\frac{1}{2}", "0.5")


_GRADE_FN = f"{__name__}:grade_in_worker"
_INIT_FN = f"{__name__}:init_worker"

# ---------------------------------------------------------------------------------------------
# Reward functions (registry) and the DAPO overlong penalty
# ---------------------------------------------------------------------------------------------

RewardFn = Callable[..., np.ndarray]
REWARD_FNS: dict[str, RewardFn] = {}


def register_reward(name: str):
    """Decorator: REWARD_FNS[name] = fn(accuracy [N] f32, num_boxes [N] i32, **kw) -> [N] f32."""
    def deco(fn):
        if name in REWARD_FNS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARD_FNS[name] = fn
        return fn
    return deco


def get_reward_fn(name: str) -> RewardFn:
    if name not in REWARD_FNS:
        raise ValueError(f"unknown reward.name {name!r}; known: {sorted(REWARD_FNS)}")
    return REWARD_FNS[name]


@register_reward("math")
def math_accuracy_reward(accuracy: np.ndarray, num_boxes: np.ndarray) -> np.ndarray:
    """The accuracy as the reward: math 1 if the last \\boxed{} answer is correct, else 0."""
    del num_boxes
    return accuracy.astype(np.float32)


@register_reward("math_format")
def math_format_reward(accuracy: np.ndarray, num_boxes: np.ndarray, one_box_bonus: float = 0.0,
                       no_box_penalty: float = 1.0) -> np.ndarray:
    """Correctness plus format shaping: + one_box_bonus for exactly one \\boxed{}, - no_box_penalty
    for none. Defaults give 1 (correct), 0 (answered, wrong), -1 (no boxed answer)."""
    acc = accuracy.astype(np.float32)
    return (acc + np.float32(one_box_bonus) * (num_boxes == 1)
            - np.float32(no_box_penalty) * (num_boxes == 0)).astype(np.float32)


@register_reward("math_pm1")
def math_pm1_reward(accuracy: np.ndarray, num_boxes: np.ndarray) -> np.ndarray:
    """DAPO's rule-based reward: +1 if correct, -1 otherwise."""
    del num_boxes
    return (2.0 * accuracy - 1.0).astype(np.float32)


# Code: the accuracy itself, 1 when every unit test passes, else 0 (the fraction passed with
# pass_fraction); the same function as "math".
register_reward("code")(math_accuracy_reward)


# ---------------------------------------------------------------------------------------------
# A reward of the user's own: rewards.name = "python", rewards.python_fn = "<file.py>:<function>"
# or "<package.module>:<function>" (verl's custom_reward_function, TRL's reward_funcs)
# ---------------------------------------------------------------------------------------------

USER_REWARD = "python"
_USER_FNS: dict[str, Callable] = {}  # spec -> function, per process (each worker loads it once)


def load_user_reward(spec: str) -> Callable:
    """The function `spec` names: "<path>.py:<name>" (a file, imported as a module of its own)
    or "<module>:<name>" (importable from sys.path). ValueError saying what is wrong."""
    import importlib
    import importlib.util
    import os

    if spec in _USER_FNS:
        return _USER_FNS[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{spec!r} is not '<file.py>:<function>' or '<module>:<function>'")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ValueError(f"{where}: no such file")
        module_name = "delta_jax_user_reward_" + hashlib.sha256(
            os.path.abspath(where).encode()).hexdigest()[:12]
        module_spec = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file: say which and why
            raise ValueError(f"{where} does not import: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"module {where!r} does not import: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where} has no function {name!r}")
    _USER_FNS[spec] = fn
    return fn


def user_reward_value(value) -> tuple[float, float]:
    """(reward, correct) from what a user reward returned: a number or bool (correct = reward >
    0), or a dict with "reward" (or verl's "score") and optionally "correct" (or "acc")."""
    correct = None
    if isinstance(value, dict):
        key = "reward" if "reward" in value else "score" if "score" in value else None
        if key is None:
            raise ValueError(f"returned a dict without 'reward' or 'score': keys {sorted(value)}")
        correct = value.get("correct", value.get("acc"))
        value = value[key]
    if isinstance(value, (bool, np.bool_)):
        value = float(value)
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"returned {type(value).__name__}, not a number, bool or dict")
    reward = float(value)
    if not np.isfinite(reward):
        raise ValueError(f"returned a non-finite reward {reward}")
    return reward, float(bool(correct) if correct is not None else reward > 0)


# What score() can give a user reward beside the response and its answer, by keyword: the
# response's problem text and its record's data_source and extra_info (verl's names).
USER_REWARD_KEYWORDS = ("problem", "data_source", "extra_info")
# A function with both of these parameters is called as verl calls a custom reward:
# compute_score(data_source=, solution_str=response, ground_truth=answer, extra_info=).
VERL_REWARD_ARGS = ("solution_str", "ground_truth")
# A function with this parameter is a batch reward, called as TRL's GRPOTrainer calls its
# reward_funcs: fn(prompts=[...], completions=[...], **columns) -> one reward (or None) each.
TRL_REWARD_ARG = "completions"
# What a batch reward gets beside completions=, one list entry per completion: TRL's prompts=
# (the problems) and completion_ids= (each response's token ids, its stop token included), the
# answer under the column names TRL recipes give it and USER_REWARD_KEYWORDS; and once a call
# (TRL_CALL_KEYWORDS), trainer_state= (a TrainerState).
TRL_ANSWER_NAMES = ("answer", "solution", "ground_truth")
TRL_CALL_KEYWORDS = ("trainer_state",)
TRL_REWARD_KEYWORDS = ("prompts", "completion_ids", *TRL_ANSWER_NAMES, *USER_REWARD_KEYWORDS,
                       *TRL_CALL_KEYWORDS)
# How a batch reward gets its completions and prompts: TRL's standard form (strings) or its
# conversational form ([{"role": "assistant", "content": text}], [{"role": "user", ...}]).
COMPLETION_FORMATS = ("text", "messages")


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """A batch reward's trainer_state= (TRL passes its transformers TrainerState; this holds the
    fields a reward schedule reads): global_step, the RL steps done before the responses were
    sampled (0 for the first step's rollout, N for an evaluation after step N), and max_steps
    (train.steps)."""
    global_step: int
    max_steps: int


@dataclasses.dataclass(frozen=True)
class UserRewardCall:
    """How a user reward is called: fn(response, answer, **kw), with verl=True
    fn(solution_str=response, ground_truth=answer, **kw), or with batch=True once for a list of
    responses, fn(completions=[...], **kw) (TRL's reward functions); kw holds those of
    `keywords` (USER_REWARD_KEYWORDS; TRL_REWARD_KEYWORDS for a batch) that score() was
    given, and the data set's columns of its other parameters' names, `columns` (`required`:
    those without a default; all_columns: **kwargs, which gets every column the run keeps, as
    TRL gives **kwargs all of a data set's columns)."""
    verl: bool = False
    keywords: tuple[str, ...] = ()
    batch: bool = False
    columns: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    all_columns: bool = False

    @property
    def kind(self) -> str:
        """user_reward_in_worker's call: "batch", "verl" or "plain"."""
        return "batch" if self.batch else "verl" if self.verl else "plain"


def user_reward_call(fn: Callable) -> UserRewardCall:
    """The call a user reward's signature asks for: a batch (TRL's) call when it has a
    TRL_REWARD_ARG parameter, verl's when it has VERL_REWARD_ARGS parameters; the keywords of
    its kind it has a parameter of that name for (positional or keyword), all of them with
    **kwargs; its other parameters by name (not the ones the call fills: completions, verl's
    two, a plain call's first two positional ones) are data set columns, as TRL passes a data
    set's columns by name. ValueError for a batch reward with positional-only parameters (TRL
    calls by keyword: they would get nothing)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function without a signature
        return UserRewardCall()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    names = {p.name for p in named}
    batch = TRL_REWARD_ARG in names
    known = TRL_REWARD_KEYWORDS if batch else USER_REWARD_KEYWORDS
    if batch:
        unsent = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
        if unsent:
            raise ValueError(
                f"{getattr(fn, '__name__', fn)!r} is a batch reward (it takes "
                f"{TRL_REWARD_ARG}=, as TRL's reward functions do) whose positional-only "
                f"parameter(s) {', '.join(unsent)} would get nothing: a batch reward is called "
                f"by keyword with {TRL_REWARD_ARG}= and any of {', '.join(TRL_REWARD_KEYWORDS)} "
                "or a data set column of the parameter's name")
    verl = not batch and all(a in names for a in VERL_REWARD_ARGS)
    if batch:
        filled = {TRL_REWARD_ARG}
    elif verl:
        filled = set(VERL_REWARD_ARGS)
    else:  # fn(response, answer, ...): its first two positional parameters
        filled = {p.name for p in params[:2]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
    columns = [p for p in named if p.name not in filled and p.name not in known]
    column_names = tuple(p.name for p in columns)
    required = tuple(p.name for p in columns if p.default is p.empty)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return UserRewardCall(verl, known, batch, column_names, required, all_columns=True)
    return UserRewardCall(verl, tuple(k for k in known if k in names), batch, column_names,
                          required)


def reward_columns(calls: Sequence[UserRewardCall], python_columns: Sequence[str] = ()
                   ) -> dict[str, bool]:
    """{column name: required} a run's records keep for its python_fn functions (their calls,
    user_reward_call) and rewards.python_columns (names a **kwargs function reads, required):
    required when any function (or python_columns) requires it."""
    out: dict[str, bool] = {}
    for call in calls:
        for name in call.columns:
            out[name] = out.get(name, False) or name in call.required
    for name in python_columns:
        out[name] = True
    return out


def load_python_fns(python_fn) -> tuple[tuple[str, ...], tuple[UserRewardCall, ...]]:
    """rewards.python_fn's specs (file paths made absolute) and how each function is called
    (user_reward_call), each function imported here; InputError naming rewards.python_fn for
    one that does not load."""
    try:
        specs = tuple(_absolute_spec(p) for p in user_reward_specs(python_fn))
        return specs, tuple(user_reward_call(load_user_reward(p)) for p in specs)
    except ValueError as e:
        raise InputError(f"rewards.python_fn: {e}") from None


def python_fn_columns(calls: Sequence[UserRewardCall], python_columns) -> dict[str, bool]:
    """reward_columns of the calls and rewards.python_columns' names (user_reward_columns);
    InputError naming rewards.python_columns for a bad name."""
    try:
        extra = user_reward_columns(python_columns)
    except ValueError as e:
        raise InputError(f"rewards.python_columns: {e}") from None
    return reward_columns(calls, extra)


def user_reward_columns(python_columns) -> tuple[str, ...]:
    """rewards.python_columns' names, comma separated ("" = none); ValueError for one that is
    not a Python identifier (a keyword argument's name)."""
    parts = python_columns.split(",") if isinstance(python_columns, str) else list(python_columns)
    names = tuple(str(p).strip() for p in parts if str(p).strip())
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise ValueError(f"{bad} are not column names a reward can take by keyword")
    return names


def user_reward_in_worker(spec: str, kind: str, response, answer: str | None,
                          keywords: dict) -> tuple[float, float] | list[tuple[float, float]]:
    """VerifyPool item of a user reward, called as user_reward_call decided once in the scorer
    (kind: UserRewardCall.kind; keywords: the ones sent): (reward, correct) of one response,
    or for a "batch" call fn(completions=response, **keywords) once, (reward, correct) per
    completion, a None reward 0 and not correct (TRL sums a None as nothing); ValueError for a
    batch return that is not one reward a completion."""
    fn = load_user_reward(spec)
    if kind == "verl":
        return user_reward_value(fn(solution_str=response, ground_truth=answer, **keywords))
    if kind != "batch":
        return user_reward_value(fn(response, answer, **keywords))
    out = fn(completions=response, **keywords)
    if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__"):
        raise ValueError(f"returned {type(out).__name__}, not a list of one reward a completion")
    values = list(out)
    if len(values) != len(response):
        raise ValueError(f"returned {len(values)} rewards for {len(response)} completions")
    return [(0.0, 0.0) if v is None else user_reward_value(v) for v in values]


def load_user_rewards(*specs: str) -> None:
    """A worker's initializer: loads each python_fn before the worker takes work."""
    for spec in specs:
        load_user_reward(spec)


def user_reward_specs(python_fn) -> tuple[str, ...]:
    """The specs of a python_fn: one "<file.py>:<function>" / "<module>:<function>", several
    separated by commas, or a sequence of them; ValueError for none or an empty one."""
    parts = python_fn.split(",") if isinstance(python_fn, str) else list(python_fn)
    specs = tuple(str(p).strip() for p in parts)
    if not specs or not all(specs):
        raise ValueError(f"{python_fn!r} names no function (or an empty one between commas)")
    return specs


def user_reward_weights(text: str) -> tuple[float, ...] | None:
    """rewards.python_weights' numbers, comma separated; None for "" (1 a function); ValueError
    for a part that is not a number."""
    text = str(text).strip()
    return tuple(float(w) for w in text.split(",")) if text else None


def user_reward_names(specs: Sequence[str]) -> tuple[str, ...]:
    """Each spec's function name, made unique by a _2, _3, ... suffix (its metrics' name)."""
    names, seen = [], collections.Counter()
    for spec in specs:
        name = spec.rpartition(":")[2]
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return tuple(names)


def reward_context(records: Sequence[Mapping], n: int = 1) -> dict:
    """score()'s problems=, solutions=, data_sources=, extra_infos=, columns= for the responses
    of `records`, n responses a record in order (a group's samples): each record's problem, its
    solution and its context fields (data.records.CONTEXT_FIELDS, data.records.COLUMNS; "" for
    a record without them)."""
    from delta_jax.data.records import COLUMNS, DATA_SOURCE, EXTRA_INFO

    def each(get):
        return [get(r) for r in records for _ in range(n)]

    return {"problems": each(lambda r: r["problem"]),
            "solutions": each(lambda r: r.get("solution", "")),
            "data_sources": each(lambda r: r.get(DATA_SOURCE, "")),
            "extra_infos": each(lambda r: r.get(EXTRA_INFO, "")),
            "columns": each(lambda r: r.get(COLUMNS, ""))}


_USER_FN = f"{__name__}:user_reward_in_worker"
_USER_INIT_FN = f"{__name__}:load_user_rewards"
# score()'s info key of each function's rewards when python_fn names several:
# {function name (user_reward_names): float32 [N]}
REWARD_FNS_KEY = "reward_fns"


def overlong_penalty(lengths, max_len: int, buffer_len: int, factor: float = 1.0) -> np.ndarray:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13; verl's overlong_buffer), fp32 [N].

    With L = max_len and Lb = buffer_len: 0 if len <= L - Lb; ((L - Lb) - len) / Lb * factor
    if L - Lb < len <= L; -factor beyond L.
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    lengths = np.asarray(lengths, dtype=np.float32)
    expected = np.float32(max_len - buffer_len)
    pen = (expected - lengths) / np.float32(buffer_len) * np.float32(factor)
    return np.clip(pen, -np.float32(factor), 0.0).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Batch scorer
# ---------------------------------------------------------------------------------------------


class RewardScorer:
    """Scores batches of responses against gold answers in a persistent verification pool.

    Args:
      name: reward function in REWARD_FNS ("math" | "math_format" | "math_pm1" | "code"), or
        USER_REWARD ("python"): python_fn's function grades each response in the pool's workers.
      python_fn: name = "python" only: "<file.py>:<function>" or "<module>:<function>", called
        as fn(response: str, answer: str), with problem= (the problem text score() is given),
        data_source= and extra_info= (the record's; extra_info decoded: any JSON value, None
        when it has none) by keyword when it has a parameter of that name or **kwargs; a
        function with solution_str and ground_truth parameters is called as verl calls one,
        fn(data_source=, solution_str=response, ground_truth=answer, extra_info=), so verl's
        custom reward functions run unchanged. It returns a number or bool (the reward; correct
        when > 0) or a dict {"reward" | "score": number, optional "correct" | "acc": bool}. A
        call that raises, returns something else or runs past timeout_s scores 0 and is counted
        (num_errors / num_timeouts; the first error of a batch is logged). A function with a
        `completions` parameter is a batch reward, called as TRL's GRPOTrainer calls its
        reward_funcs: fn(completions=[...], **kw) on python_batch_size responses at a time (a
        call each within timeout_s), kw by keyword as above from prompts= (the problems),
        completion_ids= (the responses' token ids), answer= / solution= / ground_truth= (the
        answers; solution= is a record's own solution where it has one, as TRL passes a data
        set's "solution" column), problem= / data_source= / extra_info= and trainer_state= (a
        TrainerState, the same for the whole call), each when score() is given it; it returns
        one reward a completion (a number, bool, dict as above, or None for 0), and a call that
        fails scores its whole batch 0. Any other parameter of a python_fn function (of any
        kind; not the ones its call fills) is a data set column of that name, as TRL gives its
        reward functions a data set's columns by keyword: `columns` says which the records
        must keep (data.records.columns_text), and score()'s columns= brings them; a
        per-response call gets the column where its record has it, a batch call the list of a
        span's values (None for a record without it) where one of them has it, and **kwargs
        every column the run keeps.
        python_fn may name several functions, separated by commas (or as a sequence), as TRL's
        reward_funcs list: a response's reward is their python_weights-weighted sum, its
        correctness the first function's; a failed call of any fails the response (0 from
        each); info["reward_fns"] (REWARD_FNS_KEY) holds each function's unweighted rewards
        {name: float32 [N]} (user_reward_names).
      python_weights: one weight a python_fn function (TRL's reward_weights); None = 1 each.
      python_columns: more data set columns to keep, required (user_reward_columns), for a
        function that reads them from **kwargs.
      python_batch_size: a batch reward's responses a call.
      completion_format: how a batch reward gets completions= and prompts=: "text" (strings,
        TRL's standard form) or "messages" (TRL's conversational form: [{"role": "assistant",
        "content": response}] and [{"role": "user", "content": problem}] each).
      num_workers, timeout_s, start_method: the VerifyPool (timeout_s = hard wall-clock limit per
        item; the in-worker soft limit is 0.8 of it).
      max_response_len, overlong_buffer_len, overlong_penalty_factor: DAPO overlong penalty in
        tokens, on when overlong_buffer_len > 0 (needs response_lengths in score()).
      reward_kwargs: extra keyword arguments for the reward function.
      cache_size: LRU cache of (gold, answer) -> verdict, shared across calls. It holds real
        verdicts only: timeouts and crashes are scored 0, counted, and checked again next batch.
      pool: an existing VerifyPool running grade_in_worker to share (not closed by this scorer;
        math rewards only), e.g. another scorer's .pool; by default the scorer starts and owns
        its own.
      max_answer_chars: longer boxed answers score 0 unverified (no gold answer is that long,
        and sympy on a huge string can eat memory before any timeout).

    Thread-safe: concurrent score() calls are serialised.
    """

    def __init__(self, name: str = "math", num_workers: int = 2, timeout_s: float = 10.0,
                 max_response_len: int | None = None, overlong_buffer_len: int = 0,
                 overlong_penalty_factor: float = 1.0, reward_kwargs: dict | None = None,
                 cache_size: int = 200_000, start_method: str = "spawn",
                 chunk_size: int | None = None, pool: vp.VerifyPool | None = None,
                 max_answer_chars: int = 1000, code_sandbox: str = "local",
                 code_sandbox_url: str = "", code_isolation: bool = True,
                 code_memory_mb: int = 1024, code_max_processes: int = 16,
                 pass_fraction: bool = False, python_fn: str | Sequence[str] = "",
                 python_weights: Sequence[float] | None = None,
                 python_batch_size: int = 16, completion_format: str = "text",
                 python_columns: Sequence[str] | str = ()):
        self.name = name
        self._code = None
        self.python_fn = ""
        self.python_fns: tuple[str, ...] = ()
        self.python_weights: tuple[float, ...] = ()
        self.reward_fn_names: tuple[str, ...] = ()
        self._calls: tuple[UserRewardCall, ...] = ()  # how each function asks to be called
        self.columns: dict[str, bool] = {}  # reward_columns: what the records keep for them
        if not (isinstance(python_batch_size, int) and python_batch_size >= 1):
            raise ValueError(f"python_batch_size must be an int >= 1, got {python_batch_size!r}")
        if completion_format not in COMPLETION_FORMATS:
            raise ValueError(f"completion_format must be one of {COMPLETION_FORMATS}, got "
                             f"{completion_format!r}")
        self.python_batch_size = python_batch_size
        self.completion_format = completion_format
        self.reward_fn = None if name == USER_REWARD else get_reward_fn(name)
        self.reward_kwargs = dict(reward_kwargs or {})
        if overlong_buffer_len > 0 and not max_response_len:
            raise ValueError("reward.overlong_buffer_len > 0 needs reward.max_response_len")
        if overlong_buffer_len > 0 and overlong_buffer_len > max_response_len:
            raise ValueError(f"reward.overlong_buffer_len={overlong_buffer_len} exceeds "
                             f"max_response_len={max_response_len}")
        self.max_response_len = max_response_len
        self.overlong_buffer_len = int(overlong_buffer_len)
        self.overlong_penalty_factor = float(overlong_penalty_factor)
        self.max_answer_chars = max_answer_chars
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = cache_size
        if name == "code":
            if pool is not None:
                raise ValueError("RewardScorer(name='code') runs programs in its own sandbox "
                                 "runner; pool= shares a math grading pool only")
            self._owns_pool = True
            self._code = CodeRunner(code_sandbox, num_workers=num_workers, timeout_s=timeout_s,
                                    url=code_sandbox_url, isolate=code_isolation,
                                    memory_mb=code_memory_mb, max_processes=code_max_processes,
                                    pass_fraction=pass_fraction)
            self.pool = self._code.pool
            return
        grade_fn, init_fn, init_args = _GRADE_FN, _INIT_FN, ()
        if name == USER_REWARD:
            # here, so that a bad one stops the start
            self.python_fns, self._calls = load_python_fns(python_fn)
            self.python_fn = ",".join(self.python_fns)
            weights = (1.0,) * len(self.python_fns) if python_weights is None else tuple(
                float(w) for w in python_weights)
            if len(weights) != len(self.python_fns) or not np.isfinite(weights).all():
                raise InputError(f"rewards.python_weights: {len(weights)} weights {weights} for "
                                 f"{len(self.python_fns)} python_fn functions; one finite "
                                 "weight each")
            self.python_weights = weights
            self.reward_fn_names = user_reward_names(self.python_fns)
            self.columns = python_fn_columns(self._calls, python_columns)
            # each worker loads them before it takes work: their imports are not a first timeout
            grade_fn, init_fn, init_args = _USER_FN, _USER_INIT_FN, self.python_fns
        if pool is not None and pool.fn != grade_fn:
            raise ValueError(f"pool runs {pool.fn!r}, RewardScorer needs {grade_fn!r}")
        self._owns_pool = pool is None
        self.pool = pool or vp.VerifyPool(grade_fn, num_workers=num_workers,
                                          timeout_s=timeout_s, initializer=init_fn,
                                          initializer_args=init_args,
                                          start_method=start_method, chunk_size=chunk_size)
        # Soft in-worker limit below the hard kill, so a slow sympy call usually keeps its worker.
        self._soft_timeout_s = 0.8 * self.pool.timeout_s

    def close(self) -> None:
        if self._code is not None:
            self._code.close()
        elif self._owns_pool:
            self.pool.close()

    @property
    def user_calls(self) -> tuple[UserRewardCall, ...]:
        """How each python_fn function is called (user_reward_call of its signature; () for a
        built-in reward)."""
        return self._calls

    @property
    def closed(self) -> bool:
        return self._code.closed if self._code is not None else self.pool._closed

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def correctness(self, answers: Sequence[str | None], golds: Sequence[str]):
        """Verdicts for extracted answers (None = no answer). Returns (accuracy f32 [N],
        timed_out bool [N], errored bool [N], cache_hits int)."""
        with self._lock:
            return self._correctness_locked(answers, golds)

    def _correctness_locked(self, answers, golds):
        n = len(answers)
        accuracy = np.zeros(n, np.float32)
        timed_out = np.zeros(n, bool)
        errored = np.zeros(n, bool)
        todo: dict[tuple[str, str], list[int]] = {}
        hits = 0
        for i, (ans, gold) in enumerate(zip(answers, golds)):
            if ans is None or len(ans) > self.max_answer_chars:
                continue
            key = (normalize_answer(str(gold)), normalize_answer(ans))
            if not key[0] or not key[1]:
                continue
            if key[0] == key[1]:  # identical strings need no sympy
                accuracy[i] = 1.0
                continue
            if key in self._cache:
                self._cache.move_to_end(key)
                status, ok = self._cache[key]
                hits += 1
                accuracy[i], timed_out[i], errored[i] = (
                    float(ok), status == vp.TIMEOUT, status == vp.ERROR)
                continue
            todo.setdefault(key, []).append(i)
        # Two rounds: first one pair per distinct answer, then the rest. An answer that timed
        # out in round one (a hostile answer: sympy stuck on it) is not run again in this batch
        # against other golds; those pairs are reported as timeouts too. So a hostile answer
        # costs one timeout per batch, however many prompts it was given for.
        first: dict[str, tuple[str, str]] = {}
        for key in todo:
            first.setdefault(key[1], key)
        outcomes = dict(zip(first.values(), self.pool.map(
            [(g, a, self._soft_timeout_s) for g, a in first.values()])))
        hostile = {a for (_, a), out in outcomes.items() if out.status == vp.TIMEOUT}
        rest = [k for k in todo if k not in outcomes and k[1] not in hostile]
        outcomes.update(zip(rest, self.pool.map([(g, a, self._soft_timeout_s) for g, a in rest])))
        skipped = vp.ItemResult(vp.TIMEOUT, "the same answer timed out earlier in this batch")
        for key, rows in todo.items():
            out = outcomes.get(key, skipped)
            ok = out.status == vp.OK and bool(out.value)
            if out.status == vp.OK:
                # Real verdicts only: a timeout or a crash says nothing about the answer (the
                # host may have been busy) and is checked again in the next batch.
                self._cache[key] = (out.status, ok)
            for i in rows:
                accuracy[i], timed_out[i], errored[i] = (
                    float(ok), out.status == vp.TIMEOUT, out.status == vp.ERROR)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return accuracy, timed_out, errored, hits

    def score(self, responses: Sequence[str], golds: Sequence[str], response_lengths=None,
              truncated=None, problems: Sequence[str] | None = None,
              data_sources: Sequence[str] | None = None,
              extra_infos: Sequence[str] | None = None, response_ids=None,
              trainer_state: TrainerState | None = None,
              solutions: Sequence[str] | None = None, columns: Sequence[str] | None = None):
        """Rewards for N responses.

        Args:
          responses: N response texts. golds: N gold answers (str; other types are str()-ed).
          response_lengths: int [N] response lengths in tokens (needed for the overlong penalty).
          truncated: bool [N] hit max length without EOS (counted in info only).
          problems: N problem texts (each response's question, untemplated), for a python_fn
            that takes them; the built-in rewards do not read them.
          data_sources, extra_infos: N records' data_source and extra_info texts
            (data.records.CONTEXT_FIELDS; extra_info JSON, "" for none), for a python_fn that
            takes them (extra_info decoded, None for ""); reward_context(records) makes all
            three; the built-in rewards do not read them.
          response_ids: N responses' token ids (sequences of int, the stop token included), a
            batch reward's completion_ids=; trainer_state: its trainer_state= (TrainerState).
            The built-in rewards read neither.
          solutions: N records' solutions ("" for none): a batch reward's solution= where it is
            not "" (else the gold answer).
          columns: N records' data.records.COLUMNS texts (JSON of {name: value}), the data set
            columns a python_fn takes by name (`self.columns`).
          reward_context(records) makes problems, solutions, data_sources, extra_infos and
          columns.
        Returns:
          rewards: float32 [N].
          info: accuracy f32 [N], num_boxes i32 [N], overlong_penalty f32 [N], timed_out /
            errored bool [N]; scalars num_timeouts, num_errors, num_no_box,
            num_answer_too_long, num_truncated, cache_hits, seconds.
        """
        t0 = time.perf_counter()
        n = len(responses)
        if len(golds) != n:
            raise ValueError(f"score: {n} responses but {len(golds)} golds")
        for name, given in (("problems", problems), ("data_sources", data_sources),
                            ("extra_infos", extra_infos), ("response_ids", response_ids),
                            ("solutions", solutions), ("columns", columns)):
            if given is not None and len(given) != n:
                raise ValueError(f"score: {n} responses but {len(given)} {name}")
        extra = {}
        user_rewards = None
        num_too_long = 0
        if self.python_fn:
            with self._lock:
                user_rewards, accuracy, timed_out, errored, extra = self._user_scores(
                    responses, golds, problems, data_sources, extra_infos, response_ids,
                    trainer_state, solutions, columns)
            # no answer to extract: every response counts as answered
            num_boxes, hits, num_no_box = np.zeros(n, np.int32), 0, 0
        elif self._code is not None:
            with self._lock:
                accuracy, timed_out, errored, hits, extra = self._code.score(
                    responses, golds, self._cache, self._cache_size)
            # num_no_box counts responses without a fenced code block (the whole response
            # is run then).
            num_boxes = extra.pop("has_code_block").astype(np.int32)
            num_no_box = int((num_boxes == 0).sum())
        else:
            answers = [extract_last_boxed(r) for r in responses]
            num_boxes = np.array([count_boxes(r) for r in responses], np.int32)
            accuracy, timed_out, errored, hits = self.correctness(answers, golds)
            num_no_box = sum(a is None or not a.strip() for a in answers)
            num_too_long = sum(a is not None and len(a) > self.max_answer_chars for a in answers)
        if user_rewards is not None:
            rewards = user_rewards
        else:
            rewards = np.asarray(self.reward_fn(accuracy, num_boxes, **self.reward_kwargs),
                                 np.float32)
        penalty = np.zeros(n, np.float32)
        if self.overlong_buffer_len > 0:
            if response_lengths is None:
                raise ValueError("score: the overlong penalty is on, pass response_lengths")
            lengths = np.asarray(response_lengths)
            if lengths.shape != (n,):
                raise ValueError(f"score: response_lengths has shape {lengths.shape}, want ({n},)")
            penalty = overlong_penalty(lengths, self.max_response_len, self.overlong_buffer_len,
                                       self.overlong_penalty_factor)
            rewards = rewards + penalty
        info = {
            "accuracy": accuracy,
            "num_boxes": num_boxes,
            "overlong_penalty": penalty,
            "timed_out": timed_out,
            "errored": errored,
            "num_timeouts": int(timed_out.sum()),
            "num_errors": int(errored.sum()),
            "num_no_box": int(num_no_box),
            "num_answer_too_long": int(num_too_long),
            "num_truncated": int(np.asarray(truncated).sum()) if truncated is not None else 0,
            "cache_hits": hits,
            "seconds": time.perf_counter() - t0,
            **extra,
        }
        return rewards.astype(np.float32), info

    def _user_scores(self, responses, golds, problems=None, data_sources=None,
                     extra_infos=None, response_ids=None, trainer_state=None, solutions=None,
                     columns=None):
        """python_fn's (reward, correct) per response in the pool: rewards, accuracy f32 [N],
        timed_out, errored bool [N] (those score 0; the batch's first error is logged) and, with
        several functions, {REWARD_FNS_KEY: {name: its rewards [N]}}. Each function gets by keyword
        those of its call's keywords that it takes and were given (nothing is sent for nothing):
        one call a response, or for a batch reward one call a python_batch_size span of them (a
        failed call fails its whole span); one pool map runs every function's calls; the data
        set columns of a call (UserRewardCall.columns, all_columns) where a record has them."""
        from delta_jax.data.records import decode_columns, decode_extra_info

        n = len(responses)
        parts = np.zeros((len(self.python_fns), n), np.float32)  # each function's rewards
        accuracy = np.zeros(n, np.float32)
        timed_out, errored = np.zeros(n, bool), np.zeros(n, bool)
        golds = [str(g) for g in golds]
        messages = self.completion_format == "messages"
        # Every keyword any function may get; each gets those its call names (sent below).
        given = {"problem": problems, "data_source": data_sources, "extra_info": extra_infos,
                 **dict.fromkeys(TRL_ANSWER_NAMES, golds), "prompts": problems}
        if solutions is not None:  # a record's own solution, as TRL passes the column
            given["solution"] = [s or g for s, g in zip(solutions, golds)]
        if messages and problems is not None:
            given["prompts"] = [[{"role": "user", "content": p}] for p in problems]
        if extra_infos is not None and any("extra_info" in c.keywords for c in self._calls):
            given["extra_info"] = [decode_extra_info(e) for e in extra_infos]  # once, if taken
        if response_ids is not None and any("completion_ids" in c.keywords for c in self._calls):
            given["completion_ids"] = [[int(t) for t in ids] for ids in response_ids]
        once = {"trainer_state": trainer_state}  # TRL_CALL_KEYWORDS: the same for every call
        taken = {c: self.columns if c.all_columns else c.columns for c in self._calls}
        rows = ([decode_columns(t) for t in columns]  # once, if a function takes a column
                if columns is not None and any(taken.values()) else [{}] * n)
        completions = ([[{"role": "assistant", "content": r}] for r in responses] if messages
                       else list(responses))  # a batch reward's
        spans, items = [], []  # (function, lo, hi) and its pool item
        for f, (spec, call) in enumerate(zip(self.python_fns, self._calls)):
            sent = {k: given[k] for k in call.keywords if given.get(k) is not None}
            if not call.batch:
                spans += [(f, i, i + 1) for i in range(n)]
                items += [(spec, call.kind, r, g, {k: v[i] for k, v in sent.items()}
                           | {c: rows[i][c] for c in taken[call] if c in rows[i]})
                          for i, (r, g) in enumerate(zip(responses, golds))]
                continue
            for lo in range(0, n, self.python_batch_size):
                hi = min(lo + self.python_batch_size, n)
                spans.append((f, lo, hi))
                span = rows[lo:hi]
                items.append((spec, call.kind, completions[lo:hi], None,
                              {k: v[lo:hi] for k, v in sent.items()}
                              | {k: once[k] for k in call.keywords
                                 if once.get(k) is not None}
                              | {c: [r.get(c) for r in span] for c in taken[call]
                                 if any(c in r for r in span)}))
        outcomes = self.pool.map(items)
        first = None  # the first failed call's error
        for (f, lo, hi), out in zip(spans, outcomes):
            if out.status == vp.OK:
                got = out.value if self._calls[f].batch else [out.value]
                values, correct = zip(*got)
                parts[f, lo:hi] = values
                if f == 0:  # correctness is the first function's
                    accuracy[lo:hi] = correct
            else:
                timed_out[lo:hi] |= out.status == vp.TIMEOUT
                errored[lo:hi] |= out.status == vp.ERROR
                if first is None and out.status == vp.ERROR:
                    first = out.value
        failed = timed_out | errored
        parts[:, failed] = 0.0
        accuracy[failed] = 0.0
        if errored.any():
            log.warning("rewards.python_fn %s: %d of %d responses scored 0 on an error; the first: "
                        "%s", self.python_fn, int(errored.sum()), n, first)
        rewards = np.asarray(self.python_weights, np.float32) @ parts
        each = {}
        if len(self.python_fns) > 1:
            each = {REWARD_FNS_KEY: dict(zip(self.reward_fn_names, parts))}
        return rewards, accuracy, timed_out, errored, each


def _absolute_spec(spec: str) -> str:
    """A python_fn spec whose file path is absolute (the workers may start elsewhere)."""
    import os
    where, sep, name = str(spec).rpartition(":")
    if sep and where.endswith(".py"):
        return f"{os.path.abspath(os.path.expanduser(where))}:{name}"
    return str(spec)


def score_across_processes(score, responses: Sequence[str], golds: Sequence[str],
                           response_lengths=None, truncated=None, problems=None,
                           data_sources=None, extra_infos=None, response_ids=None,
                           trainer_state=None, solutions=None, columns=None):
    """score(responses, golds, response_lengths=, truncated=[, problems=, data_sources=,
    extra_infos=, response_ids=, trainer_state=, solutions=, columns=]) -> (rewards [N], info),
    shared out over the processes of a multi-host run (each its share of the per-response
    lists, and trainer_state): each scores a contiguous share of the N responses (the
    sandboxes' and graders' work is split) and every process gets all N rewards and accuracies
    and the summed counts
    num_timeouts / num_no_box / num_errors and REWARD_FNS_KEY's rewards (what training's
    rollout and evaluation keep of info). Every process must pass the same N responses. The
    rewards must be the same on every process (dynamic sampling's rounds and the global batch
    are built from them), and a wall-clock timeout of a grader or a program could otherwise
    land differently on two hosts. One process: score() itself, its whole info."""
    import jax
    count = jax.process_count()
    given = {k: v for k, v in (("problems", problems), ("data_sources", data_sources),
                               ("extra_infos", extra_infos), ("response_ids", response_ids),
                               ("solutions", solutions), ("columns", columns))
             if v is not None}
    whole = {} if trainer_state is None else {"trainer_state": trainer_state}
    if count == 1:
        return score(responses, golds, response_lengths=response_lengths, truncated=truncated,
                     **given, **whole)
    from jax.experimental import multihost_utils
    n = len(responses)
    per = -(-n // count)
    lo, hi = min(jax.process_index() * per, n), min((jax.process_index() + 1) * per, n)
    share_of = lambda x: None if x is None else x[lo:hi]  # noqa: E731
    rewards, info = score(responses[lo:hi], golds[lo:hi],
                          response_lengths=share_of(response_lengths),
                          truncated=share_of(truncated),
                          **{k: share_of(v) for k, v in given.items()}, **whole)
    each = info.get(REWARD_FNS_KEY, {})  # the same functions, in order, on every process
    # (reward, accuracy, each function's reward) of this share, padded to `per`
    share = np.zeros((per, 2 + len(each)), np.float32)
    share[:hi - lo, 0], share[:hi - lo, 1] = rewards, info["accuracy"]
    for f, part in enumerate(each.values()):
        share[:hi - lo, 2 + f] = part
    counts = np.asarray([[info["num_timeouts"], info["num_no_box"], info["num_errors"]]],
                        np.float32)
    share, counts = multihost_utils.process_allgather((share, counts), tiled=True)  # in order
    share, counts = np.asarray(share)[:n], np.asarray(counts).sum(0)
    out = {"accuracy": share[:, 1].copy(), "num_timeouts": int(counts[0]),
           "num_no_box": int(counts[1]), "num_errors": int(counts[2])}
    if each:
        out[REWARD_FNS_KEY] = {name: share[:, 2 + f].copy() for f, name in enumerate(each)}
    return share[:, 0].copy(), out


# ---------------------------------------------------------------------------------------------
# Code: programs run against unit tests (rl/sandbox.py locally, or a SandboxFusion service)
# ---------------------------------------------------------------------------------------------

CODE_SANDBOXES = ("local", "sandbox_fusion")
_SANDBOX_FN = "delta_jax.rl.sandbox:worker_entry"
log = logging.getLogger("delta_jax.rewards")


class IsolationUnavailable(InputError, RuntimeError):
    """The host cannot isolate model-written programs (the message says why and how to opt out)."""


class CodeRunner:
    """The code half of RewardScorer(name="code"): programs from responses, verdicts per batch.

    local: a VerifyPool of sandbox workers (each forks one sandbox per program; see
    rl/sandbox.py). At start one worker probes the isolation; without it the runner refuses to
    start unless isolate=False, which warns on every start. sandbox_fusion: an HTTP client.
    """

    def __init__(self, sandbox: str = "local", num_workers: int = 2, timeout_s: float = 10.0,
                 url: str = "", isolate: bool = True, memory_mb: int = 1024,
                 max_processes: int = 16, pass_fraction: bool = False):
        from delta_jax.rl import sandbox as sb
        if sandbox not in CODE_SANDBOXES:
            raise ValueError(f"rewards.code_sandbox: {sandbox!r} is not one of {CODE_SANDBOXES}")
        self.kind = sandbox
        self.limits = sb.Limits(timeout_s=timeout_s, memory_mb=memory_mb,
                                max_processes=max_processes)
        self.isolate = bool(isolate)
        self.pass_fraction = bool(pass_fraction)
        self.pool = None
        self.client = None
        self.closed = False
        if sandbox == "sandbox_fusion":
            from delta_jax.rl.sandbox_fusion import SandboxFusionClient
            self.client = SandboxFusionClient(url, timeout_s=timeout_s,
                                              concurrency=max(1, num_workers))
            return
        # The sandbox enforces timeout_s itself; the pool's hard limit is only a backstop.
        self.pool = vp.VerifyPool(_SANDBOX_FN, num_workers=num_workers,
                                  timeout_s=timeout_s + 15.0)
        if self.isolate:
            probe = self.pool.map([({"op": "probe"},)])[0]
            ok = probe.status == vp.OK and probe.value["ok"]
            if not ok:
                why = probe.value["why"] if probe.status == vp.OK else probe.value
                self.close()
                raise IsolationUnavailable(
                    f"rewards.code_isolation: this host cannot isolate model-written programs "
                    f"({why}). Run where user namespaces are allowed, use "
                    f"--config.rewards.code_sandbox=sandbox_fusion, or accept running them "
                    f"unisolated with --config.rewards.code_isolation=False")
        else:
            message = ("rewards.code_isolation=False: model-written programs run WITHOUT "
                       "namespaces (no network, filesystem or process isolation; only rlimits, "
                       "a scratch directory and a process-group kill)")
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            log.warning(message)

    def close(self) -> None:
        self.closed = True
        if self.pool is not None:
            self.pool.close()
        if self.client is not None:
            self.client.close()

    def score(self, responses, golds, cache, cache_size):
        """(accuracy f32 [N], timed_out [N], errored [N], cache hits, extra info)."""
        from delta_jax.rl import sandbox as sb
        n = len(responses)
        programs = [sb.extract_program(r) for r in responses]
        has_block = np.array([p is not r for p, r in zip(programs, responses)], bool)
        specs = []
        for i, gold in enumerate(golds):
            try:
                specs.append(sb.parse_spec(gold))
            except sb.SpecError as e:
                raise sb.SpecError(f"score: gold {i}: {e}") from None
        accuracy = np.zeros(n, np.float32)
        timed_out = np.zeros(n, bool)
        errored = np.zeros(n, bool)
        passed = np.zeros(n, np.int32)
        total = np.array([sb.num_tests(sp) for sp in specs], np.int32)
        todo: dict[tuple, list[int]] = {}
        hits = 0
        for i, (program, spec) in enumerate(zip(programs, specs)):
            key = ("code", self.pass_fraction,
                   hashlib.sha256(program.encode("utf-8", "surrogatepass")).hexdigest(),
                   json.dumps(spec, sort_keys=True))
            if key in cache:
                cache.move_to_end(key)
                accuracy[i], passed[i] = cache[key]
                hits += 1
                continue
            todo.setdefault(key, []).append(i)
        keys = list(todo)
        firsts = [todo[k][0] for k in keys]
        if self.client is not None:
            verdicts = self.client.run_many([programs[i] for i in firsts],
                                            [specs[i] for i in firsts], self.pass_fraction)
        else:
            limits = dataclasses.asdict(self.limits)
            results = self.pool.map([({"op": "run", "program": programs[i], "spec": specs[i],
                                       "limits": limits, "isolate": self.isolate,
                                       "pass_fraction": self.pass_fraction},) for i in firsts])
            verdicts = [r.value if r.status == vp.OK else
                        {"status": sb.TIMEOUT if r.status == vp.TIMEOUT else sb.ERROR,
                         "passed": 0, "total": 0, "message": str(r.value)} for r in results]
        statuses = collections.Counter()
        for key, verdict in zip(keys, verdicts):
            status = verdict["status"]
            statuses[status] += 1
            n_total = max(int(verdict.get("total") or 0), 1)
            n_passed = int(verdict.get("passed") or 0)
            if status == sb.OK:
                acc = (n_passed / n_total) if self.pass_fraction else float(n_passed >= n_total)
                # Real verdicts only: timeouts, crashes and sandbox errors are checked again.
                cache[key] = (acc, n_passed)
            else:
                acc = 0.0
            for i in todo[key]:
                accuracy[i], passed[i] = acc, n_passed
                timed_out[i] = status == sb.TIMEOUT
                errored[i] = status in (sb.CRASH, sb.ERROR)
        while len(cache) > cache_size:
            cache.popitem(last=False)
        extra = {"has_code_block": has_block, "tests_passed": passed, "tests_total": total,
                 "num_crashes": int(statuses[sb.CRASH]),
                 "num_sandbox_errors": int(statuses[sb.ERROR]), "num_programs_run": len(keys)}
        return accuracy, timed_out, errored, hits, extra


# ---------------------------------------------------------------------------------------------
# Simple synchronous API
# ---------------------------------------------------------------------------------------------

_default_scorer: RewardScorer | None = None
_default_lock = threading.Lock()


def _get_default_scorer() -> RewardScorer:
    global _default_scorer
    with _default_lock:
        if _default_scorer is None or _default_scorer.closed:
            # One worker started on first use; closed at exit by the pool's atexit hook.
            _default_scorer = RewardScorer("math", num_workers=1)
        return _default_scorer


def math_reward(response_text: str, gold_answer: str) -> float:
    """1.0 if the last \\boxed{} of `response_text` is equivalent to `gold_answer`, else 0.0.

    Safe from any thread: verification runs in a shared one-worker pool (started on first use)
    with a timeout; a timeout or error scores 0.0.
    """
    answer = extract_last_boxed(response_text)
    if answer is None:
        return 0.0
    accuracy, _, _, _ = _get_default_scorer().correctness([answer], [gold_answer])
    return float(accuracy[0])


_default_code_scorers: dict[bool, RewardScorer] = {}


def code_reward(response_text: str, spec, pass_fraction: bool = False) -> float:
    """1.0 if the program in `response_text` passes every test of `spec` (a dict or its JSON
    string; layouts in rl/sandbox.py), else 0.0; with pass_fraction, the fraction passed.

    The program is the last fenced ```python block (the whole response when there is none). Runs
    in a shared one-worker sandbox pool started on first use (safe from any thread); a timeout
    or crash scores 0.0. Raises IsolationUnavailable where the host cannot isolate programs.
    """
    with _default_lock:
        scorer = _default_code_scorers.get(pass_fraction)
        if scorer is None or scorer.closed:
            scorer = RewardScorer("code", num_workers=1, pass_fraction=pass_fraction)
            _default_code_scorers[pass_fraction] = scorer
    rewards, _ = scorer.score([response_text], [spec])
    return float(rewards[0])
