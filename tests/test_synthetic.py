"""The synthetic arithmetic task and the tiny tokenizer built for it."""
import ast
import importlib.util
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
    head, *clauses = problem.split(". How many")[0].split(", then ")
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
    expr = re.fullmatch(r"What is ([\d +\-*]+)\?", problem).group(1)
    tree = ast.parse(expr, mode="eval")  # Python's own precedence rules
    assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult))
               for n in ast.walk(tree))
    return eval(compile(tree, "<problem>", "eval")), sum(isinstance(n, ast.BinOp) for n in ast.walk(tree))


def solve(problem):
    return solve_expression(problem) if problem.startswith("What is") else solve_word(problem)


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
        answer, num_ops = solve(rec["problem"])
        assert rec["answer"] == str(answer), rec
        assert num_ops == synthetic.LEVELS[rec["level"]].steps, rec
        # The worked solution: one "a op b = c." per operation, each step correct, answer boxed.
        steps = re.findall(r"(\d+) ([+\-*]) (\d+) = (\d+)\.", rec["solution"])
        assert len(steps) == num_ops, rec
        for a, op, b, c in steps:
            assert {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](int(a), int(b)) == int(c)
        assert rec["solution"].endswith(f"\\boxed{{{answer}}}")
        assert records.last_boxed(rec["solution"]) == rec["answer"]


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


@pytest.mark.skipif(importlib.util.find_spec("delta_jax.rl.rewards") is None,
                    reason="delta_jax/rl/rewards.py not there yet")
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
