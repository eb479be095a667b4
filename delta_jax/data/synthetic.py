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

Difficulty knobs (config data.synthetic_*; the defaults give exactly the problems of the
generator before the knobs existed):

  steps        0: each level's own number of operations; > 0: every problem has exactly this
               many (the level still sets the operand ranges). Any number works: expressions are
               rejection-sampled as before and, when that keeps failing (long problems), built
               left to right choosing only operations that keep every value in range.
  digits       1..6 (default 2): every value along the way stays below 10**digits; the operand
               ranges scale with it (level_spec): 2 digits = LEVELS as written, 3 digits = operands
               up to 99 / 199, ...; multipliers grow slowly (at most 9).
  distractors  that many irrelevant statements per problem, placed before or after the story
               (word: "Ann has 7 pens." or "Ann has 7 pens, then loses 2." about another person or
               item) or before the question (expression: a true fact "6 + 7 is 13."). They use
               only VOCABULARY words (the tiny tokenizer is unchanged) and never enter the solution.

Token-level ground truth for credit assignment (token_classes): which tokens of a sampled response
are the decisive ones (intermediate results, the boxed answer), which are boilerplate, and where
the response first departs from the reference solution (the class codes are rl.credit's).

Files are JSON Lines in the project's {"id","problem","answer","solution","level"} layout, so the
ordinary pipeline (records.load_records / builders.build_tfds_source) serves them.

    python -m delta_jax.data.synthetic --out_dir /tmp/synth --num_train 20000 --num_test 500 \\
        [--steps 30 --digits 3 --distractors 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import random
import re
from typing import Iterator, Sequence

import numpy as np

from delta_jax import files
from delta_jax.rl import credit


@dataclasses.dataclass(frozen=True)
class Level:
    steps: int  # operations per problem
    max_operand: int  # operands are drawn from 1..max_operand
    max_multiplier: int  # right operand of "*" (expressions) is 2..max_multiplier
    max_value: int = 99  # every value along the way stays in 0..max_value (MAX_VALUE)


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
DEFAULT_DIGITS = 2  # = MAX_VALUE's 2 digits
MAX_DIGITS = 6
_MAX_MULTIPLIER = 9
# Expressions: rejection-sampling tries before the left-to-right construction takes over. The
# levels' acceptance rates are >= 45%, so the default problems never get near it (0.55**100).
_REJECTION_TRIES = 100

# Every word the generator can write (besides digits and punctuation); the tiny tokenizer's corpus.
VOCABULARY = sorted(
    set(NAMES)
    | set(ITEMS)
    | {w for p in ADD_PHRASES + SUB_PHRASES + tuple(MUL_PHRASES.values()) for w in p.split() if w != "{n}"}
    | {"has", "then", "How", "many", "does", "have", "What", "is"}
)


def level_spec(level: int, steps: int = 0, digits: int = DEFAULT_DIGITS) -> Level:
    """The Level a problem of `level` is made with under the difficulty knobs (see the module
    docstring): LEVELS[level] itself for steps=0, digits=2."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level}; known: {sorted(LEVELS)}")
    if int(steps) < 0:
        raise ValueError(f"steps must be >= 0 (0 = the level's own), got {steps}")
    if not 1 <= int(digits) <= MAX_DIGITS:
        raise ValueError(f"digits must be in 1..{MAX_DIGITS}, got {digits}")
    base = LEVELS[level]
    spec = dataclasses.replace(base, steps=int(steps) or base.steps)
    if digits == DEFAULT_DIGITS:
        return spec
    if digits == 1:
        max_operand = base.max_operand // 2  # 4 (levels 1, 2), 9 (levels 3, 4)
    else:  # 9 -> 99 -> 999 ..., 19 -> 199 -> 1999 ...
        max_operand = (base.max_operand + 1) * 10 ** (digits - DEFAULT_DIGITS) - 1
    max_multiplier = min(_MAX_MULTIPLIER,
                         max(2, base.max_multiplier + 2 * (digits - DEFAULT_DIGITS)))
    return dataclasses.replace(spec, max_operand=max_operand, max_multiplier=max_multiplier,
                               max_value=10 ** digits - 1)


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _step_text(a: int, op: str, b: int) -> str:
    return f"{a} {op} {b} = {_apply(op, a, b)}."


def _word_story(rng: random.Random, level: Level) -> tuple[str, list[str], int, tuple[str, str]]:
    """(problem text, worked steps, answer, (name, item))."""
    max_value = level.max_value
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start = count = rng.randint(2, level.max_operand)  # plural nouns read right
    clauses, steps = [], []
    for _ in range(level.steps):
        options = (["+"] if count < max_value else []) + (["-"] if count > 0 else [])
        if count * 2 <= max_value:
            options.append("*")
        op = rng.choice(options)
        if op == "*":
            factor = 2 if count * 3 > max_value else rng.choice((2, 3))
            clauses.append(MUL_PHRASES[factor])
            steps.append(_step_text(count, "*", factor))
            count *= factor
            continue
        if op == "-":
            n = rng.randint(1, min(count, level.max_operand))
            clauses.append(rng.choice(SUB_PHRASES).format(n=n))
        else:
            n = rng.randint(1, min(level.max_operand, max_value - count))
            clauses.append(rng.choice(ADD_PHRASES).format(n=n))
        steps.append(_step_text(count, op, n))
        count = _apply(op, count, n)
    text = f"{name} has {start} {item}"
    text += "".join(f", then {c}" for c in clauses)
    text += f". How many {item} does {name} have?"
    return text, steps, count, (name, item)


def _expression_problem(rng: random.Random, level: Level) -> tuple[str, list[str], int]:
    # Rejection sampling keeps every intermediate value in 0..max_value (short solutions); long
    # problems, which it rarely finds, are built left to right instead (_build_expression).
    for _ in range(_REJECTION_TRIES):
        ops = [rng.choice("+-*") for _ in range(level.steps)]
        operands = [rng.randint(1, level.max_operand)]
        for op in ops:
            hi = level.max_multiplier if op == "*" else level.max_operand
            operands.append(rng.randint(2 if op == "*" else 1, hi))
        steps, answer = _expression_steps(operands, ops, level.max_value)
        if steps is not None:
            return _expression_text(operands, ops), steps, answer
    operands, ops = _build_expression(rng, level)
    steps, answer = _expression_steps(operands, ops, level.max_value)
    if steps is None:  # _build_expression only picks operations that keep values in range
        raise AssertionError(f"built an invalid expression {operands} {ops} for {level}")
    return _expression_text(operands, ops), steps, answer


def _expression_text(operands: list[int], ops: list[str]) -> str:
    return "What is " + " ".join(
        [str(operands[0])] + [f"{op} {x}" for op, x in zip(ops, operands[1:])]) + "?"


def _build_expression(rng: random.Random, level: Level) -> tuple[list[int], list[str]]:
    """Operands and operators of `level.steps` operations, drawn left to right among the choices
    that keep every value of the worked solution in 0..max_value (always at least one: closing
    the current term leaves a total t in range, and t < max_value allows "+", t > 0 allows "-").

    State: `total` of the closed terms (None before the first "+" / "-"), the pending operator of
    the open term and the open term's value (its product so far)."""
    top = level.max_value
    total, pending = None, None
    term = rng.randint(1, level.max_operand)
    operands, ops = [term], []

    def term_room() -> int:  # the largest value the open term may reach
        return top if pending is None else top - total if pending == "+" else total

    for _ in range(level.steps):
        closed = term if pending is None else _apply(pending, total, term)
        max_factor = min(level.max_multiplier, term_room() // term) if term > 0 else 0
        options = (["*"] if max_factor >= 2 else []) + (["+"] if closed < top else []) + (
            ["-"] if closed > 0 else [])
        op = rng.choice(options)
        if op == "*":
            x = rng.randint(2, max_factor)
            term *= x
        else:
            total, pending = closed, op
            x = rng.randint(1, min(level.max_operand, top - total if op == "+" else total))
            term = x
        operands.append(x)
        ops.append(op)
    return operands, ops


def _expression_steps(operands: list[int], ops: list[str], max_value: int = MAX_VALUE
                      ) -> tuple[list[str] | None, int]:
    """Worked steps: products first (left to right), then sums and differences left to right.

    Returns (None, 0) when an intermediate value leaves 0..max_value.
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
    if max(values) > max_value:
        return None, 0
    for op, x in zip(pending_ops, values[1:]):
        steps.append(_step_text(total, op, x))
        total = _apply(op, total, x)
        if not 0 <= total <= max_value:
            return None, 0
    return steps, total


# ----------------------------------------------------------------------------- distractors


def _word_distractor(rng: random.Random, level: Level, subject: tuple[str, str]) -> str:
    """An irrelevant statement about another person or another item than `subject`:
    "Ann has 7 pens." or, half the time, "Ann has 7 pens, then loses 2." """
    while True:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        if (name, item) != subject:
            break
    n = rng.randint(2, level.max_operand)
    text = f"{name} has {n} {item}"
    if rng.random() < 0.5:
        if rng.random() < 0.5 or n >= level.max_value:
            text += ", then " + rng.choice(SUB_PHRASES).format(n=rng.randint(1, n))
        else:
            m = rng.randint(1, min(level.max_operand, level.max_value - n))
            text += ", then " + rng.choice(ADD_PHRASES).format(n=m)
    return text + "."


def _expression_distractor(rng: random.Random, level: Level) -> str:
    """A true arithmetic fact that plays no part in the question: "6 + 7 is 13." """
    a = rng.randint(1, level.max_operand)
    op = rng.choice("+-*")
    if op == "*" and a * 2 <= level.max_value:
        b = rng.randint(2, min(level.max_multiplier, level.max_value // a))
    elif op == "-":
        b = rng.randint(1, a)
    else:
        op = "+"
        b = rng.randint(1, level.max_operand)
        if a + b > level.max_value:
            a, b = level.max_value - b, b
    return f"{a} {op} {b} is {_apply(op, a, b)}."


def make_problem(rng: random.Random, level: int, kind: str, *, steps: int = 0,
                 digits: int = DEFAULT_DIGITS, distractors: int = 0) -> dict:
    """One problem {"problem","answer","solution","level"} of a level (1..4) and kind, under the
    difficulty knobs (module docstring; the defaults are the levels as written)."""
    spec = level_spec(level, steps=steps, digits=digits)
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {KINDS}")
    if int(distractors) < 0:
        raise ValueError(f"distractors must be >= 0, got {distractors}")
    if kind == "word":
        text, worked, answer, subject = _word_story(rng, spec)
        if distractors:
            story, question = text.split(" How many ")
            before, after = [], []
            for _ in range(distractors):
                (before if rng.random() < 0.5 else after).append(
                    _word_distractor(rng, spec, subject))
            text = " ".join(before + [story] + after) + " How many " + question
    else:
        text, worked, answer = _expression_problem(rng, spec)
        if distractors:
            text = " ".join([_expression_distractor(rng, spec) for _ in range(distractors)]
                            + [text])
    solution = " ".join(worked) + f" \\boxed{{{answer}}}"
    return {"problem": text, "answer": str(answer), "solution": solution, "level": level}


# ----------------------------------------------------------------------------- credit labels

_STEP_RE = re.compile(r"(\d+) ([+\-*]) (\d+) = (\d+)\.")
_BOXED_RE = re.compile(r"\\boxed\{(\d+)\}")
_SPECIAL_PIECE_RE = re.compile(r"<\|[^|<>\s]*\|>")  # <|im_end|>, <|endoftext|>, ...


def _is_digit(ch: str) -> bool:
    return "0" <= ch <= "9"


def decisive_mask(solution: str) -> np.ndarray:
    """bool [len(solution)]: the characters of a worked solution that decide it, the digits of
    each step's result c (in "a op b = c.") and of the boxed answer."""
    out = np.zeros(len(solution), bool)
    for m in _STEP_RE.finditer(solution):
        out[m.start(4):m.end(4)] = True
    for m in _BOXED_RE.finditer(solution):
        out[m.start(1):m.end(1)] = True
    return out


def first_error_unit(solution: str, response: str) -> tuple[int, int] | None:
    """The character span [start, end) of `response` that is its first error against the
    reference `solution`, or None when the two are identical (token_classes has the rules).
    The span is empty, (d, d) with d = len(response), when the response stops short of the
    reference outside a number."""
    lo, hi = 0, min(len(solution), len(response))  # d: the common prefix's length
    while lo < hi:  # binary search with C-speed slice comparisons
        mid = (lo + hi + 1) // 2
        if solution[:mid] == response[:mid]:
            lo = mid
        else:
            hi = mid - 1
    d = lo
    if d == len(solution) == len(response):
        return None
    in_number = ((d < len(response) and _is_digit(response[d]))
                 or (d < len(solution) and _is_digit(solution[d])))
    if in_number:  # the whole number of the response at d (it may end right at d)
        start = d
        while start > 0 and _is_digit(response[start - 1]):
            start -= 1
        end = d
        while end < len(response) and _is_digit(response[end]):
            end += 1
        if end > start:
            return start, end
    return d, min(d + 1, len(response))


def token_classes(solution: str, pieces: Sequence[str]) -> np.ndarray:
    """Ground-truth credit classes (rl.credit codes) int8 [len(pieces)] of a sampled response.

    solution: the problem's reference worked solution ("a op b = c. ... \\boxed{answer}");
    pieces: the response's tokens decoded one by one; special tokens (EOS ...) are pieces that
    read like "<|...|>" or decode to "" (the run's labeller decodes special ids to "").

    Characters first. The response text is the concatenation of the non-special pieces. A
    character of the reference is *decisive* when it is a digit of a step's result c or of the
    boxed answer (decisive_mask); everything else (restated operands, operators, "=", ".",
    spaces, "\\boxed{", "}") is boilerplate. The first error is at the first index d where the
    response differs from the reference; a response that stops short of the reference, or goes
    on after it, errs at d = the shorter length; an identical response has no error. The
    first-error *unit* (first_error_unit) is the whole number of the response at d when d falls
    in a number of either string (the digit run of the response that contains d or ends at d),
    else the single character d (nothing, when the response ended at d).

    Then tokens, by the character span each covers (special and empty pieces are zero-width at
    their position):
      first_error  a token overlapping the unit; when the unit is empty (the response stopped
                   short), the first zero-width token at d (the early EOS), if any
      after_error  every token after the unit (special tokens included)
      step         a token before the unit containing a decisive character
      boilerplate  any other token before the unit (special tokens before it included)
    With no error, every token is step or boilerplate.

    Example, reference "2 + 3 = 5. 5 * 2 = 10. \\boxed{10}", a response with a wrong second
    result, in the tiny tokenizer's pieces:

        '2' ' +' ' 3' ' =' ' 5' '.' ' 5' ' *' ' 2' ' =' ' 1' '2' '.' ' \\' 'boxed' '{' ... '<|im_end|>'
         B    B    B    B    S   B    B    B    B    B    F   F   A    A      A     A      A

    (B boilerplate, S step, F first_error, A after_error): the response departs at "2" (vs "0"),
    inside the number "12", so both of its tokens are first_error; the restated " 5" of the
    second step is boilerplate, the result " 5" of the first step is a step token.
    """
    pieces = [str(p) for p in pieces]
    special = [p[:2] == "<|" and bool(_SPECIAL_PIECE_RE.fullmatch(p)) for p in pieces]
    response = "".join(p for p, sp in zip(pieces, special) if not sp)
    widths = np.asarray([0 if sp else len(p) for p, sp in zip(pieces, special)],
                        np.int64).reshape(len(pieces))
    ends = np.cumsum(widths)
    starts = ends - widths
    # Before the error: step iff the token's span holds a decisive character (prefix sums).
    decisive = np.concatenate([[0], np.cumsum(decisive_mask(solution))])
    top = len(solution)
    has_text = widths > 0
    holds_decisive = decisive[np.minimum(ends, top)] > decisive[np.minimum(starts, top)]
    out = np.where(has_text & holds_decisive, credit.STEP, credit.BOILERPLATE).astype(np.int8)
    unit = first_error_unit(solution, response)
    if unit is None:
        return out
    us, ue = unit
    if ue > us:  # tokens overlapping the unit (zero-width ones strictly inside it)
        first = np.where(has_text, (starts < ue) & (ends > us), (starts > us) & (starts < ue))
    else:  # the response stopped short at us: the first zero-width token there (the early EOS)
        first = np.zeros(len(pieces), bool)
        at_stop = np.flatnonzero(~has_text & (starts == us))
        first[at_stop[:1]] = True
    out[(starts >= ue) & ~first] = credit.AFTER_ERROR
    out[first] = credit.FIRST_ERROR
    return out


def is_test_problem(problem: str, test_fraction: float) -> bool:
    """The fixed train/test assignment of a problem text (a hash, independent of any seed)."""
    digest = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big")
    return digest / 2**64 < test_fraction


def iter_problems(seed: int, levels: Sequence[int] = (1, 2, 3, 4), kinds: Sequence[str] = KINDS,
                  *, steps: int = 0, digits: int = DEFAULT_DIGITS, distractors: int = 0
                  ) -> Iterator[dict]:
    """An endless deterministic stream of problems, level and kind drawn uniformly."""
    rng = random.Random(seed)
    while True:
        yield make_problem(rng, rng.choice(list(levels)), rng.choice(list(kinds)), steps=steps,
                           digits=digits, distractors=distractors)


def generate_splits(
    num_train: int,
    num_test: int,
    seed: int = 0,
    levels: Sequence[int] = (1, 2, 3, 4),
    kinds: Sequence[str] = KINDS,
    test_fraction: float = 0.1,
    *,
    steps: int = 0,
    digits: int = DEFAULT_DIGITS,
    distractors: int = 0,
) -> dict[str, list[dict]]:
    """{"train": [...], "test": [...]} of distinct problems; no problem text is in both splits.

    Records: {"id": "synth-<split>-<i>", "problem", "answer", "solution", "level"}; steps, digits,
    distractors: the difficulty knobs (module docstring).
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    wanted = {"train": num_train, "test": num_test}
    out: dict[str, list[dict]] = {"train": [], "test": []}
    seen: set[str] = set()
    budget = 50 * (num_train + num_test) + 10_000  # small levels have few distinct problems
    stream = iter_problems(seed, levels, kinds, steps=steps, digits=digits,
                           distractors=distractors)
    for tries, prob in enumerate(stream):
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


def write_synthetic_splits(
    out_dir: str,
    num_train: int = 20_000,
    num_test: int = 500,
    seed: int = 0,
    levels: Sequence[int] = (1, 2, 3, 4),
    kinds: Sequence[str] = KINDS,
    *,
    steps: int = 0,
    digits: int = DEFAULT_DIGITS,
    distractors: int = 0,
) -> dict[str, str]:
    """Write <out_dir>/train.jsonl and <out_dir>/test.jsonl; returns {"train": path, "test": path}."""
    splits = generate_splits(num_train, num_test, seed=seed, levels=levels, kinds=kinds,
                             steps=steps, digits=digits, distractors=distractors)
    paths = {}
    for split, recs in splits.items():
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        files.write_jsonl(paths[split], recs)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--num_train", type=int, default=20_000)
    parser.add_argument("--num_test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--levels", default="1,2,3,4", help="comma-separated, from 1..4")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--steps", type=int, default=0,
                        help="operations per problem (0: each level's own)")
    parser.add_argument("--digits", type=int, default=DEFAULT_DIGITS,
                        help=f"every value stays below 10**digits (1..{MAX_DIGITS})")
    parser.add_argument("--distractors", type=int, default=0,
                        help="irrelevant statements per problem")
    args = parser.parse_args(argv)
    paths = write_synthetic_splits(
        args.out_dir, args.num_train, args.num_test, args.seed,
        levels=[int(x) for x in args.levels.split(",")], kinds=args.kinds.split(","),
        steps=args.steps, digits=args.digits, distractors=args.distractors,
    )
    for split, path in paths.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
