"""Read math and code problem records from local JSONL / parquet files (or a hub data set).

Every record comes out in the project's layout::

    {"id": str, "problem": str, "answer": str, "solution": str, "level": int,
     "data_source": str, "extra_info": str, "columns": str}

(`solution` is "" and `level` is -1 when the source has none). `data_source` and `extra_info` are
context for a reward of the user's own (rewards.python_fn): the row's own columns of those names
(verl's layout: the data set's name, and per-row metadata, any JSON value) or the keys a custom
mapping names for them; data_source as text, extra_info as JSON text, "" when there is none.
`columns` holds the row's own top-level columns that a reward asks for by name (`columns=`:
{name: required}; TRL gives its reward functions a data set's columns by keyword), as the JSON
text of {name: value} with the names the row has ("" when none is asked for); a row without a
required one is malformed.
Upstream layouts differ, so a field mapping picks the keys; the presets cover the data sets we
train on:

    deltajax   {"id", "problem", "answer"}   (our own JSONL, ../shared/data, the synthetic task)
    deepmath   DeepMath-103K: "question" / "final_answer"
    dapo       verl's RL parquet layout (DAPO-Math-17k, verl's preprocessed GSM8K / MATH ...):
               "prompt" (a chat list; the last user turn, with DAPO's "Answer:" instruction
               stripped) / "reward_model"."ground_truth"
    trl        TRL's prompt-only layout: "prompt" (text, or a chat list: its last user turn) /
               the first of "answer", "ground_truth", "solution" it has (a "solution" with a
               \\boxed{}: that box's content, the solution kept as the record's)
    math       MATH: "problem" / the last \\boxed{} of "solution" (or an "answer" field)

Code sets (the "answer" is the unit-test spec as a JSON string, rl/sandbox.py's layouts, scored by
RewardScorer(name="code")):

    humaneval     "prompt", "entry_point", "test" (HumanEval, ../shared/data/humaneval.jsonl)
    mbpp          "text", "test_list"[, "test_setup_code"] (MBPP-style assert lists)
    taco          "question", "input_output" (TACO / APPS: stdin/stdout or fn_name call tests)
    codecontests  "description", "public_tests" / "private_tests" {"input", "output"}

`fields="auto"` picks a preset per file from the keys of its first row. A custom mapping is a dict
{"problem": key, "answer": key, ["id": key], ["solution": key], ["level": key],
["data_source": key], ["extra_info": key]} where a key may be
dotted ("reward_model.ground_truth") to reach into nested objects; an answer that is a JSON list
or object there (several answers, a task's tests) is kept as its JSON text, for a reward of the
user's own (rewards.python_fn) to json.loads.

Malformed rows (bad JSON, a missing or empty field, no \\boxed{} in a MATH solution) raise a
`MalformedRecordError` naming the file and the row (1-based line number for JSONL, 1-based row
number for parquet), or with on_error="skip" are skipped and counted in `LoadStats`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import pathlib
import re
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from delta_jax.errors import InputError, MissingInputError, first_line
from delta_jax.rl.rewards import extract_last_boxed

RECORD_KEYS = ("id", "problem", "answer", "solution", "level", "data_source", "extra_info")
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")

# DAPO-Math-17k wraps every problem in this instruction; our own templates ask for \boxed{}.
_DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
_DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


class MalformedRecordError(InputError):
    """A row that cannot be turned into a record; the message names the file and the row."""


# What the messages advise: the run's config fields (train/config.py data.on_error, data.fields)
# and the same-named arguments of load_records / builders.build_tfds_source.
ON_ERROR_ADVICE = ("to skip malformed rows: --config.data.on_error=skip "
                   "(on_error='skip' in Python)")
FIELDS_ADVICE = ("set --config.data.fields=<preset>, one of {presets}, or a JSON object "
                 "mapping record keys to source keys, e.g. "
                 "--config.data.fields='{{\"problem\": \"question\", \"answer\": "
                 "\"final_answer\"}}' (fields= in Python)")


@dataclasses.dataclass
class LoadStats:
    """What happened while reading: rows read, records kept, rows skipped (with reasons)."""

    num_rows: int = 0
    num_records: int = 0
    num_skipped: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)  # "file:row: reason", first 100
    layouts: dict[str, str] = dataclasses.field(default_factory=dict)  # file -> preset used

    def add_skip(self, where: str, reason: str) -> None:
        self.num_skipped += 1
        if len(self.skipped) < 100:
            self.skipped.append(f"{where}: {reason}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "LoadStats":
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


# --------------------------------------------------------------------------------------------
# \boxed{} extraction (MATH solutions)


# One implementation, shared with the reward: the gold answer of a MATH solution is read the
# same way as a model's answer. `last_boxed` is this module's (and delta_jax.data's) public name.
last_boxed = extract_last_boxed


# --------------------------------------------------------------------------------------------
# Field mapping


def _get(row: Mapping[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _text(value: Any, key: str) -> str:
    """Answers may be numbers upstream (e.g. 27.0): keep them as the string a grader compares."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"field {key!r} is {value!r}, expected a string")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, float)):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"field {key!r} has type {type(value).__name__}, expected a string")
    if not value.strip():
        raise ValueError(f"field {key!r} is empty")
    return value


def _last_user_turn(prompt: Any) -> str:
    """The content of the last user turn of a chat-list "prompt" field."""
    if hasattr(prompt, "tolist"):  # parquet list columns come back as numpy arrays
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError("field 'prompt' is not a non-empty chat list")
    users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
    if not users:
        raise ValueError("field 'prompt' has no user message")
    return _text(users[-1].get("content"), "prompt[-1].content")


def _dapo_problem(prompt: Any) -> str:
    """The last user turn of a DAPO chat prompt, without DAPO's "Answer:" instruction."""
    content = _last_user_turn(prompt)
    if content.startswith(_DAPO_PREFIX):
        content = content[len(_DAPO_PREFIX) :]
    if content.endswith(_DAPO_SUFFIX):
        content = content[: -len(_DAPO_SUFFIX)]
    return content


def _level(value: Any) -> int:
    if value is None:
        return -1
    if isinstance(value, int):
        return value
    match = re.search(r"-?\d+", str(value))  # MATH writes "Level 3"
    return int(match.group()) if match else -1


RowMapper = Callable[[Mapping[str, Any]], dict]


def _map_deltajax(row):
    return {
        "id": row.get("id"),
        "problem": _text(_get(row, "problem"), "problem"),
        "answer": _text(_get(row, "answer"), "answer"),
        "solution": row.get("solution") or "",
        "level": _level(row.get("level")),
    }


def _map_deepmath(row):
    return {
        "id": row.get("id"),
        "problem": _text(_get(row, "question"), "question"),
        "answer": _text(_get(row, "final_answer"), "final_answer"),
        "solution": row.get("r1_solution_1") or "",
        "level": _level(row.get("difficulty")),
    }


def _map_dapo(row):
    extra = row.get("extra_info")
    row_id = extra.get("index") if isinstance(extra, Mapping) else None
    return {
        "id": None if row_id is None else str(row_id),
        "problem": _dapo_problem(_get(row, "prompt")),
        "answer": _text(_get(row, "reward_model.ground_truth"), "reward_model.ground_truth"),
        "solution": "",
        "level": -1,
    }


# TRL's prompt-only data sets: a "prompt" (text, or a chat list in TRL's conversational form)
# and the column its reward functions read the answer from, the first of these a row has.
TRL_ANSWER_KEYS = ("answer", "ground_truth", "solution")


def _map_trl(row):
    prompt = _get(row, "prompt")
    key = next((k for k in TRL_ANSWER_KEYS if row.get(k) not in (None, "")), None)
    if key is None:
        raise ValueError(f"no answer: none of the fields {', '.join(TRL_ANSWER_KEYS)} has one")
    value, solution = row[key], ""
    boxed = last_boxed(value) if key == "solution" and isinstance(value, str) else None
    if boxed is not None:  # a worked solution: its last \boxed{} is the answer
        if not boxed.strip():
            raise ValueError("field 'solution' has an empty \\boxed{} answer")
        solution, answer = value, boxed
    else:
        answer = _answer_text(value, key)
    return {
        "id": row.get("id"),
        "problem": _text(prompt, "prompt") if isinstance(prompt, str) else _last_user_turn(prompt),
        "answer": answer,
        "solution": solution,
        "level": _level(row.get("level")),
    }


def _map_math(row):
    solution = row.get("solution")
    if row.get("answer") not in (None, ""):
        answer = _text(row["answer"], "answer")
    else:
        solution_text = _text(_get(row, "solution"), "solution")
        answer = last_boxed(solution_text)
        if not answer or not answer.strip():
            raise ValueError("field 'solution' has no non-empty \\boxed{} answer")
    return {
        "id": row.get("unique_id") or row.get("id"),
        "problem": _text(_get(row, "problem"), "problem"),
        "answer": answer,
        "solution": solution if isinstance(solution, str) else "",
        "level": _level(row.get("level")),
    }


# --------------------------------------------------------------------------------------------
# Code layouts: the record's "answer" is the test spec as a JSON string (see rl/sandbox.py), so
# code records travel through the same tfds/grain path and reach RewardScorer(name="code") as
# the gold.


def _spec_json(spec: dict) -> str:
    from delta_jax.rl import sandbox  # stdlib only; checks the layout

    try:
        sandbox.parse_spec(spec)
        return json.dumps(spec, sort_keys=True)
    except sandbox.SpecError as e:
        raise ValueError(str(e)) from None


def _json_field(value: Any, key: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"field {key!r} is not JSON ({e.msg} at column {e.colno})") from None
    return value


def _map_humaneval(row):
    prompt = _text(_get(row, "prompt"), "prompt")
    spec = {"prompt": prompt, "entry_point": _text(_get(row, "entry_point"), "entry_point"),
            "test": _text(_get(row, "test"), "test")}
    return {
        "id": row.get("id") or row.get("task_id"),
        "problem": f"Complete the following Python function.\n\n```python\n{prompt}```",
        "answer": _spec_json(spec),
        "solution": row.get("canonical_solution") or "",
        "level": -1,
    }


def _map_mbpp(row):
    tests = _get(row, "test_list")
    if hasattr(tests, "tolist"):
        tests = tests.tolist()
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError("field 'test_list' is not a non-empty list of asserts")
    text = _text(row.get("text") or row.get("prompt"), "text")
    spec = {"tests": list(tests), "setup": row.get("test_setup_code") or ""}
    return {
        "id": None if row.get("task_id") is None else str(row["task_id"]),
        "problem": f"{text}\nYour code should pass these tests:\n\n" + "\n".join(tests),
        "answer": _spec_json(spec),
        "solution": row.get("code") or "",
        "level": -1,
    }


def _stdio_lines(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value) + "\n"
    return str(value)


def _map_taco(row):
    """TACO / APPS: "question", "input_output" (JSON {"inputs", "outputs"[, "fn_name"]}),
    optional "starter_code"."""
    io = _json_field(_get(row, "input_output"), "input_output")
    if not isinstance(io, Mapping) or not io.get("inputs"):
        raise ValueError("field 'input_output' has no test inputs")
    if io.get("fn_name"):
        spec = {"fn_name": io["fn_name"], "inputs": list(io["inputs"]),
                "outputs": list(io["outputs"])}
    else:
        spec = {"inputs": [_stdio_lines(v) for v in io["inputs"]],
                "outputs": [_stdio_lines(v) for v in io["outputs"]]}
    question = _text(_get(row, "question"), "question")
    starter = row.get("starter_code") or ""
    if starter:
        question += f"\n\nStart from:\n```python\n{starter}\n```"
    return {
        "id": row.get("id") or row.get("problem_id"),
        "problem": question,
        "answer": _spec_json(spec),
        "solution": "",
        "level": _level(row.get("difficulty")),
    }


def _map_codecontests(row):
    """CodeContests: "description" and public/private/generated test dicts {"input", "output"}
    (public and private tests are used; generated ones only when there are no others)."""
    inputs, outputs = [], []
    for key in ("public_tests", "private_tests"):
        tests = row.get(key) or {}
        inputs += list(tests.get("input") or [])
        outputs += list(tests.get("output") or [])
    if not inputs:
        tests = row.get("generated_tests") or {}
        inputs, outputs = list(tests.get("input") or []), list(tests.get("output") or [])
    if not inputs:
        raise ValueError("the row has no test cases (public_tests / private_tests)")
    return {
        "id": row.get("name") or row.get("id"),
        "problem": _text(_get(row, "description"), "description"),
        "answer": _spec_json({"inputs": inputs, "outputs": outputs}),
        "solution": "",
        "level": _level(row.get("difficulty")),
    }


PRESETS: dict[str, RowMapper] = {
    "deltajax": _map_deltajax,
    "deepmath": _map_deepmath,
    "dapo": _map_dapo,
    "trl": _map_trl,
    "math": _map_math,
    "humaneval": _map_humaneval,
    "mbpp": _map_mbpp,
    "taco": _map_taco,
    "codecontests": _map_codecontests,
}
CODE_PRESETS = ("humaneval", "mbpp", "taco", "codecontests")


def detect_layout(row: Mapping[str, Any]) -> str:
    """The preset whose keys the row has; raises ValueError when none fits."""
    keys = set(row)
    if {"prompt", "entry_point", "test"} <= keys:
        return "humaneval"
    if "test_list" in keys:
        return "mbpp"
    if "question" in keys and "input_output" in keys:
        return "taco"
    if "description" in keys and ({"public_tests", "private_tests"} & keys):
        return "codecontests"
    if "question" in keys and "final_answer" in keys:
        return "deepmath"
    if "prompt" in keys and "reward_model" in keys:
        return "dapo"
    if "prompt" in keys and "problem" not in keys and keys & set(TRL_ANSWER_KEYS):
        return "trl"
    if "problem" in keys and "answer" in keys:
        return "deltajax"
    if "problem" in keys and "solution" in keys:
        return "math"
    raise ValueError(
        f"cannot tell the layout from the keys {sorted(keys)}; {FIELDS_ADVICE.format(presets=sorted(PRESETS))}"
    )


def parse_fields(fields: str | Mapping[str, str]) -> str | Mapping[str, str]:
    """The `fields` option as given in Python or on the command line (data.fields): "auto", a
    preset name, a mapping, or a mapping written as a JSON object string."""
    if isinstance(fields, Mapping):
        return fields
    if not isinstance(fields, str):
        raise InputError(f"data.fields: expected a preset name or a JSON object, got "
                         f"{type(fields).__name__} {fields!r}")
    text = fields.strip()
    if text.startswith("{"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"data.fields: not a preset name or a JSON object ({e.msg} at "
                             f"column {e.colno}): {fields!r}") from None
        if not isinstance(mapping, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
            raise InputError(f"data.fields: the JSON object must map record keys to source key "
                             f"strings, got {fields!r}")
        return mapping
    if text != "auto" and text not in PRESETS:
        raise InputError(f"data.fields: unknown preset {fields!r}; known: 'auto', "
                         f"{sorted(PRESETS)}, or a JSON object mapping record keys to source keys")
    return text


def _answer_text(value: Any, key: str) -> str:
    """A custom mapping's answer: text as _text keeps it, or a JSON list / object (a ground
    truth of several answers, a code task's tests, verl's reward_model.ground_truth) as its JSON
    text, which a rewards.python_fn reads back with json.loads."""
    if isinstance(value, (list, dict)):
        if not value:
            raise ValueError(f"field {key!r} is empty")
        return json.dumps(value, ensure_ascii=False)
    return _text(value, key)


# Per-row context for a reward of the user's own (rewards.USER_REWARD_KEYWORDS), kept as text:
# the row's own column of that name (verl's layout has both), or the key a custom mapping names.
DATA_SOURCE, EXTRA_INFO = "data_source", "extra_info"


def extra_info_text(value: Any, key: str = EXTRA_INFO) -> str:
    """The record's extra_info: the JSON text of a row's value ("" for None / absent), so every
    record keeps one string field whatever the source holds there; a value JSON cannot hold is
    a ValueError naming `key`."""
    if value is None:
        return ""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, default=_json_plain)
    except (TypeError, ValueError) as e:
        raise ValueError(f"field {key!r} is not a JSON value ({e})") from None


def data_source_text(value: Any, key: str = DATA_SOURCE) -> str:
    """The record's data_source: a row's string (or number) as text, "" for None / absent."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"field {key!r} has type {type(value).__name__}, expected a string")
    return str(value)


CONTEXT_FIELDS = {DATA_SOURCE: data_source_text, EXTRA_INFO: extra_info_text}

# The record field holding the row's columns a reward takes by name (columns_text).
COLUMNS = "columns"
COLUMNS_WHY = "a column the reward takes by name (rewards.python_fn, rewards.python_columns)"


def columns_text(row: Mapping[str, Any], columns: Mapping[str, bool] | None) -> str:
    """The record's `columns`: the JSON text of {name: the row's value} for the names of
    `columns` ({name: required}) that the row has (a value of None counts as absent), "" for no
    names; ValueError for a required name the row lacks or a value JSON cannot hold, naming
    it."""
    if not columns:
        return ""
    kept = {}
    for name, required in columns.items():
        value = row.get(name)
        if value is None:
            if required:
                raise ValueError(f"missing field {name!r}, {COLUMNS_WHY}{_fields_of(row)}")
            continue
        kept[name] = value
    try:
        return json.dumps(kept, ensure_ascii=False, allow_nan=False, default=_json_plain)
    except (TypeError, ValueError) as e:
        raise ValueError(f"a field of {sorted(kept)} is not a JSON value ({e}), "
                         f"{COLUMNS_WHY}") from None


def decode_columns(text: str) -> dict:
    """A record's `columns` text back to {name: value} ({} for "")."""
    return json.loads(text) if text else {}


def _json_plain(value: Any) -> Any:
    """json.dumps' default for the numpy values a parquet or datasets row may hold."""
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def decode_extra_info(text: str) -> Any:
    """A record's extra_info text back to its value (None for "")."""
    return json.loads(text) if text else None


def _custom_mapper(fields: Mapping[str, str]) -> RowMapper:
    unknown = set(fields) - set(RECORD_KEYS)
    if unknown or "problem" not in fields or "answer" not in fields:
        raise InputError(
            f"data.fields: a mapping needs 'problem' and 'answer' and only keys from "
            f"{RECORD_KEYS}; got {dict(fields)}"
        )

    def mapper(row):
        def optional(name, default):
            if name not in fields:
                return default
            try:
                return _get(row, fields[name])
            except KeyError:
                return default

        record = {
            "id": optional("id", None),
            "problem": _text(_get(row, fields["problem"]), fields["problem"]),
            "answer": _answer_text(_get(row, fields["answer"]), fields["answer"]),
            "solution": optional("solution", "") or "",
            "level": _level(optional("level", None)),
        }
        for name, as_text in CONTEXT_FIELDS.items():  # else the row's own column, as for a preset
            if name in fields:
                record[name] = as_text(optional(name, None), fields[name])
        return record

    return mapper


def _resolve_mapper(fields: str | Mapping[str, str], first_row: Mapping[str, Any]) -> tuple[str, RowMapper]:
    fields = parse_fields(fields)
    if isinstance(fields, Mapping):
        return "custom", _custom_mapper(fields)
    if fields == "auto":
        fields = detect_layout(first_row)
    return fields, PRESETS[fields]


# --------------------------------------------------------------------------------------------
# Raw rows


def _utf8_error(e: UnicodeDecodeError, data: bytes, lines: bool = False) -> str:
    """'not valid UTF-8 (byte 0xe9 at [line L, ]column C)', 1-based, columns in bytes."""
    NEWLINE = b"\n"
    line_start = data.rfind(NEWLINE, 0, e.start) + 1
    where = f"column {e.start - line_start + 1}"
    if lines:
        where = f"line {data.count(NEWLINE, 0, e.start) + 1}, {where}"
    return f"not valid UTF-8 (byte 0x{data[e.start]:02x} at {where}); re-encode the file as UTF-8"


def _iter_jsonl(path: str) -> Iterator[tuple[str, Mapping[str, Any] | Exception]]:
    """(where, row or the parse error) per non-blank line; `where` is "file:line N" (1-based)."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, ValueError(_utf8_error(e, raw))
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield where, ValueError(f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(row, dict):
                yield where, ValueError(f"expected a JSON object, got {type(row).__name__}")
                continue
            yield where, row


def _iter_json_array(path: str):
    with open(path, "rb") as f:
        data = f.read()
    try:
        rows = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise MalformedRecordError(f"{path}: {_utf8_error(e, data, lines=True)}") from None
    except json.JSONDecodeError as e:
        raise MalformedRecordError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(rows, list):
        raise MalformedRecordError(f"{path}: a .json file must hold a list of objects")
    for i, row in enumerate(rows, start=1):
        where = f"{path}:item {i}"
        yield where, row if isinstance(row, dict) else ValueError("expected a JSON object")


def _iter_parquet(path: str):
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    row_no = 0
    for batch in table.to_batches(max_chunksize=1024):
        for row in batch.to_pylist():
            row_no += 1
            yield f"{path}:row {row_no}", row


def iter_rows(path: str):
    """(where, raw row dict or an Exception) for every row of one local file."""
    suffix = pathlib.Path(path).suffix.lower()
    if suffix == ".jsonl":
        return _iter_jsonl(path)
    if suffix == ".json":
        return _iter_json_array(path)
    if suffix == ".parquet":
        return _iter_parquet(path)
    raise InputError(f"{path}: unsupported file type {suffix!r}; expected one of {SUPPORTED_SUFFIXES}")


def _fields_of(row, limit: int = 12) -> str:
    """" (the row's fields: a, b, ...)" of a row dict, to put beside a field it lacks."""
    if not isinstance(row, Mapping) or not row:
        return ""
    names = sorted(map(str, row))
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f" (the row's fields: {', '.join(names[:limit])}{more})"


def records_from_rows(
    rows: Iterable[tuple[str, Mapping[str, Any] | Exception]],
    *,
    fields: str | Mapping[str, str] = "auto",
    on_error: str = "raise",
    id_prefix: str = "row",
    stats: LoadStats | None = None,
    layout_key: str = "",
    columns: Mapping[str, bool] | None = None,
) -> list[dict]:
    """Map raw rows to records (see the module docstring); errors name `where`. columns: the
    row's own columns each record keeps ({name: required}, columns_text)."""
    if on_error not in ("raise", "skip"):
        raise InputError(f"data.on_error: must be 'raise' or 'skip', got {on_error!r}")
    fields = parse_fields(fields)
    stats = stats if stats is not None else LoadStats()
    mapper = None
    out = []
    for index, (where, row) in enumerate(rows):
        stats.num_rows += 1
        if mapper is None and not isinstance(row, Exception):
            try:
                layout, mapper = _resolve_mapper(fields, row)
            except ValueError as e:
                if on_error == "raise":  # a layout question, not a bad row: no skip advice
                    raise MalformedRecordError(f"{where}: {e}") from e
                stats.add_skip(where, str(e))
                continue
            stats.layouts[layout_key or where.rsplit(":", 1)[0]] = layout
        try:
            if isinstance(row, Exception):
                raise row
            record = mapper(row)
            for name, as_text in CONTEXT_FIELDS.items():  # the row's own column of that name
                if name not in record:
                    record[name] = as_text(row.get(name))
            record[COLUMNS] = columns_text(row, columns)
        except (KeyError, ValueError, TypeError) as e:
            reason = (f"missing field {e.args[0]!r}{_fields_of(row)}" if isinstance(e, KeyError)
                      else str(e))
            if on_error == "raise":
                raise MalformedRecordError(f"{where}: {reason} ({ON_ERROR_ADVICE})") from e
            stats.add_skip(where, reason)
            continue
        record["id"] = str(record["id"]) if record["id"] not in (None, "") else f"{id_prefix}-{index}"
        out.append(record)
    stats.num_records += len(out)
    return out


# --------------------------------------------------------------------------------------------
# Public entry point


def resolve_paths(path_or_paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Local files for a file, a directory (its supported files), a glob, or a list of those.

    Returns [] when nothing local matches a single string (it may be a hub name).
    """
    if isinstance(path_or_paths, (str, os.PathLike)):
        items = [os.fspath(path_or_paths)]
    else:
        items = [os.fspath(p) for p in path_or_paths]
    files: list[str] = []
    for item in items:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, f)
                for f in os.listdir(item)
                if f.lower().endswith(SUPPORTED_SUFFIXES)
            )
            if not found:
                raise MissingInputError(f"{item}: directory has no {SUPPORTED_SUFFIXES} files")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        elif glob.has_magic(item):
            found = sorted(glob.glob(item))
            if not found:
                raise MissingInputError(f"{item}: the pattern matches no file")
            files += found
        elif len(items) > 1:
            raise MissingInputError(f"{item}: no such file")
    return files


def looks_like_hub_name(name: str) -> bool:
    """"org/name" (optionally "org/name:split") that is not a local path."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.\[\]%:-]+)?", name)) and not os.path.exists(name)


def load_records(
    path_or_name: str | os.PathLike | Sequence[str | os.PathLike],
    fields: str | Mapping[str, str] = "auto",
    on_error: str = "raise",
    split: str = "train",
    columns: Mapping[str, bool] | None = None,
) -> tuple[list[dict], LoadStats]:
    """Records {"id","problem","answer","solution","level","data_source","extra_info","columns"}
    and LoadStats from files or a hub name.

    Args:
      path_or_name: a .jsonl / .json / .parquet file, a directory, a glob, a list of those, or a
        Hugging Face hub data set name "org/name" (needs the network; `split` picks the split).
      fields: "auto" (per file, from the first row's keys), a preset name from PRESETS, or a dict
        mapping record keys to (dotted) source keys.
      on_error: "raise" (MalformedRecordError naming file and row) or "skip" (count in stats).
      columns: {name: required}: the row's own columns each record keeps (its "columns" field).
    """
    stats = LoadStats()
    files = resolve_paths(path_or_name)
    if not files:
        name = os.fspath(path_or_name)  # type: ignore[arg-type]
        if isinstance(path_or_name, (str, os.PathLike)) and looks_like_hub_name(name):
            return load_hub_records(name, fields=fields, on_error=on_error, split=split,
                                    columns=columns)
        raise MissingInputError(f"{name}: no such file, directory or glob (and not an org/name hub id)")
    records: list[dict] = []
    for path in files:
        records += records_from_rows(
            iter_rows(path),
            fields=fields,
            on_error=on_error,
            id_prefix=pathlib.Path(path).stem,
            stats=stats,
            layout_key=path,
            columns=columns,
        )
    return records, stats


def load_hub_records(
    name: str, fields: str | Mapping[str, str] = "auto", on_error: str = "raise",
    split: str = "train", columns: Mapping[str, bool] | None = None,
) -> tuple[list[dict], LoadStats]:
    """Records from a Hugging Face hub data set (network or a warm hub cache needed).

    Uses the `datasets` library when installed, else downloads the repository's parquet / JSONL
    files with huggingface_hub and reads them like local files. A data set that cannot be fetched
    (no network, HF_HUB_OFFLINE=1 without a cached copy, no such repository, a gated one) is a
    MissingInputError naming it, with the library's error as its cause.
    """
    if ":" in name:
        name, split = name.split(":", 1)
    stats = LoadStats()
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        datasets = None
    if datasets is not None:
        with _fetching(name):
            ds = datasets.load_dataset(name, split=split)
        rows = ((f"{name}[{split}]:row {i + 1}", row) for i, row in enumerate(ds))
        records = records_from_rows(
            rows, fields=fields, on_error=on_error, id_prefix=name.split("/")[-1], stats=stats,
            layout_key=name, columns=columns,
        )
        return records, stats
    try:
        import huggingface_hub
    except ImportError as e:
        raise ImportError(
            f"loading the hub data set {name!r} needs `datasets` or `huggingface_hub` installed"
        ) from e
    with _fetching(name):
        local = huggingface_hub.snapshot_download(
            repo_id=name, repo_type="dataset", allow_patterns=["*.parquet", "*.jsonl"]
        )
    files = sorted(
        p for p in glob.glob(os.path.join(local, "**", "*"), recursive=True)
        if p.lower().endswith((".parquet", ".jsonl"))
    )
    # Files named after the split when the repository has several splits; else all of them.
    split_files = [p for p in files if split in pathlib.Path(p).relative_to(local).as_posix()]
    files = split_files or files
    if not files:
        raise MissingInputError(f"hub data set {name!r} has no parquet/JSONL files for split {split!r}")
    return load_records(files, fields=fields, on_error=on_error, columns=columns)


@contextlib.contextmanager
def _fetching(name: str):
    """Turns a hub library's failure to fetch data set `name` into a MissingInputError."""
    try:
        yield
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 -- datasets / huggingface_hub raise many types
        raise MissingInputError(
            f"hub data set {name!r} could not be fetched ({first_line(e)}); it needs "
            "the network or a copy in the hub cache (HF_HOME), or pass local JSONL / parquet "
            "files instead") from e
