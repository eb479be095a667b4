"""Record readers (field mapping, malformed rows) and the tfds ArrayRecord builder without TF."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from delta_jax.data import builders, records
from delta_jax.errors import MissingInputError
from tests.rl_fixtures import python_path


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


# ------------------------------------------------------------------ field mapping


def test_own_layout_keeps_fields_and_order(tmp_path):
    rows = [{"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1), "level": 2} for i in range(5)]
    recs, stats = records.load_records(write_jsonl(tmp_path / "own.jsonl", rows))
    assert [r["id"] for r in recs] == [f"q{i}" for i in range(5)]
    assert recs[3] == {"id": "q3", "problem": "What is 3 + 1?", "answer": "4", "solution": "",
                       "level": 2, "data_source": "", "extra_info": "", "columns": ""}
    assert stats.num_rows == 5 and stats.num_records == 5 and stats.num_skipped == 0
    assert list(stats.layouts.values()) == ["deltajax"]


def test_deepmath_layout(tmp_path):
    rows = [
        {"question": "Evaluate $\\int_0^1 x\\,dx$.", "final_answer": "\\frac{1}{2}", "difficulty": 4.5,
         "topic": "Calculus", "r1_solution_1": "... \\boxed{\\frac{1}{2}}"},
        {"question": "Is 7 prime?", "final_answer": "Yes", "difficulty": 1.0},
    ]
    recs, stats = records.load_records(write_jsonl(tmp_path / "deepmath.jsonl", rows))
    assert stats.layouts[str(tmp_path / "deepmath.jsonl")] == "deepmath"
    assert recs[0]["problem"] == rows[0]["question"] and recs[0]["answer"] == "\\frac{1}{2}"
    assert recs[0]["level"] == 4 and recs[1]["answer"] == "Yes"
    assert recs[1]["id"] == "deepmath-1"  # no id upstream: file stem + row index


def test_dapo_layout_parquet_strips_instruction(tmp_path):
    wrap = (
        "Solve the following math problem step by step. The last line of your response should be "
        "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
        "\n\n{}\n\nRemember to put your answer on its own line after \"Answer:\"."
    )
    problems = ["Find $x$ if $2x = 10$.", "How many primes are below 10?"]
    table = pa.table({
        "data_source": ["math_dapo"] * 2,
        "prompt": [[{"role": "user", "content": wrap.format(p)}] for p in problems],
        "reward_model": [{"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
                         {"ground_truth": "4", "style": "rule-lighteval/MATH_v2"}],
        "extra_info": [{"index": "a1b2"}, {"index": "c3d4"}],
    })
    path = tmp_path / "dapo.parquet"
    pq.write_table(table, path)
    recs, stats = records.load_records(path)
    assert stats.layouts[str(path)] == "dapo"
    assert [r["problem"] for r in recs] == problems
    assert [r["answer"] for r in recs] == ["5", "4"]
    assert [r["id"] for r in recs] == ["a1b2", "c3d4"]
    # verl's layout: its data_source and extra_info columns are the records' context fields
    assert [r["data_source"] for r in recs] == ["math_dapo"] * 2
    assert [json.loads(r["extra_info"]) for r in recs] == [{"index": "a1b2"}, {"index": "c3d4"}]


def test_trl_prompt_only_layout_in_both_forms(tmp_path):
    """TRL's prompt-only data sets: "prompt" as text or as a chat list (conversational: the last
    user turn, system turns dropped), the answer from "answer", "ground_truth" or "solution" (a
    worked solution's last \\boxed{}, the solution kept); parquet lists; the row named when it has
    no answer or an empty box; a row that has "problem" too keeps the deltajax layout."""
    rows = [
        {"prompt": "What is 2 + 3?", "solution": "5"},
        {"prompt": [{"role": "system", "content": "Think first."},
                    {"role": "user", "content": "Halve 1."}], "ground_truth": 0.5},
        {"prompt": [{"role": "user", "content": "Square 3."}],
         "solution": "3 times 3 is \\boxed{9}.", "answer": ""},
        {"prompt": "Which primes are below 5?", "answer": ["2", "3"], "id": "p"},
    ]
    recs, stats = records.load_records(write_jsonl(tmp_path / "trl.jsonl", rows))
    assert list(stats.layouts.values()) == ["trl"]
    assert [r["problem"] for r in recs] == ["What is 2 + 3?", "Halve 1.", "Square 3.",
                                            "Which primes are below 5?"]
    assert [r["answer"] for r in recs] == ["5", "0.5", "9", '["2", "3"]']
    assert [r["solution"] for r in recs] == ["", "", "3 times 3 is \\boxed{9}.", ""]
    assert recs[3]["id"] == "p"
    table = pa.table({"prompt": [[{"role": "user", "content": "One?"}]], "solution": ["1"],
                      "data_source": ["trl-lib"]})
    pq.write_table(table, tmp_path / "trl.parquet")
    recs, stats = records.load_records(tmp_path / "trl.parquet")
    assert (recs[0]["problem"], recs[0]["answer"], recs[0]["data_source"]) == ("One?", "1",
                                                                                "trl-lib")
    assert list(stats.layouts.values()) == ["trl"]
    for bad, why in (({"prompt": "p", "solution": "so \\boxed{ }"}, "empty \\\\boxed"),
                     ({"prompt": [{"role": "system", "content": "s"}], "answer": "1"},
                      "no user message"),
                     ({"prompt": "p", "answer": "", "solution": None, "ground_truth": 1},
                      None)):
        path = write_jsonl(tmp_path / "bad.jsonl", [bad])
        if why is None:  # the first non-empty answer column
            assert records.load_records(path)[0][0]["answer"] == "1"
            continue
        with pytest.raises(records.MalformedRecordError, match=f"bad.jsonl:line 1: .*{why}"):
            records.load_records(path)
    with pytest.raises(records.MalformedRecordError, match="no answer: none of the fields"):
        records.load_records(write_jsonl(tmp_path / "none.jsonl",
                                         [{"prompt": "p", "answer": None, "solution": ""}]))
    assert records.detect_layout({"prompt": "p", "problem": "q", "answer": "1"}) == "deltajax"


def test_math_layout_answer_is_last_boxed_or_answer_field(tmp_path):
    rows = [
        {"problem": "p1", "solution": "First \\boxed{1}, finally $\\boxed{\\frac{a}{b^{2}}}$.", "level": "Level 3"},
        {"problem": "p2", "solution": "So the answer is \\boxed 9.", "level": "Level ?"},
        {"problem": "p3", "solution": "text \\boxed{wrong}", "answer": "right"},
    ]
    recs, _ = records.load_records(write_jsonl(tmp_path / "math.jsonl", rows), fields="math")
    assert [r["answer"] for r in recs] == ["\\frac{a}{b^{2}}", "9", "right"]
    assert [r["level"] for r in recs] == [3, -1, -1]
    assert recs[0]["solution"] == rows[0]["solution"]


def test_custom_dotted_mapping(tmp_path):
    rows = [{"uid": 7, "q": {"text": "2+2?"}, "meta": {"gold": 4}}]
    recs, _ = records.load_records(
        write_jsonl(tmp_path / "c.jsonl", rows), fields={"id": "uid", "problem": "q.text", "answer": "meta.gold"}
    )
    assert recs == [{"id": "7", "problem": "2+2?", "answer": "4", "solution": "", "level": -1,
                     "data_source": "", "extra_info": "", "columns": ""}]


def test_context_fields_from_the_rows_columns_or_a_mapping(tmp_path):
    """data_source and extra_info (a reward's context): a row's own columns of those names under
    any layout, or the (dotted) keys a custom mapping names for them; extra_info as JSON text of
    any JSON value, "" where a row has none; a value they cannot hold is a malformed row naming
    the key."""
    meta = {"targets": ["a", "b"], "weights": [0.5, 1.0], "nested": {"k": None}}
    rows = [{"problem": "p0", "answer": "1", "data_source": "gsm", "extra_info": meta},
            {"problem": "p1", "answer": "2", "extra_info": [1, "two"]},
            {"problem": "p2", "answer": "3", "extra_info": 7}]
    recs, _ = records.load_records(write_jsonl(tmp_path / "own.jsonl", rows))
    assert [r["data_source"] for r in recs] == ["gsm", "", ""]
    assert [records.decode_extra_info(r["extra_info"]) for r in recs] == [meta, [1, "two"], 7]
    mapped = [{"q": "p", "a": "1", "info": {"src": "olymp", "m": meta}, "extra_info": "unused"},
              {"q": "p", "a": "1", "info": {}}]
    fields = {"problem": "q", "answer": "a", "data_source": "info.src", "extra_info": "info.m"}
    recs, _ = records.load_records(write_jsonl(tmp_path / "m.jsonl", mapped), fields=fields)
    assert [(r["data_source"], records.decode_extra_info(r["extra_info"])) for r in recs] == [
        ("olymp", meta), ("", None)]  # a mapped key a row lacks: none, as for solution / level
    recs, _ = records.load_records(write_jsonl(tmp_path / "m2.jsonl", mapped),
                                   fields={"problem": "q", "answer": "a"})
    assert [r["extra_info"] for r in recs] == ['"unused"', ""]  # the rows' own column
    bad = [{"problem": "p", "answer": "1", "extra_info": {"x": float("nan")}},
           {"problem": "p", "answer": "1", "data_source": ["a"]}]
    for i, why in enumerate(["field 'extra_info' is not a JSON value",
                             "field 'data_source' has type list"]):
        with pytest.raises(records.MalformedRecordError, match=rf"b{i}\.jsonl:line 1: {why}"):
            records.load_records(write_jsonl(tmp_path / f"b{i}.jsonl", [bad[i]]))
    parquet = tmp_path / "ctx.parquet"  # a struct column with a list: plain values back
    pq.write_table(pa.table({"problem": ["p"], "answer": ["1"], "extra_info": [meta]}), parquet)
    recs, _ = records.load_records(parquet)
    assert records.decode_extra_info(recs[0]["extra_info"]) == meta


def test_records_keep_the_columns_a_reward_takes_by_name(tmp_path):
    """columns= ({name: required}): each record keeps the row's own top-level columns of those
    names as JSON text (numpy values as lists, a None as absent), under a preset or a custom
    mapping; a row without a required one is malformed, naming file, row, the field and why it
    is wanted (or skipped and counted); no columns asked for: ""."""
    rows = [{"prompt": "1+1?", "answer": "2", "topic": "add", "hint": {"n": [1, 2]}},
            {"prompt": "2+2?", "answer": "4", "topic": "add", "hint": None},
            {"prompt": "3+3?", "answer": "6"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    recs, _ = records.load_records(path, columns={"topic": False, "hint": False})
    assert [records.decode_columns(r["columns"]) for r in recs] == [
        {"topic": "add", "hint": {"n": [1, 2]}}, {"topic": "add"}, {}]
    assert all(r["columns"] == "" for r in records.load_records(path)[0])
    with pytest.raises(records.MalformedRecordError,
                       match=r"t\.jsonl:line 3: missing field 'topic', a column the reward takes "
                             r"by name \(rewards.python_fn, rewards.python_columns\) \(the "
                             r"row's fields: answer, prompt\)"):
        records.load_records(path, columns={"topic": True})
    recs, stats = records.load_records(path, columns={"topic": True}, on_error="skip")
    assert [r["problem"] for r in recs] == ["1+1?", "2+2?"] and stats.num_skipped == 1
    mapped, _ = records.load_records(path, fields={"problem": "prompt", "answer": "answer"},
                                     columns={"topic": False})
    assert [r["columns"] for r in mapped] == ['{"topic": "add"}'] * 2 + ["{}"]
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.table({"problem": ["p"], "answer": ["1"], "scores": [[0.5, 1.0]]}),
                   parquet)
    recs, _ = records.load_records(parquet, columns={"scores": True})
    assert records.decode_columns(recs[0]["columns"]) == {"scores": [0.5, 1.0]}
    bad = write_jsonl(tmp_path / "nan.jsonl",
                      ['{"problem": "p", "answer": "1", "w": NaN}'])
    with pytest.raises(records.MalformedRecordError,
                       match=r"nan\.jsonl:line 1: a field of \['w'\] is not a JSON value"):
        records.load_records(bad, columns={"w": True})


def test_tfds_source_keeps_the_columns_and_caches_per_columns(tmp_path):
    """The ArrayRecord records hold the kept columns; another columns= is another cache entry
    (the records differ), the same one the same entry."""
    rows = [{"problem": "p", "answer": "1", "topic": "t0"}, {"problem": "q", "answer": "2"}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    tfds_dir = tmp_path / "tfds"
    plain = builders.build_tfds_source(path, name="c", data_dir=tfds_dir)
    kept = builders.build_tfds_source(path, name="c", data_dir=tfds_dir,
                                      columns={"topic": False})
    again = builders.build_tfds_source(path, name="c", data_dir=tfds_dir,
                                       columns={"topic": False})
    assert plain.name != kept.name == again.name
    assert [plain[i]["columns"] for i in range(2)] == ["", ""]
    assert [records.decode_columns(kept[i]["columns"]) for i in range(2)] == [{"topic": "t0"},
                                                                            {}]
    with pytest.raises(records.MalformedRecordError, match=r"c\.jsonl:line 2: missing field "
                                                           r"'topic'"):
        builders.build_tfds_source(path, name="c", data_dir=tfds_dir, columns={"topic": True})


def test_custom_mapping_keeps_a_structured_answer_as_json(tmp_path):
    """A custom mapping's answer that is a list or an object (verl's ground_truth of a code task,
    several accepted answers) is kept as its JSON text, which json.loads gives back; an empty one
    is a malformed row, as an empty string is, and the presets still refuse them."""
    tests = {"inputs": ["1 2\n"], "outputs": ["3\n"], "fn_name": None}
    rows = [{"q": "add", "gt": tests}, {"q": "roots?", "gt": ["2", "-2"]}, {"q": "x", "gt": []}]
    recs, stats = records.load_records(write_jsonl(tmp_path / "s.jsonl", rows),
                                       fields={"problem": "q", "answer": "gt"}, on_error="skip")
    assert [json.loads(r["answer"]) for r in recs] == [tests, ["2", "-2"]]
    assert stats.num_skipped == 1 and "is empty" in stats.skipped[0]
    with pytest.raises(records.MalformedRecordError, match="expected a string"):
        records.load_records(write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "problem": "p",
                                                                 "answer": ["1"]}]))


def test_last_boxed_edge_cases():
    assert records.last_boxed("no box") is None
    assert records.last_boxed("\\boxed{a{b}c} and \\boxed{d}") == "d"
    assert records.last_boxed("\\boxed{unbalanced") is None
    assert records.last_boxed("\\fbox{3}") == "3"


def test_unknown_layout_is_a_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"foo": 1}])
    with pytest.raises(records.MalformedRecordError, match=r"x\.jsonl:line 1: cannot tell the layout"):
        records.load_records(path)


def test_math500_from_shared(shared_dir):
    path = shared_dir / "data" / "math500.jsonl"
    if not path.is_file():
        pytest.skip("math500.jsonl not present")
    recs, stats = records.load_records(path)
    assert len(recs) == 500 and stats.num_skipped == 0
    assert recs[0]["id"] == "test/precalculus/807.json"
    assert recs[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert all(r["problem"] and r["answer"] for r in recs)
    assert {r["level"] for r in recs} == {1, 2, 3, 4, 5}


# ------------------------------------------------------------------ malformed rows


MALFORMED = [
    {"id": "a", "problem": "p", "answer": "1"},
    {"id": "b", "problem": "p", "answer": "2"},
    "",  # blank lines are not rows but still count for line numbers
    "{not json",
    {"id": "d", "problem": "p"},  # line 5: no answer
    {"id": "e", "problem": "  ", "answer": "3"},  # line 6: empty problem
    {"id": "f", "problem": "p", "answer": "4"},
]


def test_malformed_row_raises_with_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", MALFORMED)
    with pytest.raises(records.MalformedRecordError, match=r"bad\.jsonl:line 4: invalid JSON"):
        records.load_records(path)
    path2 = write_jsonl(tmp_path / "bad2.jsonl", MALFORMED[:3] + MALFORMED[4:])
    with pytest.raises(records.MalformedRecordError,
                       match=r"bad2\.jsonl:line 4: missing field 'answer' \(the row's fields: id, "
                             r"problem\)"):
        records.load_records(path2)


def test_a_mapped_column_the_file_lacks_names_the_columns_it_has(tmp_path):
    """data.fields naming a column that is not there (a typo): the error names the row, the
    column asked for and the columns the row has."""
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"question": ["1+1"], "final": ["2"]}), path)
    with pytest.raises(records.MalformedRecordError,
                       match=r"c\.parquet:row 1: missing field 'questio' \(the row's fields: "
                             r"final, question\)"):
        records.load_records(path, fields={"problem": "questio", "answer": "final"})


def test_malformed_rows_skipped_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", MALFORMED)
    recs, stats = records.load_records(path, on_error="skip")
    assert [r["id"] for r in recs] == ["a", "b", "f"]
    assert (stats.num_rows, stats.num_records, stats.num_skipped) == (6, 3, 3)
    assert [s.split(": ")[0].rsplit(":", 1)[1] for s in stats.skipped] == ["line 4", "line 5", "line 6"]


def test_malformed_parquet_row_names_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "problem": ["p", None, "p"], "answer": ["1", "2", "3"]}), path)
    with pytest.raises(records.MalformedRecordError, match=r"bad\.parquet:row 2: field 'problem' is None"):
        records.load_records(path)
    recs, stats = records.load_records(path, on_error="skip")
    assert [r["id"] for r in recs] == ["a", "c"] and stats.num_skipped == 1


# ------------------------------------------------------------------ tfds builder


# Builds and reads back a tfds source in a fresh interpreter where tensorflow cannot be found,
# whether or not it is installed (every import finder is wrapped to miss it; not
# sys.modules["tensorflow"] = None, which tfds takes for "TF loaded"); prints what it read.
NO_TF_BUILD = """
import json, sys

class HideTensorflow:  # all else delegated: find_spec, find_distributions, invalidate_caches
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)

sys.meta_path[:] = [HideTensorflow(f) for f in sys.meta_path]
import importlib.util
assert importlib.util.find_spec("tensorflow") is None
from delta_jax.data import builders
src = builders.build_tfds_source(sys.argv[1], name="a", data_dir=sys.argv[2])
try:
    src[len(src)]
    past_end = "no error"
except IndexError:
    past_end = "IndexError"
assert not [m for m in sys.modules if m == "tensorflow" or m.startswith("tensorflow.")]
print(json.dumps({"records": [src[i] for i in range(len(src))], "last": src[-1],
                  "past_end": past_end}))
"""


def test_tfds_builder_works_without_tensorflow(tmp_path):
    """The ArrayRecord builder and its data source work with tensorflow unimportable (a
    subprocess blocks the import even where tensorflow is installed): every record, in file
    order, with its defaults and index; shards written to data_dir."""
    rows = [{"id": f"r{i}", "problem": f"p{i}", "answer": str(i)} for i in range(20)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    proc = subprocess.run([sys.executable, "-c", NO_TF_BUILD, str(jsonl), str(tmp_path / "tfds")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": python_path()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["records"] == [{"id": f"r{i}", "problem": f"p{i}", "answer": str(i),
                               "solution": "", "level": -1, "data_source": "",
                               "extra_info": "", "columns": "", "index": i}
                              for i in range(20)]  # all of them, file order kept
    assert got["last"]["id"] == "r19" and got["past_end"] == "IndexError"
    files = list((tmp_path / "tfds").rglob("*.array_record*"))
    assert files, "expected ArrayRecord shards in data_dir"


def test_tfds_source_logs_no_custom_config_warning(tmp_path, caplog):
    """A builder config per content is the design: tfds' "Using custom data configuration"
    warning is not shown, on the first build or on the cached one."""
    import logging
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"id": "r0", "problem": "p", "answer": "1"}])
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            builders.build_tfds_source(jsonl, name="a", data_dir=tmp_path / "tfds")
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "custom data configuration" in m], messages


def test_tfds_source_leaves_nothing_in_the_temp_dir(tmp_path, monkeypatch):
    """Preparing new content and opening it again leave the temp directory as they found it:
    tfds' look-up of pre-computed info on GCS made an empty tmp*tfds directory there for every
    builder made before its data existed, and never removed it (one per new file content)."""
    import tempfile
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"id": "r0", "problem": "p", "answer": "1"}])
    for _ in range(2):  # prepared, then from the cache
        source = builders.build_tfds_source(jsonl, name="a", data_dir=tmp_path / "tfds")
        assert len(source) == 1
    assert sorted(p.name for p in scratch.iterdir()) == []


def test_tfds_source_says_it_converts_not_downloads(tmp_path, capsys, caplog):
    """A preparation logs one line naming the file and where its copy goes, not tfds' stdout
    lines about downloading a dataset of "Unknown size" (nothing is downloaded); the cached open
    says nothing."""
    import logging
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"id": "r0", "problem": "p", "answer": "1"}])
    with caplog.at_level(logging.INFO, logger="delta_jax.data"):
        for _ in range(2):
            builders.build_tfds_source(jsonl, name="a", data_dir=tmp_path / "tfds")
    assert "ownload" not in capsys.readouterr().out
    lines = [r.getMessage() for r in caplog.records if r.name == "delta_jax.data"]
    assert len(lines) == 1 and lines[0].startswith(f"data: converting {jsonl} to ArrayRecord "
                                                   f"once (this content's copy: {tmp_path}"), lines


def test_tfds_cache_is_per_content(tmp_path):
    rows = [{"id": f"r{i}", "problem": f"p{i}", "answer": str(i)} for i in range(4)]
    path = write_jsonl(tmp_path / "a.jsonl", rows + ["oops"])
    first = builders.build_tfds_source(path, name="a", data_dir=tmp_path / "tfds", on_error="skip")
    again = builders.build_tfds_source(path, name="a", data_dir=tmp_path / "tfds", on_error="skip")
    assert again.name == first.name
    assert again.stats.num_skipped == 1 and again.stats.num_records == 4  # stats survive the cache
    write_jsonl(path, rows[:2])
    changed = builders.build_tfds_source(path, name="a", data_dir=tmp_path / "tfds", on_error="skip")
    assert changed.name != first.name and len(changed) == 2
    with pytest.raises(records.MalformedRecordError, match=r"a\.jsonl:line 5"):
        builders.build_tfds_source(write_jsonl(path, rows + ["oops"]), name="a", data_dir=tmp_path / "tfds")


def test_tfds_source_prepared_by_another_process_meanwhile(tmp_path, monkeypatch):
    """Two processes sharing a data_dir (the hosts of a multi-host run, or its processes on one
    machine): this one opens its builder before the data exists (an empty dataset info), the
    other finishes preparing it, then this one's download_and_prepare finds it there and does
    nothing. The source must still open what is on disk (it once failed with tfds' "splits is
    empty"; seen in test_multihost's two-process run on a loaded machine, 2026-11-26)."""
    rows = [{"id": f"r{i}", "problem": f"p{i}", "answer": str(i)} for i in range(6)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    real = builders._builder
    calls = []

    def builder_then_other_process_prepares(config, data_dir):
        stale = real(config, data_dir)
        if not calls:  # the other process, between this one's builder and its prepare
            real(config, data_dir).download_and_prepare()
        calls.append(config.name)
        return stale

    monkeypatch.setattr(builders, "_builder", builder_then_other_process_prepares)
    src = builders.build_tfds_source(jsonl, name="a", data_dir=tmp_path / "tfds")
    assert [src[i]["id"] for i in range(len(src))] == [f"r{i}" for i in range(6)]


def test_tfds_source_over_jsonl_and_parquet(tmp_path):
    jsonl = write_jsonl(tmp_path / "part1.jsonl", [{"id": f"j{i}", "problem": "p", "answer": "1"} for i in range(3)])
    parquet = tmp_path / "part2.parquet"
    pq.write_table(pa.table({"question": ["q0", "q1"], "final_answer": ["x", "y"]}), parquet)
    src = builders.build_tfds_source([jsonl, parquet], name="mixed", data_dir=tmp_path / "tfds")
    assert [src[i]["id"] for i in range(len(src))] == ["j0", "j1", "j2", "part2-0", "part2-1"]
    assert src[4]["problem"] == "q1" and src[4]["answer"] == "y"


def test_tfds_source_keeps_the_context_fields(tmp_path):
    rows = [{"problem": "p", "answer": "1", "data_source": "zoo",
             "extra_info": {"pick": 1, "targets": ["cat", "dog"]}},
            {"problem": "q", "answer": "2"}]
    src = builders.build_tfds_source(write_jsonl(tmp_path / "c.jsonl", rows), name="ctx",
                                     data_dir=tmp_path / "tfds")
    assert [(src[i]["data_source"], records.decode_extra_info(src[i]["extra_info"]))
            for i in range(2)] == [("zoo", rows[0]["extra_info"]), ("", None)]


def test_hub_name_goes_through_datasets_when_installed(monkeypatch, tmp_path):
    """The network path, with a stand-in `datasets` module (tests never use the network)."""
    import types

    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return [{"question": "q0", "final_answer": "1"}, {"question": "q1", "final_answer": "2"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.chdir(tmp_path)  # so "org/name" is not a local path
    recs, stats = records.load_records("some-org/DeepMath-mini:test")
    assert calls == [("some-org/DeepMath-mini", "test")]
    assert [r["answer"] for r in recs] == ["1", "2"] and stats.layouts["some-org/DeepMath-mini"] == "deepmath"
    src = builders.build_tfds_source("some-org/DeepMath-mini", data_dir=tmp_path / "tfds")
    assert [src[i]["problem"] for i in range(len(src))] == ["q0", "q1"]
    assert calls[-1] == ("some-org/DeepMath-mini", "train")
    with pytest.raises(FileNotFoundError, match="no such file"):
        records.load_records(tmp_path / "missing.jsonl")


def test_hub_name_without_datasets_downloads_files_with_huggingface_hub(monkeypatch, tmp_path):
    """Without `datasets`: huggingface_hub.snapshot_download (a stand-in returning a local copy of
    a repository with a train and a test split) and the split's files read like local ones. A
    download that fails (offline, no such repository) is a MissingInputError naming the data
    set, with the hub's error as its cause."""
    import huggingface_hub

    repo = tmp_path / "snapshot"
    (repo / "data").mkdir(parents=True)
    write_jsonl(repo / "data" / "train-00000.jsonl",
                [{"question": f"t{i}", "final_answer": str(i)} for i in range(3)])
    pq.write_table(pa.table({"question": ["e0"], "final_answer": ["9"]}),
                   repo / "data" / "test-00000.parquet")
    calls = []

    def snapshot_download(repo_id, repo_type, allow_patterns):
        calls.append((repo_id, repo_type))
        return str(repo)

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    recs, _ = records.load_records("some-org/DeepMath-mini")
    assert [r["problem"] for r in recs] == ["t0", "t1", "t2"]
    recs, _ = records.load_records("some-org/DeepMath-mini:test")
    assert [(r["problem"], r["answer"]) for r in recs] == [("e0", "9")]
    assert calls == [("some-org/DeepMath-mini", "dataset")] * 2

    class OfflineError(OSError):
        pass

    def offline(**kwargs):
        raise OfflineError("Cannot reach https://huggingface.co: offline mode is enabled.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(MissingInputError, match=r"'some-org/DeepMath-mini' could not be fetched "
                       r"\(OfflineError: Cannot reach .*local JSONL") as err:
        records.load_records("some-org/DeepMath-mini")
    assert isinstance(err.value.__cause__, OfflineError)


def test_hub_fetch_failure_through_datasets_names_the_data_set(monkeypatch, tmp_path):
    import types

    def load_dataset(name, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MissingInputError, match=r"'org/set' could not be fetched \(ConnectionError"):
        records.load_records("org/set:train")


# ------------------------------------------------------------------ #20: messages with the culprit


def test_non_utf8_row_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": "a", "problem": "p", "answer": "1"}\n'
                     b'{"id": "b", "problem": "caf\xe9", "answer": "2"}\n'
                     b'{"id": "c", "problem": "p", "answer": "3"}\n')
    with pytest.raises(records.MalformedRecordError,
                       match=r"latin1\.jsonl:line 2: not valid UTF-8 \(byte 0xe9 at column 28\)"):
        records.load_records(path)
    recs, stats = records.load_records(path, on_error="skip")
    assert [r["id"] for r in recs] == ["a", "c"] and stats.num_skipped == 1
    array = tmp_path / "latin1.json"
    array.write_bytes(b'[{"id": "a", "problem": "p", "answer": "1"},\n'
                      b' {"id": "b", "problem": "caf\xe9", "answer": "2"}]\n')
    with pytest.raises(records.MalformedRecordError,
                       match=r"latin1\.json: not valid UTF-8 \(byte 0xe9 at line 2, column 29\)"):
        records.load_records(array)


def _config_data_fields():
    from delta_jax.train.config import default_config
    return set(default_config().data.keys())


def test_data_errors_name_options_the_config_has(tmp_path):
    """A message's advice must be something the user can do from the command line: every
    --config.data.* option it names exists, and doing what it says works."""
    bad = write_jsonl(tmp_path / "bad.jsonl", MALFORMED)
    with pytest.raises(records.MalformedRecordError) as err:
        records.load_records(bad)
    assert "--config.data.on_error=skip" in str(err.value)
    unknown = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "gold": "1"}])
    with pytest.raises(records.MalformedRecordError) as err2:
        records.load_records(unknown)
    assert "--config.data.fields=" in str(err2.value)
    assert {"on_error", "fields"} <= _config_data_fields()
    # What the messages advise, as a config string, works.
    recs, _ = records.load_records(bad, on_error="skip")
    assert len(recs) == 3
    recs, _ = records.load_records(unknown, fields='{"problem": "question", "answer": "gold"}')
    assert recs[0]["problem"] == "q" and recs[0]["answer"] == "1"
    with pytest.raises(ValueError, match=r"data\.fields: not a preset name or a JSON object"):
        records.load_records(unknown, fields="{problem: question}")


# ------------------------------------------------------------------ code layouts (#18)


CODE_ROWS = {
    "humaneval": {"id": "HE/0", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
                  "entry_point": "add", "canonical_solution": "    return a + b\n",
                  "test": "def check(c):\n    assert c(1, 2) == 3\n"},
    "mbpp": {"task_id": 7, "text": "Write a function to double x.", "code": "def d(x): return 2*x",
             "test_list": ["assert d(1) == 2", "assert d(3) == 6"], "test_setup_code": ""},
    "taco": {"question": "Read a and b, print a + b.",
             "input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}),
             "difficulty": "EASY"},
    "codecontests": {"name": "1A", "description": "Print the sum.",
                     "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
                     "private_tests": {"input": ["5 5\n"], "output": ["10\n"]},
                     "generated_tests": {"input": [], "output": []}},
}


@pytest.mark.parametrize("layout", sorted(CODE_ROWS))
def test_code_layouts_load_with_a_test_spec_answer(tmp_path, layout):
    from delta_jax.rl import sandbox

    path = write_jsonl(tmp_path / f"{layout}.jsonl", [CODE_ROWS[layout]])
    recs, stats = records.load_records(path)
    assert stats.layouts[str(path)] == layout
    spec = sandbox.parse_spec(recs[0]["answer"])  # the gold the code reward reads
    assert spec["kind"] == {"humaneval": "function", "mbpp": "assert", "taco": "stdio",
                            "codecontests": "stdio"}[layout]
    assert recs[0]["problem"].strip()
    if layout == "codecontests":
        assert spec["inputs"] == ["1 2\n", "5 5\n"]


def test_taco_call_based_and_bad_code_rows(tmp_path):
    from delta_jax.rl import sandbox

    row = {"question": "Implement add.", "starter_code": "class Solution:\n    def add(self, a, b):",
           "input_output": {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]}}
    recs, _ = records.load_records(write_jsonl(tmp_path / "t.jsonl", [row]))
    assert sandbox.parse_spec(recs[0]["answer"])["kind"] == "call"
    assert "class Solution" in recs[0]["problem"]
    bad = dict(row, input_output="{broken")
    with pytest.raises(records.MalformedRecordError, match=r"t2\.jsonl:line 1: field 'input_output' is not JSON"):
        records.load_records(write_jsonl(tmp_path / "t2.jsonl", [bad]))


def test_code_records_through_the_tfds_builder(tmp_path):
    path = write_jsonl(tmp_path / "mbpp.jsonl", [CODE_ROWS["mbpp"]] * 3)
    src = builders.build_tfds_source(path, name="mbpp", data_dir=tmp_path / "tfds")
    assert len(src) == 3 and json.loads(src[0]["answer"])["tests"][0] == "assert d(1) == 2"
