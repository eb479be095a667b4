"""The synthetic arithmetic task and the tiny tokenizer built for it."""
import ast
import json
import operator
import os
import re

import pytest

from delta_jax.data import records, synthetic, tiny_tokenizer

# Independent reading of the word problems: phrase -> operation (written here, not imported).
WORD_OPS = [
    (r"buys (\d+) more", operator.add), (r"finds (\d+) more", operator.add),
    (r"gets (\d+) more", operator.add), (r"gives away (\d+)", operator.sub),
    (r"loses (\d+)", operator.sub), (r"sells (\d+)", operator.sub),
    (r"doubles them", lambda c: c * 2), (r"triples them", lambda c: c * 3),
]


def solve_word(problem):
    # The question names the person and item; other "X has N Y[, then ...]." sentences are
    # distractors (data.synthetic_distractors) about someone or something else.
    m = re.fullmatch(r"(.*) How many (\w+) does (\w+) have\?", problem)
    story, item, name = m.groups()
    sentences = [x for x in re.split(r"(?<=\.) ", story)]
    main = [x for x in sentences if x.startswith(f"{name} has ") and
            re.match(rf"{name} has \d+ {item}\b", x)]
    assert len(main) == 1, problem
    head, *clauses = main[0][:-1].split(", then ")
    count = int(re.fullmatch(r"\w+ has (\d+) \w+", head).group(1))
    for clause in clauses:
        for pattern, fn in WORD_OPS:
            m = re.fullmatch(pattern, clause)
            if m:
                count = fn(count, int(m.group(1))) if m.groups() else fn(count)
                break
        else:
            raise AssertionError(f"unknown clause {clause!r}")
    return count, len(clauses)


def solve_expression(problem):
    facts, expr = re.fullmatch(r"((?:[\d +\-*]+ is \d+\. )*)What is ([\d +\-*]+)\?", problem).groups()
    for a, op, b, c in re.findall(r"(\d+) ([+\-*]) (\d+) is (\d+)\.", facts):  # distractors: true
        assert {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](int(a), int(b)) == int(c)
    tree = ast.parse(expr, mode="eval")  # Python's own precedence rules
    assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult))
               for n in ast.walk(tree))
    return eval(compile(tree, "<problem>", "eval")), sum(isinstance(n, ast.BinOp) for n in ast.walk(tree))


def solve(problem):
    return solve_word(problem) if "How many" in problem else solve_expression(problem)


def check_record(rec, num_ops, digits=2):
    """The record's answer and worked solution are right, with num_ops steps, every value of
    the solution below 10**digits."""
    answer, ops = solve(rec["problem"])
    assert rec["answer"] == str(answer), rec
    assert ops == num_ops, rec
    steps = re.findall(r"(\d+) ([+\-*]) (\d+) = (\d+)\.", rec["solution"])
    assert len(steps) == num_ops, rec
    for a, op, b, c in steps:
        assert {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](int(a), int(b)) == int(c)
        assert max(int(a), int(b), int(c)) < 10 ** digits, rec
    assert rec["solution"].endswith(f"\\boxed{{{answer}}}")
    assert records.last_boxed(rec["solution"]) == rec["answer"]


@pytest.fixture(scope="module")
def splits():
    return synthetic.generate_splits(num_train=300, num_test=60, seed=0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tiny_tokenizer.build_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny_tok")))
    return AutoTokenizer.from_pretrained(path)


def all_records(splits):
    return splits["train"] + splits["test"]


def test_answers_are_right_and_steps_match_level(splits):
    for rec in all_records(splits):
        check_record(rec, synthetic.LEVELS[rec["level"]].steps)
        assert rec["problem"].startswith("What is") or "How many" in rec["problem"]


def test_levels_and_kinds_are_all_present(splits):
    seen = {(r["level"], r["problem"].startswith("What is")) for r in splits["train"]}
    assert seen == {(lv, k) for lv in synthetic.LEVELS for k in (True, False)}


def test_deterministic_by_seed(splits):
    assert synthetic.generate_splits(num_train=300, num_test=60, seed=0) == splits
    other = synthetic.generate_splits(num_train=300, num_test=60, seed=1)
    assert [r["problem"] for r in other["train"]] != [r["problem"] for r in splits["train"]]


def test_train_and_test_are_disjoint_across_seeds(splits):
    test_problems = {r["problem"] for r in splits["test"]}
    assert len(test_problems) == 60
    for seed in (0, 1, 2):
        train = synthetic.generate_splits(num_train=300, num_test=0, seed=seed)["train"]
        assert len({r["problem"] for r in train}) == 300
        assert not test_problems & {r["problem"] for r in train}


def test_written_files_load_through_the_records_reader(tmp_path):
    paths = synthetic.write_synthetic_splits(str(tmp_path), num_train=40, num_test=10, seed=3, levels=(1, 2))
    recs, stats = records.load_records(paths["train"])
    assert len(recs) == 40 and stats.num_skipped == 0 and set(stats.layouts.values()) == {"deltajax"}
    with open(paths["test"]) as f:
        raw = [json.loads(line) for line in f]
    assert set(raw[0]) == {"id", "problem", "answer", "solution", "level"}
    assert {r["level"] for r in recs} <= {1, 2}
    assert [r["solution"] for r in records.load_records(paths["test"])[0]] == [r["solution"] for r in raw]


def test_tiny_tokenizer_round_trips_and_is_short(splits, tok):
    assert len(tok) < 512
    for rec in all_records(splits):
        for key, limit in (("problem", 64), ("solution", 48)):
            ids = tok.encode(rec[key], add_special_tokens=False)
            assert tok.decode(ids) == rec[key]
            assert len(ids) < limit, (key, rec[key], len(ids))
    # Digits are always single tokens, so "37" and "73" share their pieces.
    pieces = tok.convert_ids_to_tokens(tok.encode("What is 37 + 73?", add_special_tokens=False))
    assert all(len(p.replace("Ġ", "")) == 1 for p in pieces if any(ch.isdigit() for ch in p))
    # Anything else still round-trips (byte-level).
    odd = "Ünïcode ∑ \\frac{1}{2}\t\n 12345 <|im_end|>"
    assert tok.decode(tok.encode(odd, add_special_tokens=False)) == odd


def test_tiny_tokenizer_special_tokens(tok):
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 1
    assert tok.convert_tokens_to_ids("<|im_start|>") == 2
    assert tok.encode("x<|im_end|>", add_special_tokens=False)[-1] == 1
    assert tok.bos_token_id is None
    assert tok.encode("What is 1 + 2?") == tok.encode("What is 1 + 2?", add_special_tokens=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"}],
                                     tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"


def test_project_reward_accepts_the_solutions(splits):
    from delta_jax.rl.rewards import math_reward

    sample = splits["test"][:12]
    assert all(math_reward(r["solution"], r["answer"]) == 1.0 for r in sample)
    assert math_reward(sample[0]["solution"], str(int(sample[0]["answer"]) + 1)) == 0.0


def test_synthetic_assets_are_made_once_and_remade_when_their_settings_change(tmp_path):
    from delta_jax.data import tiny_task

    paths = tiny_task.prepare_synthetic_splits(str(tmp_path / "s"), num_train=50, num_test=10,
                                               seed=2)
    mtime = os.path.getmtime(paths["train"])
    assert tiny_task.prepare_synthetic_splits(str(tmp_path / "s"), num_train=50, num_test=10,
                                              seed=2) == paths
    assert os.path.getmtime(paths["train"]) == mtime  # reused, not rewritten
    tiny_task.prepare_synthetic_splits(str(tmp_path / "s"), num_train=30, num_test=10, seed=2)
    assert len(records.load_records(paths["train"])[0]) == 30
    tok = tiny_task.prepare_tiny_tokenizer(str(tmp_path / "tok"))
    assert os.path.isfile(os.path.join(tok, "tokenizer.json"))
    mtime = os.path.getmtime(os.path.join(tok, "tokenizer.json"))
    assert tiny_task.prepare_tiny_tokenizer(str(tmp_path / "tok")) == tok
    assert os.path.getmtime(os.path.join(tok, "tokenizer.json")) == mtime


def test_synthetic_assets_are_replaced_whole_never_rewritten_in_place(tmp_path):
    """Every process of a multi-host run prepares the assets in a shared workdir: a process that
    is reading the old files while another remakes them reads them whole (the new files take
    the old names by os.replace, not by truncating them), and no private directory is left."""
    from delta_jax.data import tiny_task

    out = str(tmp_path / "s")
    paths = tiny_task.prepare_synthetic_splits(out, num_train=50, num_test=10, seed=2)
    with open(paths["train"], encoding="utf-8") as f:
        old = f.read()
    for remake in (dict(num_train=30), dict(num_train=30, seed=3)):
        with open(paths["train"], encoding="utf-8") as reader:  # open across the remake
            tiny_task.prepare_synthetic_splits(out, num_test=10, **{"seed": 2, **remake})
            assert reader.read() == old
        with open(paths["train"], encoding="utf-8") as f:
            new = f.read()
        assert new != old and len(new.splitlines()) == 30
        old = new
    tok = tiny_task.prepare_tiny_tokenizer(str(tmp_path / "tok"))
    assert sorted(os.listdir(out)) == ["manifest.json", "test.jsonl", "train.jsonl"]
    assert "manifest.json" in os.listdir(tok)
    assert not [n for n in os.listdir(tok) if n.startswith(".")]


# ----------------------------------------------------------------------------- pinned output
# Records of seed 0 as the generator wrote them before the difficulty knobs (steps, digits,
# distractors) existed: the default knobs must keep generating exactly these problems (the
# default run's data and the tiny tokenizer's training corpus depend on them).

PINNED_SEED0_TRAIN = [
    {"id": "synth-train-0", "problem": "What is 5 + 4 * 4 + 18 - 5?", "answer": "34",
     "solution": "4 * 4 = 16. 5 + 16 = 21. 21 + 18 = 39. 39 - 5 = 34. \\boxed{34}", "level": 4},
    {"id": "synth-train-1", "problem": "What is 3 + 11 * 5 - 4 + 10?", "answer": "64",
     "solution": "11 * 5 = 55. 3 + 55 = 58. 58 - 4 = 54. 54 + 10 = 64. \\boxed{64}", "level": 4},
    {"id": "synth-train-2", "problem": "Ben has 19 books, then gets 18 more, then gives away 15, "
     "then triples them. How many books does Ben have?", "answer": "66",
     "solution": "19 + 18 = 37. 37 - 15 = 22. 22 * 3 = 66. \\boxed{66}", "level": 3},
    {"id": "synth-train-3", "problem": "Sam has 8 pens, then gets 2 more, then triples them, then "
     "gives away 3. How many pens does Sam have?", "answer": "27",
     "solution": "8 + 2 = 10. 10 * 3 = 30. 30 - 3 = 27. \\boxed{27}", "level": 3},
]
PINNED_SEED0_TEST0 = {
    "id": "synth-test-0", "problem": "Eva has 12 apples, then gives away 9, then loses 2, then "
    "doubles them. How many apples does Eva have?", "answer": "2",
    "solution": "12 - 9 = 3. 3 - 2 = 1. 1 * 2 = 2. \\boxed{2}", "level": 3}
# sha256 of json.dumps(..., sort_keys=True) of these outputs of the pre-knob code.
PINNED_HASHES = {
    "splits_300_60_seed0": "0680d3ca9027388b313ed0977776584750d4337d8189379bfc55138a37722806",
    "stream_4000_seed0": "ae30080c3ad4b89381ff53fa2c61ba51140fc11e467ecbc16aebc7a9ff4756b7",
    "splits_200_20_seed3_levels12": "a69dbb83b5e02fc2efac799cb62cd2b6aff83474ef71236120f1e35de0483603",
    "splits_4096_64_seed0_levels12": "4b5015f653158ac7da425204ffaacf8f764a904443cfacd96ea2e78f39df79ca",
    "splits_4000_256_seed0_levels12": "1df09f205fdaaae0753eb15edfc684a3c7c851bf381c107ac3b42480c90dd9ab",
}


def _digest(obj):
    import hashlib
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def test_default_knobs_generate_the_pinned_problems(splits):
    assert splits["train"][:4] == PINNED_SEED0_TRAIN
    assert splits["test"][0] == PINNED_SEED0_TEST0
    assert _digest(splits) == PINNED_HASHES["splits_300_60_seed0"]
    stream = synthetic.iter_problems(0)
    assert _digest([next(stream) for _ in range(4000)]) == PINNED_HASHES["stream_4000_seed0"]
    assert _digest(synthetic.generate_splits(200, 20, seed=3, levels=(1, 2))) == \
        PINNED_HASHES["splits_200_20_seed3_levels12"]
    # The config default (4096 + 64) and the default job's data (experiments/tiny.py: 4000 + 256
    # problems of levels 1, 2), with the knobs spelled out at their defaults.
    assert _digest(synthetic.generate_splits(4096, 64, seed=0, levels=(1, 2), steps=0, digits=2,
                                             distractors=0)) == \
        PINNED_HASHES["splits_4096_64_seed0_levels12"]
    assert _digest(synthetic.generate_splits(4000, 256, seed=0, levels=(1, 2), steps=0, digits=2,
                                             distractors=0)) == \
        PINNED_HASHES["splits_4000_256_seed0_levels12"]



# ----------------------------------------------------------------------------- difficulty knobs


def test_level_spec_defaults_are_the_levels_and_ranges_scale_with_digits():
    for lv, level in synthetic.LEVELS.items():
        assert synthetic.level_spec(lv) == level and level.max_value == synthetic.MAX_VALUE
        assert synthetic.level_spec(lv, steps=7).steps == 7
        previous = None
        for digits in range(1, synthetic.MAX_DIGITS + 1):
            spec = synthetic.level_spec(lv, digits=digits)
            assert spec.max_value == 10 ** digits - 1 and spec.steps == level.steps
            assert 2 <= spec.max_operand <= spec.max_value and 2 <= spec.max_multiplier <= 9
            if previous is not None:
                assert spec.max_operand > previous.max_operand
            previous = spec
    for bad in (dict(digits=0), dict(digits=7), dict(steps=-1)):
        with pytest.raises(ValueError):
            synthetic.level_spec(1, **bad)
    with pytest.raises(ValueError, match="distractors"):
        synthetic.make_problem(synthetic.random.Random(0), 1, "word", distractors=-1)


@pytest.mark.parametrize("knobs", [
    dict(steps=30, digits=3),                    # the long GPU-scale problems
    dict(steps=12, digits=1, distractors=1),     # tight value range: the expressions are built
    dict(digits=6, distractors=3),
    dict(steps=1, digits=2, distractors=2),
])
def test_knobs_make_right_problems_of_the_asked_shape(knobs):
    out = synthetic.generate_splits(120, 12, seed=5, **knobs)
    recs = out["train"] + out["test"]
    assert len({r["problem"] for r in recs}) == len(recs) == 132
    kinds = set()
    for rec in recs:
        check_record(rec, knobs.get("steps") or synthetic.LEVELS[rec["level"]].steps,
                     knobs.get("digits", 2))
        kinds.add("How many" in rec["problem"])
        # Distractors: that many extra statements (word: sentences besides the story; expression:
        # facts before the question); only the tokenizer corpus's words.
        d = knobs.get("distractors", 0)
        if "How many" in rec["problem"]:
            assert rec["problem"].count(" has ") == 1 + d
        else:
            assert rec["problem"].count(" is ") == 1 + d
        words = set(re.findall(r"[A-Za-z]+", rec["problem"]))
        assert words <= set(synthetic.VOCABULARY), words - set(synthetic.VOCABULARY)
    assert kinds == {True, False}
    # Deterministic, and the knobs change the problems.
    assert synthetic.generate_splits(120, 12, seed=5, **knobs) == out
    assert out != synthetic.generate_splits(120, 12, seed=5)


def test_built_expressions_stay_in_range():
    # The left-to-right construction (what long expressions fall back on) on its own.
    rng = synthetic.random.Random(0)
    for digits in (1, 2, 3):
        for lv in synthetic.LEVELS:
            spec = synthetic.level_spec(lv, steps=40, digits=digits)
            for _ in range(20):
                operands, ops = synthetic._build_expression(rng, spec)
                assert len(ops) == 40 and len(operands) == 41
                steps, answer = synthetic._expression_steps(operands, ops, spec.max_value)
                assert steps is not None and 0 <= answer <= spec.max_value
                assert answer == eval(synthetic._expression_text(operands, ops)[8:-1])


def test_long_problems_tokenize_to_a_few_hundred_tokens(tok):
    recs = synthetic.generate_splits(40, 4, seed=0, steps=30, digits=3, distractors=2)["train"]
    lengths = [len(tok.encode(r["solution"], add_special_tokens=False)) for r in recs]
    assert 250 < max(lengths) < 600, lengths
    assert all(tok.decode(tok.encode(r["problem"], add_special_tokens=False)) == r["problem"]
               for r in recs)


def test_cli_and_assets_take_the_knobs(tmp_path):
    from delta_jax.data import tiny_task

    synthetic.main(["--out_dir", str(tmp_path / "cli"), "--num_train", "20", "--num_test", "2",
                    "--steps", "6", "--digits", "3", "--distractors", "1"])
    recs, _ = records.load_records(str(tmp_path / "cli" / "train.jsonl"))
    assert len(recs) == 20 and all(r["solution"].count(" = ") == 6 for r in recs)
    base = dict(num_train=30, num_test=4, seed=1)
    paths = tiny_task.prepare_synthetic_splits(str(tmp_path / "s"), **base)
    default = records.load_records(paths["train"])[0]
    # Other knob values give other files (the manifest records them) ...
    tiny_task.prepare_synthetic_splits(str(tmp_path / "s"), **base, steps=5)
    assert all(r["solution"].count(" = ") == 5 for r in records.load_records(paths["train"])[0])
    tiny_task.prepare_synthetic_splits(str(tmp_path / "s"), **base, digits=4, distractors=2)
    assert records.load_records(paths["train"])[0] != default
    # ... and the defaults give the old ones back.
    tiny_task.prepare_synthetic_splits(str(tmp_path / "s"), **base, steps=0, digits=2,
                                       distractors=0)
    assert records.load_records(paths["train"])[0] == default
