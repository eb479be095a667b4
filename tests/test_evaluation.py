"""Tests for delta_jax.evaluation: estimators, benchmark loading, evaluate() with fake policies."""
import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from delta_jax import evaluation as ev
from delta_jax.errors import InputError
from delta_jax.rl.rewards import RewardScorer


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer("math", num_workers=2, timeout_s=5.0) as s:
        yield s


# --- estimators ----------------------------------------------------------------------------


def _pass_at_k_brute_force(n, c, k):
    """Fraction of k-subsets of n samples (c of them correct) holding a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert ev.pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute_force(n, c, k),
                                                             abs=1e-12), (n, c, k)


def test_pass_at_k_vectorised_and_large_n():
    c = np.array([0, 1, 3, 200])
    got = ev.pass_at_k(200, c, 100)
    want = [1 - math.comb(200 - int(ci), 100) / math.comb(200, 100) for ci in c]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert got.shape == (4,)
    assert ev.pass_at_k(16, 5, 1) == pytest.approx(5 / 16)  # pass@1 = fraction correct
    with pytest.raises(ValueError, match="k <= n"):
        ev.pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        ev.pass_at_k(4, 5, 1)


# --- loading -------------------------------------------------------------------------------


def test_load_benchmark(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n\n'
                    '{"id": "b", "problem": "2+2?", "answer": 4}\n'
                    '{"problem": "3+3?", "answer": "6"}\n')
    rows = ev.load_benchmark(path)
    assert [r["answer"] for r in rows] == ["2", "4", "6"] and rows[2]["id"] == "2"
    assert len(ev.load_benchmark(path, limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "problem": "x", "answer": "1"}\n{"id": "b", "question": "y"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:line 2: row has no 'problem'"):
        ev.load_benchmark(bad)
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl: no such benchmark file"):
        ev.load_benchmark(tmp_path / "missing.jsonl")
    mixed = tmp_path / "mixed.jsonl"
    spec = json.dumps({"tests": ["assert f() == 1"]})
    mixed.write_text('{"problem": "1+1?", "answer": "2"}\n' +
                     json.dumps({"problem": "f", "answer": spec}) + "\n")
    with pytest.raises(ValueError, match=r"mixed\.jsonl: mixes math and code rows"):
        ev.load_benchmark(mixed)


def test_load_benchmark_reads_the_layouts_and_files_of_the_training_records(tmp_path):
    """A benchmark can be any file and layout data/records.py reads: verl's parquet (a DAPO
    chat prompt, reward_model.ground_truth, data_source, extra_info), DeepMath and MATH (the
    last \\boxed{} of a solution) JSONL, a JSON array, and a code layout (MBPP), each row with
    its id (or its index), problem, answer, kind and context."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from delta_jax.data import records
    from delta_jax.rl import sandbox

    wrap = ("Solve the following math problem step by step. The last line of your response "
            "should be of the form Answer: $Answer (without quotes) where $Answer is the answer "
            "to the problem.\n\n{}\n\nRemember to put your answer on its own line after "
            "\"Answer:\".")
    verl = tmp_path / "aime_verl.parquet"
    pq.write_table(pa.table({
        "data_source": ["aime24"] * 2,
        "prompt": [[{"role": "user", "content": wrap.format(p)}] for p in ("P one", "P two")],
        "reward_model": [{"ground_truth": "7", "style": "rule"}, {"ground_truth": "12", "style": "rule"}],
        "extra_info": [{"index": "i0"}, {"index": "i1"}]}), verl)
    rows = ev.load_benchmark(verl)
    assert [(r["id"], r["problem"], r["answer"], r["kind"], r["data_source"]) for r in rows] == [
        ("i0", "P one", "7", "math", "aime24"), ("i1", "P two", "12", "math", "aime24")]
    assert records.decode_extra_info(rows[1]["extra_info"]) == {"index": "i1"}
    deepmath = tmp_path / "deepmath.jsonl"
    deepmath.write_text(json.dumps({"question": "Is 7 prime?", "final_answer": "Yes"}) + "\n")
    math = tmp_path / "math.json"
    math.write_text(json.dumps([{"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}"}]))
    assert [(r["id"], r["problem"], r["answer"]) for r in ev.load_benchmark(deepmath)] == [
        ("0", "Is 7 prime?", "Yes")]
    assert [(r["problem"], r["answer"]) for r in ev.load_benchmark(math)] == [
        ("p", "\\frac{1}{2}")]
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text(json.dumps({"task_id": 3, "text": "Write f.", "test_list": ["assert f(1) == 2"]})
                    + "\n")
    (code,) = ev.load_benchmark(mbpp)
    assert code["kind"] == "code" and code["id"] == "3"
    assert sandbox.parse_spec(code["answer"])["tests"] == ["assert f(1) == 2"]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"problem": ["p"], "answer": [""]}), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet:row 1: deltajax row: field 'answer' is empty"):
        ev.load_benchmark(bad)


def test_a_benchmarks_rows_give_the_scorer_their_context_once_checked(tmp_path):
    """Each row's data_source and extra_info reach score() with its responses (as text, "" for
    none), the same whether evaluate() is given the file, load_benchmark's rows (not checked
    again: its extra_info would be encoded twice) or the raw rows; an extra_info JSON cannot
    hold names the row."""
    raw = [{"id": "a", "problem": "1+1?", "answer": "2", "data_source": "gsm",
            "extra_info": {"split": "test", "tags": ["easy"]}},
           {"id": "b", "problem": "2+2?", "answer": "4", "extra_info": "just text"},
           {"id": "c", "problem": "3+3?", "answer": "6"}]
    path = tmp_path / "ctx.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in raw))
    want_sources = ["gsm", "gsm", "", "", "", ""]
    want_extra = [raw[0]["extra_info"]] * 2 + ["just text"] * 2 + [None] * 2

    class Recording:
        calls = []

        def score(self, responses, golds, response_lengths=None, truncated=None,
                  problems=None, data_sources=None, extra_infos=None, **kw):
            from delta_jax.data.records import decode_extra_info
            self.calls.append((list(data_sources), [decode_extra_info(e) for e in extra_infos]))
            n = len(responses)
            return np.ones(n, np.float32), {"accuracy": np.ones(n, np.float32),
                                            "num_no_box": 0, "num_timeouts": 0, "num_errors": 0}

    gen = lambda batch, n: [["\\boxed{2}"] * n for _ in batch]  # noqa: E731
    for source in (str(path), ev.load_benchmark(path), raw):
        Recording.calls.clear()
        ev.evaluate(gen, {"ctx": source}, k=2, scorer=Recording())
        assert Recording.calls == [(want_sources, want_extra)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "p", "answer": "1", "extra_info": {"x": NaN}}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:line 1: field 'extra_info' is not a JSON value"):
        ev.load_benchmark(bad)


def test_a_benchmark_s_rows_keep_the_columns_their_kind_s_reward_takes(tmp_path):
    """load_benchmark(columns={kind: {name: required}}) keeps a row's columns for the reward of
    its kind only (a code benchmark in a math run's columns is not asked for them), a math row
    without a required one is an InputError naming file and line; evaluate() asks for the
    columns of the scorer it is given and passes them, with each row's solution (MATH's worked
    solution), as score()'s columns= and solutions=."""
    math_rows = [{"problem": "p1", "solution": "so \\boxed{1}", "topic": "a"},
                 {"problem": "p2", "answer": "2", "topic": "b"}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in math_rows))
    rows = ev.load_benchmark(path, columns={"math": {"topic": True}, "code": {"x": True}})
    assert [r["columns"] for r in rows] == ['{"topic": "a"}', '{"topic": "b"}']
    assert [r["solution"] for r in rows] == ["so \\boxed{1}", ""]
    code = tmp_path / "c.jsonl"
    code.write_text(json.dumps({"problem": "f", "answer": {"tests": ["assert f() == 1"]}}) + "\n")
    assert [r["columns"] for r in ev.load_benchmark(code, columns={"math": {"topic": True}})] == [
        ""]
    with pytest.raises(InputError, match=r"m\.jsonl:line 1: missing field 'level', a column"):
        ev.load_benchmark(path, columns={"math": {"level": True}})

    class Recording:
        columns = {"topic": True}
        calls = []

        def score(self, responses, golds, **kw):
            self.calls.append((kw["columns"], kw["solutions"]))
            n = len(responses)
            return np.ones(n, np.float32), {"accuracy": np.ones(n, np.float32),
                                            "num_no_box": 0, "num_timeouts": 0, "num_errors": 0}

    gen = lambda batch, n: [["x"] * n for _ in batch]  # noqa: E731
    for source in (str(path), math_rows):
        Recording.calls.clear()
        ev.evaluate(gen, {"m": source}, k=2, scorer=Recording())
        assert Recording.calls == [(['{"topic": "a"}'] * 2 + ['{"topic": "b"}'] * 2,
                                    ["so \\boxed{1}"] * 2 + [""] * 2)]


def test_load_benchmark_non_utf8_names_file_and_line(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"id": "a", "problem": "x", "answer": "1"}\n'
                    b'{"id": "b", "problem": "caf\xe9?", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:line 2: not valid UTF-8 \(byte 0xe9"):
        ev.load_benchmark(bad)


# --- evaluate ------------------------------------------------------------------------------


def _fake_policy(rows_by_prompt, num_correct_of):
    """Answers question q correctly in its first num_correct_of(q) samples, wrongly after."""
    def generate_fn(prompts, n):
        out = []
        for p in prompts:
            q, row = rows_by_prompt[p]
            c = num_correct_of(q)
            out.append([f"Reasoning... so the answer is $\\boxed{{{row['answer']}}}$." if j < c
                        else "Reasoning... so the answer is $\\boxed{-987654}$." for j in range(n)])
        return out
    return generate_fn


def _expected_metrics(counts, k, pass_ks):
    counts = np.asarray(counts)
    exp = {f"avg@{k}": float(np.mean(counts / k))}
    for kk in pass_ks:
        exp[f"pass@{kk}"] = float(np.mean([1 - math.comb(k - c, kk) / math.comb(k, kk)
                                           for c in counts]))
    return exp


def test_evaluate_on_shared_benchmarks(shared_dir, scorer):
    paths = {"aime24": shared_dir / "data/aime24.jsonl", "amc23": shared_dir / "data/amc23.jsonl"}
    for p in paths.values():
        if not p.is_file():
            pytest.skip(f"{p} is absent")
    k, pass_ks = 4, (1, 2, 4)
    rows_by_prompt, counts = {}, {}
    for name, path in paths.items():
        rows = ev.load_benchmark(path)
        for q, row in enumerate(rows):
            rows_by_prompt[ev.default_format_prompt(row["problem"])] = (q, row)
        counts[name] = [q % (k + 1) for q in range(len(rows))]
    gen = _fake_policy(rows_by_prompt, lambda q: q % (k + 1))
    result = ev.evaluate(gen, {n: str(p) for n, p in paths.items()}, k=k, pass_ks=pass_ks,
                         scorer=scorer, settings={"temperature": 1.0, "top_p": 0.7})

    assert list(result.benchmarks) == ["aime24", "amc23"]
    for name in paths:
        b = result.benchmarks[name]
        np.testing.assert_array_equal(b.num_correct, counts[name])
        exp = _expected_metrics(counts[name], k, pass_ks)
        got = result._row(b)
        for m in exp:
            assert got[m] == pytest.approx(exp[m], abs=1e-12), (name, m)
        assert b.num_no_box == 0 and b.num_timeouts == 0
    # Question-count-weighted average (30 and 40 questions).
    exp_avg = {m: (30 * _expected_metrics(counts["aime24"], k, pass_ks)[m]
                   + 40 * _expected_metrics(counts["amc23"], k, pass_ks)[m]) / 70
               for m in _expected_metrics(counts["aime24"], k, pass_ks)}
    for m, v in result.average().items():
        assert v == pytest.approx(exp_avg[m], abs=1e-12)

    md = result.to_markdown().splitlines()
    assert md[0] == "| benchmark | questions | avg@4 | pass@1 | pass@2 | pass@4 |"
    e = _expected_metrics(counts["aime24"], k, pass_ks)
    assert md[2] == ("| aime24 | 30 | " + " | ".join(f"{100 * e[m]:.1f}" for m in e) + " |")
    assert md[4].startswith("| average (question-weighted) | 70 | ")

    data = json.loads(result.to_json())
    assert data["benchmarks"]["amc23"]["num_questions"] == 40
    assert data["average"]["pass@4"] == pytest.approx(exp_avg["pass@4"])
    assert data["settings"] == {"temperature": 1.0, "top_p": 0.7}
    assert data["benchmarks"]["aime24"]["per_question"][3] == {"id": "aime-2024-I-4",
                                                                "num_correct": 3}
    flat = result.flat_metrics()
    assert flat["eval/benchmarks/amc23/pass@2"] == pytest.approx(
        _expected_metrics(counts["amc23"], k, pass_ks)["pass@2"])
    assert flat["eval/average/avg@4"] == pytest.approx(exp_avg["avg@4"])
    # Every number of the JSON but the settings: per benchmark its question count, k, the four
    # metrics and the three failure counts; the average's count and metrics; k and the seconds.
    per_benchmark = ["num_questions", "k", "avg@4", "pass@1", "pass@2", "pass@4", "num_no_box",
                     "num_timeouts", "num_errors"]
    assert sorted(flat) == sorted(
        [f"eval/benchmarks/{b}/{m}" for b in ("aime24", "amc23") for m in per_benchmark]
        + [f"eval/average/{m}" for m in ("num_questions", "avg@4", "pass@1", "pass@2", "pass@4")]
        + ["eval/k", "eval/seconds"])
    assert flat["eval/benchmarks/aime24/num_questions"] == 30.0


def test_evaluate_two_local_benchmarks_of_unequal_size_reports_known_numbers(tmp_path, scorer):
    """Two JSONL benchmarks written here (2 and 3 questions), a fake policy whose correct
    samples per question are set: per-benchmark avg@4 / pass@k', the question-count-weighted
    average (not the plain mean of the two rows), the markdown table, every flat metric and the
    JSON's per-question counts, all against values worked out by hand."""
    small = [{"id": "s0", "problem": "What is 1 + 1?", "answer": "2"},
             {"id": "s1", "problem": "What is 2 + 2?", "answer": "4"}]
    big = [{"id": "b0", "problem": "What is 3 + 3?", "answer": "6"},
           {"id": "b1", "problem": "What is 4 + 4?", "answer": "8"},
           {"id": "b2", "problem": "What is 5 + 5?", "answer": "10"}]
    correct = {"s0": 4, "s1": 0, "b0": 1, "b1": 2, "b2": 0}  # of k = 4 samples each
    paths = {}
    for name, rows in (("small", small), ("big", big)):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_prompt = {ev.default_format_prompt(r["problem"]): r for r in small + big}

    def generate_fn(prompts, n):
        out = []
        for p in prompts:
            row = by_prompt[p]
            wrong = ("No idea." if row["id"] == "b2"  # no \boxed{}: counted in num_no_box
                     else "so the answer is $\\boxed{-987654}$.")
            out.append([f"so the answer is $\\boxed{{{row['answer']}}}$."
                        if j < correct[row["id"]] else wrong for j in range(n)])
        return out

    result = ev.evaluate(generate_fn, {n: str(p) for n, p in paths.items()}, k=4,
                         pass_ks=(1, 2, 4), scorer=scorer, settings={"temperature": 1.0})
    # small: counts 4, 0 -> avg@4 = 4/8, pass@k' = (1 + 0) / 2 for every k'. big: counts 1, 2, 0
    # -> avg@4 = 3/12; pass@2 = (1 - C(3,2)/C(4,2) + 1 - C(2,2)/C(4,2) + 0) / 3 = (1/2 + 5/6) / 3
    # = 4/9; pass@4 = 2/3. Average, weighted 2 : 3 of 5 questions: avg@4 = (2 * 0.5 + 3 * 0.25)
    # / 5 = 0.35 (the plain mean would be 0.375), pass@2 = (1 + 3 * 4/9) / 5 = 7/15, pass@4 = 0.6.
    want = {"small": {"avg@4": 0.5, "pass@1": 0.5, "pass@2": 0.5, "pass@4": 0.5},
            "big": {"avg@4": 0.25, "pass@1": 0.25, "pass@2": 4 / 9, "pass@4": 2 / 3}}
    want_avg = {"avg@4": 0.35, "pass@1": 0.35, "pass@2": 7 / 15, "pass@4": 0.6}
    assert list(result.benchmarks) == ["small", "big"]
    assert result.average() == pytest.approx(want_avg, abs=1e-12)

    assert result.to_markdown().splitlines() == [
        "| benchmark | questions | avg@4 | pass@1 | pass@2 | pass@4 |",
        "|---|---:|---:|---:|---:|---:|",
        "| small | 2 | 50.0 | 50.0 | 50.0 | 50.0 |",
        "| big | 3 | 25.0 | 25.0 | 44.4 | 66.7 |",
        "| average (question-weighted) | 5 | 35.0 | 35.0 | 46.7 | 60.0 |"]

    flat = result.flat_metrics()
    assert flat.pop("eval/seconds") >= 0.0
    failures = {"small": 0, "big": 4}  # b2's four samples have no box
    want_flat = {"eval/k": 4.0, "eval/average/num_questions": 5.0,
                 **{f"eval/average/{m}": v for m, v in want_avg.items()}}
    for name, q in (("small", 2), ("big", 3)):
        want_flat.update({f"eval/benchmarks/{name}/{m}": v for m, v in want[name].items()})
        want_flat.update({f"eval/benchmarks/{name}/num_questions": float(q),
                          f"eval/benchmarks/{name}/k": 4.0,
                          f"eval/benchmarks/{name}/num_no_box": float(failures[name]),
                          f"eval/benchmarks/{name}/num_timeouts": 0.0,
                          f"eval/benchmarks/{name}/num_errors": 0.0})
    assert sorted(flat) == sorted(want_flat)
    assert flat == pytest.approx(want_flat, abs=1e-12)

    data = json.loads(result.to_json())
    assert data["settings"] == {"temperature": 1.0} and data["pass_ks"] == [1, 2, 4]
    for name, rows in (("small", small), ("big", big)):
        assert data["benchmarks"][name]["per_question"] == [
            {"id": r["id"], "num_correct": correct[r["id"]]} for r in rows]
        assert data["benchmarks"][name]["pass@2"] == pytest.approx(want[name]["pass@2"])
    assert data["average"] == pytest.approx({"num_questions": 5, **want_avg}, abs=1e-12)


def test_evaluate_rows_custom_prompt_and_limit(scorer):
    rows = [{"id": f"q{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)}
            for i in range(5)]
    calls = []

    def gen(prompts, n):
        calls.append(len(prompts))
        out = []
        for p in prompts:
            assert p.startswith("Q: ") and p.endswith(" A:")
            i = int(p.split()[3])
            # Equivalent but differently written answers for even i, wrong for odd i.
            ans = f"{2 * i}.0" if i % 2 == 0 else f"{2 * i + 1}"
            out.append([f"\\boxed{{{ans}}}"] * n)
        return out

    result = ev.evaluate(gen, {"toy": rows}, k=2, format_prompt=lambda s: f"Q: {s} A:",
                         scorer=scorer, limit=4)
    assert calls == [4]  # one call with the benchmark's first `limit` questions
    b = result.benchmarks["toy"]
    assert b.ids == ["q0", "q1", "q2", "q3"] and b.num_correct.tolist() == [2, 0, 2, 0]
    assert result.pass_ks == (1, 2) and b.pass_at == {1: 0.5, 2: 0.5}


# --- majority voting ------------------------------------------------------------------------


def test_maj_at_k_known_answers_groups_and_ties():
    # gold 4: the majority of all four is "5" (wrong) though one sample is right
    # the last question: three samples without an answer do not outvote the one with it
    votes = [["5", "5", "4", None], ["7", "3", "3", "7"], [None, None, None, None],
             [None, None, None, "4"]]
    correct = [[0, 0, 1, 0], [1, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 1]]
    # tie 2-2 in the second: "7" came first
    assert ev.maj_at_k(votes, correct, 4).tolist() == [0.0, 1.0, 0.0, 1.0]
    # k = 2: groups (s0, s1), (s2, s3): ["5","5"] -> 0, ["4", None] -> 1; ["7","3"] tie -> "7",
    # ["3","7"] tie -> "3"; [None, None] -> 0, [None, "4"] -> 1
    assert ev.maj_at_k(votes, correct, 2).tolist() == [0.5, 0.5, 0.0, 0.5]
    # k = 3 of 4 samples: one group, the first three
    assert ev.maj_at_k(votes, correct, 3).tolist() == [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="1 <= k <= n"):
        ev.maj_at_k(votes, correct, 5)
    with pytest.raises(ValueError, match="votes of shape"):
        ev.maj_at_k(votes[:2], correct, 2)


def test_maj_at_1_is_the_mean_accuracy_and_unanimous_questions_keep_their_verdict():
    rng = np.random.default_rng(0)
    answers = np.array(["1", "2", "3", None], dtype=object)
    votes = [list(rng.choice(answers, 8)) for _ in range(20)]
    # right where the vote is "1" (gold 1); a sample without an answer is wrong
    correct = np.asarray([[v == "1" for v in q] for q in votes], np.float32)
    np.testing.assert_allclose(ev.maj_at_k(votes, correct, 1), correct.mean(axis=1))
    same = [["x"] * 8, ["y"] * 8]
    for k in (1, 2, 3, 8):
        assert ev.maj_at_k(same, [[1] * 8, [0] * 8], k).tolist() == [1.0, 0.0]


def test_evaluate_reports_maj_at_k_from_the_boxed_answers(scorer):
    rows = [{"id": "a", "problem": "p0", "answer": "4"}, {"id": "b", "problem": "p1",
                                                           "answer": "7"}]
    texts = {"p0": ["so \\boxed{5}", "\\boxed{ 5 }", "\\boxed{4}", "no answer"],
             # "7." is 7 (normalize_answer); 2-2 tie, "7" first
             "p1": ["\\boxed{7}", "\\boxed{7.}", "\\boxed{3}", "\\boxed{3}"]}
    result = ev.evaluate(lambda prompts, n: [texts[p] for p in prompts], {"toy": rows}, k=4,
                         pass_ks=(4,), format_prompt=lambda p: p, scorer=scorer, maj_ks=(2, 4))
    b = result.benchmarks["toy"]
    assert b.votes == [["5", "5", "4", None], ["7", "7", "3", "3"]]
    assert b.num_correct.tolist() == [1, 2] and b.pass_at == {4: 1.0}
    assert b.maj_at == {2: 0.5, 4: 0.5}  # q0: 0 / 0.5 at 4 / 2; q1: 1 / 0.5
    assert result.metric_names() == ["avg@4", "pass@4", "maj@2", "maj@4"]
    d = result.to_dict()
    assert d["maj_ks"] == [2, 4] and d["average"]["maj@4"] == 0.5
    assert [q["maj@4"] for q in d["benchmarks"]["toy"]["per_question"]] == [0.0, 1.0]
    assert result.flat_metrics()["eval/benchmarks/toy/maj@2"] == 0.5
    assert "| maj@2 | maj@4 |" in result.to_markdown()
    with pytest.raises(ValueError, match=r"maj_ks must lie in \[1, k=4\]"):
        ev.evaluate(lambda prompts, n: [texts[p] for p in prompts], {"toy": rows}, k=4,
                    format_prompt=lambda p: p, scorer=scorer, maj_ks=(5,))
    code = [{"problem": "f", "answer": json.dumps({"tests": ["assert f(2) == 4"]})}]
    with pytest.raises(ValueError, match="humaneval: maj@k votes on final answers"):
        ev.evaluate(lambda prompts, n: [["x"] * n] * len(prompts), {"humaneval": code}, k=2,
                    scorer=scorer, maj_ks=(2,))
    # without maj_ks nothing of it is reported
    plain = ev.evaluate(lambda prompts, n: [texts[p] for p in prompts], {"toy": rows}, k=4,
                        format_prompt=lambda p: p, scorer=scorer).to_dict()
    assert "maj_ks" not in plain and "maj@4" not in plain["average"]
    assert plain["benchmarks"]["toy"]["per_question"][0] == {"id": "a", "num_correct": 1}


def test_paired_change_pairs_maj_at_k_by_question():
    def result(maj):
        b = ev.BenchmarkResult("t", ["q0", "q1", "q2"], np.asarray([1, 1, 1]), 4, (1,),
                               maj={4: np.asarray(maj, np.float64)})
        return ev.EvalResult({"t": b}, 4, (1,), maj_ks=(4,)).to_dict()

    change = ev.paired_change(result([0, 1, 0]), result([1, 1, 1]))
    assert change["maj@4"]["before"] == pytest.approx(1 / 3)
    assert change["maj@4"]["after"] == 1.0 and change["maj@4"]["diff"] == pytest.approx(2 / 3)
    assert change["avg@4"]["diff"] == 0.0
    # only where both evaluations voted
    assert "maj@4" not in ev.paired_change(result([0, 1, 0]), _eval_dict(
        {"t": {"q0": 1, "q1": 1, "q2": 1}}, 4))


def _eval_dict(counts: dict, k: int, pass_ks=(1, 2)) -> dict:
    """EvalResult.to_dict() of hand-given per-question correct counts {benchmark: {id: c}}."""
    benches = {name: ev.BenchmarkResult(name, list(per), np.asarray(list(per.values())), k,
                                        tuple(pass_ks))
               for name, per in counts.items()}
    return ev.EvalResult(benches, k, tuple(pass_ks)).to_dict()


def test_paired_change_matches_scipy_on_the_per_question_differences():
    from scipy import stats
    rng = np.random.default_rng(0)
    k = 4
    before = {"a": {f"q{i}": int(c) for i, c in enumerate(rng.integers(0, k + 1, 30))},
              "b": {i: int(c) for i, c in enumerate(rng.integers(0, k + 1, 10))}}
    after = {"a": dict(before["a"]), "b": dict(before["b"])}
    for q in list(after["a"])[:12]:
        after["a"][q] = min(k, after["a"][q] + 1)
    after["a"]["extra"] = k        # only in the later evaluation: not paired
    del after["b"][9]              # only in the earlier one
    change = ev.paired_change(_eval_dict(before, k), _eval_dict(after, k))
    keys = [("a", q) for q in before["a"]] + [("b", q) for q in range(9)]
    cb = np.asarray([before[n][q] for n, q in keys])
    ca = np.asarray([after[n][q] for n, q in keys])
    assert set(change) == {"avg@4", "pass@1", "pass@2"}
    for name, (b, a) in {"avg@4": (cb / k, ca / k),
                         "pass@2": ([_pass_at_k_brute_force(k, c, 2) for c in cb],
                                    [_pass_at_k_brute_force(k, c, 2) for c in ca])}.items():
        d = np.subtract(a, b)
        half = stats.t.ppf(0.975, len(d) - 1) * stats.sem(d)
        got = change[name]
        assert got["n"] == 39
        assert got["before"] == pytest.approx(np.mean(b)) and got["after"] == pytest.approx(np.mean(a))
        assert got["diff"] == pytest.approx(d.mean())
        assert (got["lo"], got["hi"]) == pytest.approx((d.mean() - half, d.mean() + half))
    assert change["pass@1"]["diff"] == pytest.approx(change["avg@4"]["diff"])
    assert ev.paired_change(_eval_dict({"a": {"x": 1}}, k), _eval_dict({"a": {"y": 1}}, k)) == {}


def test_evaluate_rejects_bad_generate_output(scorer):
    rows = [{"problem": "p", "answer": "1"}]
    with pytest.raises(ValueError, match="responses for prompt 0, want n=3"):
        ev.evaluate(lambda prompts, n: [["x"]], {"b": rows}, k=3, scorer=scorer)
    with pytest.raises(ValueError, match="groups for 1 prompts"):
        ev.evaluate(lambda prompts, n: [], {"b": rows}, k=3, scorer=scorer)
    with pytest.raises(ValueError, match="pass_ks"):
        ev.evaluate(lambda prompts, n: [], {"b": rows}, k=3, pass_ks=(4,), scorer=scorer)


def test_evaluate_creates_and_closes_its_own_scorer(monkeypatch):
    """Without a scorer evaluate() makes its own (a math one here) and closes it at the end,
    also when generation raises (here for the second benchmark, the scorer made for the
    first)."""
    from delta_jax.rl import rewards

    made = []

    class Recording(rewards.RewardScorer):  # what evaluate() imports from rl.rewards
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.close_calls = 0
            made.append(self)

        def close(self):
            self.close_calls += 1
            super().close()

    monkeypatch.setattr(rewards, "RewardScorer", Recording)
    rows = [{"problem": "p", "answer": "\\frac{1}{2}"}]
    result = ev.evaluate(lambda prompts, n: [["\\boxed{0.5}", "\\boxed{2}"]], {"b": rows}, k=2)
    assert result.benchmarks["b"].num_correct.tolist() == [1]
    assert [(s.name, s.close_calls) for s in made] == [("math", 1)]

    def failing_on_the_second(prompts, n):  # the scorer is made for the first benchmark
        if prompts[0].startswith("q"):
            raise RuntimeError("generation failed")
        return [["\\boxed{0.5}"] * n]

    made.clear()
    with pytest.raises(RuntimeError, match="generation failed"):
        ev.evaluate(failing_on_the_second, {"b": rows, "c": [{"problem": "q", "answer": "1"}]},
                    k=2)
    assert [(s.name, s.close_calls) for s in made] == [("math", 1)]


def test_evaluate_prompts_and_scores_each_kind_by_its_own_mapping_entry(scorer):
    """format_prompt / scorer as {kind: ...}: a math and a code benchmark in one evaluation each
    get their kind's prompt and scorer; a kind the prompt mapping lacks gets the default."""
    spec = json.dumps({"tests": ["assert f(2) == 4"]})
    benchmarks = {"m": [{"problem": "1 + 1?", "answer": "2"}],
                  "c": [{"problem": "f(x) = 2x", "answer": spec}]}

    class CodeScorer:  # stands in for the code sandbox: every program passes
        calls = []

        def score(self, responses, golds, response_lengths=None, truncated=None,
                  problems=None, data_sources=None, extra_infos=None, **kw):
            self.calls.append((list(golds), list(problems)))
            n = len(responses)
            return np.ones(n, np.float32), {"accuracy": np.ones(n, np.float32),
                                            "num_no_box": 0, "num_timeouts": 0, "num_errors": 0}

    prompts = []

    def gen(batch, n):
        prompts.extend(batch)
        return [["\\boxed{2}"] * n for _ in batch]

    result = ev.evaluate(gen, benchmarks, k=2, format_prompt={"math": lambda p: f"M: {p}"},
                         scorer={"math": scorer, "code": CodeScorer()})
    assert prompts == ["M: 1 + 1?", ev.default_code_prompt("f(x) = 2x")]
    # the code golds went to the code scorer only, with their problems' text
    assert CodeScorer.calls == [([spec, spec], ["f(x) = 2x"] * 2)]
    assert result.benchmarks["m"].num_correct.tolist() == [2]
    assert result.benchmarks["c"].num_correct.tolist() == [2]


def test_response_lengths_are_reported_where_the_generate_fn_gives_them(scorer):
    """A generate_fn returning an object with texts, response_lengths and truncated (the
    sampler's GenerationOutput) adds response_len_mean / _max and truncated_frac per benchmark
    and over every sample to the results (so eval/benchmarks/<name>/response_len_mean is
    logged); one returning texts alone adds none."""
    rows = {"a": [{"id": "a1", "problem": "P1", "answer": "1"},
                  {"id": "a2", "problem": "P2", "answer": "2"}],
            "b": [{"id": "b1", "problem": "P3", "answer": "3"}]}
    lengths = {"P1": [10, 30], "P2": [20, 100], "P3": [5, 5]}

    def generate_fn(prompts, n):
        return SimpleNamespace(texts=[["\\boxed{1}"] * n for _ in prompts],
                               response_lengths=[lengths[p] for p in prompts],
                               truncated=[[t == 100 for t in lengths[p]] for p in prompts])

    result = ev.evaluate(generate_fn, rows, k=2, format_prompt=lambda p: p, scorer=scorer)
    d = result.to_dict()
    assert d["benchmarks"]["a"]["response_len_mean"] == 40.0  # (10 + 30 + 20 + 100) / 4
    assert d["benchmarks"]["a"]["response_len_max"] == 100
    assert d["benchmarks"]["a"]["truncated_frac"] == 0.25
    assert d["benchmarks"]["b"]["response_len_mean"] == 5.0
    assert d["average"]["response_len_mean"] == 170 / 6 and d["average"]["truncated_frac"] == 1 / 6
    flat = result.flat_metrics()
    assert flat["eval/benchmarks/a/response_len_mean"] == 40.0
    assert result.benchmarks["a"].num_correct.tolist() == [2, 0]  # the texts were scored
    plain = ev.evaluate(lambda prompts, n: [["x"] * n for _ in prompts], rows, k=2,
                        format_prompt=lambda p: p, scorer=scorer).to_dict()
    assert "response_len_mean" not in plain["benchmarks"]["a"]
    assert "response_len_mean" not in plain["average"]


def test_the_responses_token_ids_and_the_trainer_state_reach_the_scorer():
    """A generate_fn whose result has response_ids (the sampler's GenerationOutput) gives the
    scorer each response's ids, flattened in the responses' order, and evaluate()'s
    trainer_state (a batch reward's completion_ids= and trainer_state=); a count of ids that
    is not one a response names the benchmark."""
    from delta_jax.rl.rewards import TrainerState

    calls = []

    class Recording:
        def score(self, responses, golds, response_lengths=None, truncated=None, **kw):
            calls.append((list(responses), kw.get("response_ids"), kw.get("trainer_state")))
            n = len(responses)
            return np.ones(n, np.float32), {"accuracy": np.ones(n, np.float32),
                                            "num_no_box": 0, "num_timeouts": 0, "num_errors": 0}

    rows = [{"id": "a", "problem": "P1", "answer": "1"}, {"id": "b", "problem": "P2",
                                                           "answer": "2"}]

    def generate_fn(prompts, n, drop=0):
        return SimpleNamespace(texts=[[f"{p}-{j}" for j in range(n)] for p in prompts],
                               response_ids=[[[int(p[1]), j] for j in range(n)]
                                             for p in prompts][drop:])

    state = TrainerState(global_step=5, max_steps=7)
    ev.evaluate(generate_fn, {"b": rows}, k=2, format_prompt=lambda p: p, scorer=Recording(),
                trainer_state=state)
    assert calls == [(["P1-0", "P1-1", "P2-0", "P2-1"], [[1, 0], [1, 1], [2, 0], [2, 1]], state)]
    with pytest.raises(ValueError, match="^b: generate_fn returned 2 response_ids for 4"):
        ev.evaluate(lambda p, n: generate_fn(p, n, drop=1), {"b": rows}, k=2,
                    format_prompt=lambda p: p, scorer=Recording())


def test_sampler_generate_fn_uses_eval_settings():
    seen = []

    class FakeSampler:
        def generate(self, prompts, n, **kw):
            seen.append(kw)
            return SimpleNamespace(texts=[[f"{p}-{j}" for j in range(n)] for p in prompts])

    gen = ev.sampler_generate_fn(FakeSampler(), max_new_tokens=8)
    assert gen(["a", "b"], 2).texts == [["a-0", "a-1"], ["b-0", "b-1"]]
    gen(["a"], 1)
    assert seen[0]["temperature"] == 1.0 and seen[0]["top_p"] == 0.7
    assert [s["seed"] for s in seen] == [0, 1]
    no_tok = SimpleNamespace(generate=lambda prompts, n, **kw: SimpleNamespace(texts=None))
    with pytest.raises(ValueError, match="tokenizer"):
        ev.sampler_generate_fn(no_tok)(["a"], 1)


def test_sampler_generate_fn_sums_the_samplers_counters():
    """sampler_counters: GenerationOutput.counters() of every call, added up (what the eval hook
    logs as eval/tokens_per_s, eval/preemptions, ...)."""
    from delta_jax.sampling.output import COUNTERS, GenerationOutput

    class CountingSampler:
        def generate(self, prompts, n, **kw):
            k = len(prompts)
            return GenerationOutput(
                prompt_ids=[[1]] * k, response_ids=[[[2]] * n] * k, logprobs=[],
                tempered_logprobs=[],
                response_lengths=[[1] * n] * k, truncated=[[False] * n] * k,
                texts=[["x"] * n] * k,
                stats={"generated_tokens": 10 * k, "decode_steps": 4, "slots": 8, "preemptions": k,
                       "resumed": k - 1, "prefill_seconds": 0.5, "decode_seconds": 1.5,
                       "seconds": 2.5})

    gen = ev.sampler_generate_fn(CountingSampler())
    gen(["a", "b"], 2)
    gen(["c"], 2)
    assert dict(gen.sampler_counters) == {
        "generated_tokens": 30.0, "decode_steps": 8.0, "slot_steps": 64.0, "preemptions": 3.0,
        "resumed": 1.0, "prefill_seconds": 1.0, "decode_seconds": 3.0, "seconds": 5.0}
    assert set(gen.sampler_counters) == set(COUNTERS)
    from delta_jax.train.metrics import sampler_metrics
    m = sampler_metrics(gen.sampler_counters, "eval")
    assert m["eval/tokens_per_s"] == 6.0 and m["eval/slot_utilization"] == 30 / 64
    assert m["eval/preemptions"] == 3.0 and m["eval/decode_s"] == 3.0
    assert m["eval/resumed"] == 1.0


# --- code benchmarks -----------------------------------------------------------------------


def _code_isolation_or_skip():
    from delta_jax.rl import verify_pool as vp
    from delta_jax.rl.rewards import _SANDBOX_FN

    with vp.VerifyPool(_SANDBOX_FN, num_workers=1, timeout_s=60) as pool:
        probe = pool.map([({"op": "probe"},)])[0].value
    if not probe["ok"]:
        pytest.skip(f"this host cannot isolate programs: {probe['why']}")


def test_humaneval_pass_at_k(shared_dir):
    path = shared_dir / "data" / "humaneval.jsonl"
    if not path.is_file():
        pytest.skip("humaneval.jsonl is not present in ../shared/data")
    _code_isolation_or_skip()
    rows = ev.load_benchmark(path, limit=12)
    assert all(r["kind"] == "code" for r in rows) and rows[0]["id"] == "HumanEval/0"
    solutions = {json.loads(line)["id"]: json.loads(line)["canonical_solution"]
                 for line in path.open(encoding="utf-8")}
    by_prompt = {}

    def generate_fn(prompts, n):
        out = []
        for p in prompts:
            q, row = by_prompt[p]
            out.append([f"```python\n{solutions[row['id']]}```" if j < q % 3 else
                        "```python\n    pass\n```" for j in range(n)])
        return out

    for q, row in enumerate(rows):
        by_prompt[ev.default_code_prompt(row["problem"])] = (q, row)
    result = ev.evaluate(generate_fn, {"humaneval": rows}, k=4, pass_ks=(1, 4))
    counts = [q % 3 for q in range(len(rows))]
    exp = _expected_metrics(counts, 4, (1, 4))
    got = result.benchmarks["humaneval"]
    assert got.num_correct.tolist() == counts
    assert got.avg_at_k == pytest.approx(exp["avg@4"])
    assert got.pass_at[4] == pytest.approx(exp["pass@4"])
    assert "```python" in next(iter(by_prompt))  # the code instruction, not \boxed{}
