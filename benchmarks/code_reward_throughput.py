"""Code reward throughput: programs/s of RewardScorer(name="code") on HumanEval-length programs.

    python benchmarks/code_reward_throughput.py [--programs 2048] [--workers 2] [--isolation off]

Programs are the 164 HumanEval canonical solutions (../shared/data/humaneval.jsonl), each in a
fenced block of a response, cycled up to --programs; a third are made wrong (the body replaced by
`pass`), and every copy gets a distinct comment so the scorer's cache and in-batch de-duplication
do not apply: every program runs in its own sandbox. Prints pool start-up, the batch time and
programs/s, with the date and machine.
No JAX program runs here (scoring is CPU work in worker processes), so there is no compiled
memory analysis to print, unlike the other benchmarks (issue #16).
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import time

from delta_jax.rl.rewards import RewardScorer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--programs", type=int, default=2048)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--isolation", choices=("on", "off"), default="on")
    p.add_argument("--data", default=str(pathlib.Path(__file__).resolve().parents[1].parent
                                         / "shared" / "data" / "humaneval.jsonl"))
    args = p.parse_args()
    rows = [json.loads(line) for line in open(args.data, encoding="utf-8")]
    responses, specs = [], []
    for i in range(args.programs):
        row = rows[i % len(rows)]
        body = row["canonical_solution"] if i % 3 else "    pass\n"
        responses.append(f"Let me write it.\n```python\n# copy {i}\n{row['prompt']}{body}```\n")
        specs.append({k: row[k] for k in ("prompt", "entry_point", "test")})
    t0 = time.perf_counter()
    with RewardScorer("code", num_workers=args.workers, timeout_s=args.timeout,
                      code_isolation=args.isolation == "on") as scorer:
        t1 = time.perf_counter()
        rewards, info = scorer.score(responses, specs)
        t2 = time.perf_counter()
    expected = sum(1 for i in range(args.programs) if i % 3)
    print(f"{datetime.date.today()} {platform.node()} {os.cpu_count()} cores, "
          f"{args.workers} workers, isolation {args.isolation}")
    print(f"pool start-up + isolation probe: {t1 - t0:.2f} s")
    print(f"scored {len(responses)} programs in {t2 - t1:.2f} s: "
          f"{len(responses) / (t2 - t1):.1f} programs/s")
    print(f"passed {int(rewards.sum())} (expected {expected}), timeouts {info['num_timeouts']}, "
          f"errors {info['num_errors']}, programs run {info['num_programs_run']}")


if __name__ == "__main__":
    main()
