"""Reward scoring throughput: 2048 typical responses (128 prompts x 16 samples).

    python benchmarks/reward_throughput.py [--workers 2] [--prompts 128] [--samples 16]

Gold answers come from ../shared/data/math500.jsonl when present (else synthetic integers and
fractions). Each response is ~2 KB of reasoning ending in a \\boxed{} answer that is the gold
string itself (40%), an equivalent but different form (20%), a wrong answer (30%) or missing (10%).
Prints pool start-up time and the time to score the batch, cold (empty cache) and warm.
No JAX program runs here (scoring is CPU work in worker processes), so there is no compiled
memory analysis to print, unlike the other benchmarks (issue #16).
"""
import argparse
import json
import pathlib
import random
import time

from delta_jax.rl.rewards import RewardScorer

FILLER = ("We expand the expression and collect like terms. Substituting back, the constraint "
          "gives a linear relation, so we solve for the unknown and check the boundary cases. ")


def load_golds(num_prompts: int, rng: random.Random) -> list[str]:
    path = pathlib.Path(__file__).resolve().parents[1].parent / "shared/data/math500.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.open()]
        return [r["answer"] for r in rng.sample(rows, num_prompts)]
    return [rng.choice([str(rng.randint(-50, 999)),
                        f"\\frac{{{rng.randint(1, 9)}}}{{{rng.randint(10, 99)}}}"])
            for _ in range(num_prompts)]


def equivalent_form(gold: str, rng: random.Random) -> str:
    forms = [f"{gold}.", f" {gold} ", f"x = {gold}", gold.replace("\\frac", "\\dfrac"),
             f"{{{gold}}}", f"\\text{{{gold}}}" if gold.isdigit() else f"{gold}\\,"]
    return rng.choice(forms)


def make_batch(num_prompts: int, samples: int, seed: int = 0):
    rng = random.Random(seed)
    golds = load_golds(num_prompts, rng)
    responses, gold_col = [], []
    for gold in golds:
        for _ in range(samples):
            u = rng.random()
            body = FILLER * rng.randint(8, 16)
            if u < 0.4:
                ans = gold
            elif u < 0.6:
                ans = equivalent_form(gold, rng)
            elif u < 0.9:
                ans = rng.choice([str(rng.randint(0, 999)), f"\\frac{{{rng.randint(1, 9)}}}{{7}}",
                                  rng.choice(golds)])
            else:
                ans = None
            tail = "I am not sure." if ans is None else f"The answer is $\\boxed{{{ans}}}$."
            responses.append(body + tail)
            gold_col.append(gold)
    return responses, gold_col


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--samples", type=int, default=16)
    args = p.parse_args()
    responses, golds = make_batch(args.prompts, args.samples)
    t0 = time.perf_counter()
    with RewardScorer("math", num_workers=args.workers, timeout_s=10.0) as scorer:
        scorer.score(["\\boxed{1}"], ["2"])  # waits for the workers to be up
        t1 = time.perf_counter()
        rewards, info = scorer.score(responses, golds)
        t2 = time.perf_counter()
        scorer.score(responses, golds)
        t3 = time.perf_counter()
    print(f"pool start-up: {t1 - t0:.2f} s ({args.workers} workers)")
    print(f"scored {len(responses)} responses: cold {t2 - t1:.2f} s, warm (cached) {t3 - t2:.2f} s")
    print(f"mean reward {rewards.mean():.3f}, no box {info['num_no_box']}, "
          f"timeouts {info['num_timeouts']}, errors {info['num_errors']}")


if __name__ == "__main__":
    main()
