"""A verifiable task the project generates itself: short multi-step integer arithmetic problems.

Two kinds, with a small regular vocabulary so a ~1-5M-parameter model learns them in minutes:

  word        "Tom has 3 apples, then buys 4 more, then gives away 2. How many apples does Tom
               have?"  (+ buys/finds/gets N more, - gives away/loses/sells N, * doubles/triples
               them)
  expression  "What is 3 + 4 * 2 - 5?"  (usual precedence: * before + and -, then left to right)

Each problem has a short worked solution in the RL target format, one "a op b = c." per step and
the answer in \\boxed{} at the end:

    "4 * 2 = 8. 3 + 8 = 11. 11 - 5 = 6. \\boxed{6}"

A level fixes the number of steps (operations) and the operand range (LEVELS); every value along the
way (each step's result, every product) is an integer in 0..MAX_VALUE (99), which keeps solutions
short and answers non-negative. Everything is
deterministic from the seed. Train and test splits are disjoint by construction: a problem goes to
the test split iff a hash of its text says so, whatever the seed or split sizes, so no test problem
ever appears in any training file made by this module.

Files are JSON Lines in the project's {"id","problem","answer","solution","level"} layout, so the
ordinary pipeline (records.load_records / builders.build_tfds_source) serves them.

    python -m delta_jax.data.synthetic --out_dir /tmp/synth --num_train 20000 --num_test 500
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
from typing import Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class Level:
    steps: int  # operations per problem
    max_operand: int  # operands are drawn from 1..max_operand
    max_multiplier: int  # right operand of "*" (expressions) is 2..max_multiplier


LEVELS: dict[int, Level] = {
    1: Level(steps=1, max_operand=9, max_multiplier=3),
    2: Level(steps=2, max_operand=9, max_multiplier=3),
    3: Level(steps=3, max_operand=19, max_multiplier=4),
    4: Level(steps=4, max_operand=19, max_multiplier=5),
}

KINDS = ("word", "expression")
NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Eva")
ITEMS = ("apples", "pens", "books", "cards", "coins", "eggs")
ADD_PHRASES = ("buys {n} more", "finds {n} more", "gets {n} more")
SUB_PHRASES = ("gives away {n}", "loses {n}", "sells {n}")
MUL_PHRASES = {2: "doubles them", 3: "triples them"}
MAX_VALUE = 99  # every intermediate value stays in 0..99: solutions stay < 48 tokens

# Every word the generator can write (besides digits and punctuation); the tiny tokenizer's corpus.
VOCABULARY = sorted(
    set(NAMES)
    | set(ITEMS)
    | {w for p in ADD_PHRASES + SUB_PHRASES + tuple(MUL_PHRASES.values()) for w in p.split() if w != "{n}"}
    | {"has", "then", "How", "many", "does", "have", "What", "is"}
)


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _step_text(a: int, op: str, b: int) -> str:
    return f"{a} {op} {b} = {_apply(op, a, b)}."


def _word_problem(rng: random.Random, level: Level) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start = count = rng.randint(2, level.max_operand)  # plural nouns read right
    clauses, steps = [], []
    for _ in range(level.steps):
        options = (["+"] if count < MAX_VALUE else []) + (["-"] if count > 0 else [])
        if count * 2 <= MAX_VALUE:
            options.append("*")
        op = rng.choice(options)
        if op == "*":
            factor = 2 if count * 3 > MAX_VALUE else rng.choice((2, 3))
            clauses.append(MUL_PHRASES[factor])
            steps.append(_step_text(count, "*", factor))
            count *= factor
            continue
        if op == "-":
            n = rng.randint(1, min(count, level.max_operand))
            clauses.append(rng.choice(SUB_PHRASES).format(n=n))
        else:
            n = rng.randint(1, min(level.max_operand, MAX_VALUE - count))
            clauses.append(rng.choice(ADD_PHRASES).format(n=n))
        steps.append(_step_text(count, op, n))
        count = _apply(op, count, n)
    text = f"{name} has {start} {item}"
    text += "".join(f", then {c}" for c in clauses)
    text += f". How many {item} does {name} have?"
    return text, steps, count


def _expression_problem(rng: random.Random, level: Level) -> tuple[str, list[str], int]:
    # Rejection sampling keeps every intermediate value in 0..MAX_VALUE (short solutions).
    for _ in range(10_000):
        ops = [rng.choice("+-*") for _ in range(level.steps)]
        operands = [rng.randint(1, level.max_operand)]
        for op in ops:
            hi = level.max_multiplier if op == "*" else level.max_operand
            operands.append(rng.randint(2 if op == "*" else 1, hi))
        steps, answer = _expression_steps(operands, ops)
        if steps is not None:
            text = "What is " + " ".join(
                [str(operands[0])] + [f"{op} {x}" for op, x in zip(ops, operands[1:])]
            ) + "?"
            return text, steps, answer
    raise RuntimeError(f"no expression with values in 0..{MAX_VALUE} found for {level}")


def _expression_steps(operands: list[int], ops: list[str]) -> tuple[list[str] | None, int]:
    """Worked steps: products first (left to right), then sums and differences left to right.

    Returns (None, 0) when an intermediate value leaves 0..MAX_VALUE.
    """
    values, pending_ops, steps = [operands[0]], [], []
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            steps.append(_step_text(values[-1], "*", x))
            values[-1] *= x
        else:
            pending_ops.append(op)
            values.append(x)
    total = values[0]
    if max(values) > MAX_VALUE:
        return None, 0
    for op, x in zip(pending_ops, values[1:]):
        steps.append(_step_text(total, op, x))
        total = _apply(op, total, x)
        if not 0 <= total <= MAX_VALUE:
            return None, 0
    return steps, total


def make_problem(rng: random.Random, level: int, kind: str) -> dict:
    """One problem {"problem","answer","solution","level"} of a level (1..4) and kind."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level}; known: {sorted(LEVELS)}")
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {KINDS}")
    make = _word_problem if kind == "word" else _expression_problem
    text, steps, answer = make(rng, LEVELS[level])
    solution = " ".join(steps) + f" \\boxed{{{answer}}}"
    return {"problem": text, "answer": str(answer), "solution": solution, "level": level}


def is_test_problem(problem: str, test_fraction: float) -> bool:
    """The fixed train/test assignment of a problem text (a hash, independent of any seed)."""
    digest = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big")
    return digest / 2**64 < test_fraction


def iter_problems(seed: int, levels: Sequence[int] = (1, 2, 3, 4), kinds: Sequence[str] = KINDS) -> Iterator[dict]:
    """An endless deterministic stream of problems, level and kind drawn uniformly."""
    rng = random.Random(seed)
    while True:
        yield make_problem(rng, rng.choice(list(levels)), rng.choice(list(kinds)))


def generate_splits(
    num_train: int,
    num_test: int,
    seed: int = 0,
    levels: Sequence[int] = (1, 2, 3, 4),
    kinds: Sequence[str] = KINDS,
    test_fraction: float = 0.1,
) -> dict[str, list[dict]]:
    """{"train": [...], "test": [...]} of distinct problems; no problem text is in both splits.

    Records: {"id": "synth-<split>-<i>", "problem", "answer", "solution", "level"}.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    wanted = {"train": num_train, "test": num_test}
    out: dict[str, list[dict]] = {"train": [], "test": []}
    seen: set[str] = set()
    budget = 50 * (num_train + num_test) + 10_000  # small levels have few distinct problems
    for tries, prob in enumerate(iter_problems(seed, levels, kinds)):
        if all(len(out[s]) >= wanted[s] for s in out):
            break
        if tries >= budget:
            raise ValueError(
                f"could not find {num_train} + {num_test} distinct problems for levels {list(levels)}; "
                "ask for fewer or add levels"
            )
        if prob["problem"] in seen:
            continue
        seen.add(prob["problem"])
        split = "test" if is_test_problem(prob["problem"], test_fraction) else "train"
        if len(out[split]) < wanted[split]:
            out[split].append({"id": f"synth-{split}-{len(out[split])}", **prob})
    return out


def write_jsonl(records: Sequence[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def write_synthetic_splits(
    out_dir: str,
    num_train: int = 20_000,
    num_test: int = 500,
    seed: int = 0,
    levels: Sequence[int] = (1, 2, 3, 4),
    kinds: Sequence[str] = KINDS,
) -> dict[str, str]:
    """Write <out_dir>/train.jsonl and <out_dir>/test.jsonl; returns {"train": path, "test": path}."""
    splits = generate_splits(num_train, num_test, seed=seed, levels=levels, kinds=kinds)
    paths = {}
    for split, recs in splits.items():
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        write_jsonl(recs, paths[split])
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--num_train", type=int, default=20_000)
    parser.add_argument("--num_test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--levels", default="1,2,3,4", help="comma-separated, from 1..4")
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args(argv)
    paths = write_synthetic_splits(
        args.out_dir, args.num_train, args.num_test, args.seed,
        levels=[int(x) for x in args.levels.split(",")], kinds=args.kinds.split(","),
    )
    for split, path in paths.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
