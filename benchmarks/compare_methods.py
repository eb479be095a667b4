"""GRPO vs DAPO vs DelTA on the built-in synthetic task, several seeds, the same compute.

    python benchmarks/compare_methods.py [--seeds 0,1,2] [--methods grpo,dapo,delta]
        [--out_dir runs/compare] [--set train.steps=60 --set optim.lr=1e-4 ...]
        [--markdown BENCHMARKS.md]

Per seed the SFT warm start of experiments/tiny.py is trained ONCE (`--config.mode=sft`, exported
as a Hugging Face directory), and every method starts its RL from that same checkpoint with the
same steps, prompts per step, samples per prompt, learning rate and evaluation (the eval before RL
is therefore the same number for every method of a seed): the comparison isolates the RL method.
Each run is a real `python -m delta_jax.main` process; finished runs are reused when the script is
run again with the same --out_dir.

Reported per method: held-out accuracy (avg@k on the seed's synthetic test split) after RL, mean
and sample standard deviation over seeds, the gain over the shared warm start, and the per-seed
values. With --markdown the table is written into that file's "compare_methods" section (between
marker comments; the rest of the file is kept).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from delta_jax.train import plots  # noqa: E402

CONFIG = os.path.join(REPO, "experiments", "tiny.py")
START, END = "<!-- compare_methods:start -->", "<!-- compare_methods:end -->"


def _main_cmd(workdir: str, overrides: dict) -> list[str]:
    return ([sys.executable, "-m", "delta_jax.main", f"--config={CONFIG}", f"--workdir={workdir}"]
            + [f"--config.{k}={v}" for k, v in overrides.items()])


def _run(cmd: list[str], log_path: str) -> float:
    """Runs one training process, its output to log_path; returns wall seconds."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed (exit {proc.returncode}); see {log_path}")
    return time.perf_counter() - t0


def _read_config(workdir: str) -> dict:
    with open(os.path.join(workdir, "config.json")) as f:
        return json.load(f)


def warm_start(seed_dir: str, seed: int, extra: dict) -> tuple[str, float]:
    """The seed's SFT checkpoint (trained once); returns (HF directory, seconds spent now)."""
    workdir = os.path.join(seed_dir, "sft")
    export = os.path.join(workdir, "sft")
    if os.path.isfile(os.path.join(export, "config.json")):
        return export, 0.0
    overrides = {**extra, "seed": seed, "mode": "sft", "train.progress_bar": False}
    secs = _run(_main_cmd(workdir, overrides), os.path.join(seed_dir, "sft.log"))
    return export, secs


def rl_run(seed_dir: str, seed: int, method: str, sft_export: str, extra: dict) -> dict:
    """RL of one method from the shared warm start; returns its eval before/after and time."""
    workdir = os.path.join(seed_dir, method)
    # --set values apply to every run, but never undo what makes this an RL run from the export.
    overrides = {**extra, "seed": seed, "method": method, "model.random_init": False,
                 "model.path": sft_export, "tokenizer.path": sft_export, "sft.steps": 0,
                 "train.progress_bar": False, "train.export_final": False}
    rows = plots.read_metrics(workdir)
    steps = None
    if os.path.isfile(os.path.join(workdir, "config.json")):
        steps = _read_config(workdir)["train"]["steps"]
    result = plots.eval_before_after(rows, steps) if steps is not None else None
    # A reused run's time: from its config.json (written at start) to its last metrics line.
    secs = (os.path.getmtime(os.path.join(workdir, "metrics.jsonl"))
            - os.path.getmtime(os.path.join(workdir, "config.json"))) if result else float("nan")
    if result is None:  # not run yet, or unfinished: (re)run; it resumes from its checkpoint
        secs = _run(_main_cmd(workdir, overrides), os.path.join(seed_dir, f"{method}.log"))
        steps = _read_config(workdir)["train"]["steps"]
        result = plots.eval_before_after(plots.read_metrics(workdir), steps)
        if result is None:
            raise RuntimeError(f"{workdir}: no eval before and after RL in metrics.jsonl")
    result.update(seconds=secs, steps=steps, workdir=workdir)
    return result


def summarize(results: dict, methods, seeds) -> list[dict]:
    """Per method: after-RL accuracy and gain (mean, sample std over seeds) and per-seed values."""
    table = []
    for m in methods:
        after = np.asarray([results[(s, m)]["after"] for s in seeds])
        before = np.asarray([results[(s, m)]["before"] for s in seeds])
        gain = after - before
        sd = (lambda x: float(np.std(x, ddof=1)) if len(x) > 1 else float("nan"))  # noqa: E731
        table.append({"method": m, "after_mean": float(after.mean()), "after_std": sd(after),
                      "before_mean": float(before.mean()), "gain_mean": float(gain.mean()),
                      "gain_std": sd(gain), "wins": int((gain > 0).sum()),
                      "per_seed_after": after.tolist(), "per_seed_gain": gain.tolist()})
    return table


def to_markdown(table, meta: dict) -> str:
    pct = lambda x: "n/a" if x != x else f"{100 * x:.1f}"  # noqa: E731
    lines = [
        "## Method comparison on the synthetic task (benchmarks/compare_methods.py)",
        "",
        f"- Measured: {meta['date']} on {meta['machine']}",
        f"- Command: `{meta['command']}`",
        f"- Seeds: {meta['seeds']} (the seed also draws the synthetic train/test split); per seed "
        "one SFT warm start shared by every method.",
        f"- RL: {meta['rl']}",
        f"- Eval: {meta['eval']}",
        "",
        "| method | held-out acc. after RL, mean +- sd (%) | gain over warm start, mean +- sd "
        "(points) | seeds improved | per seed after RL (%) |",
        "|---|---:|---:|---:|---|",
    ]
    for row in table:
        lines.append(
            f"| {row['method']} | {pct(row['after_mean'])} +- {pct(row['after_std'])} | "
            f"{100 * row['gain_mean']:+.1f} +- {pct(row['gain_std'])} | "
            f"{row['wins']}/{len(row['per_seed_after'])} | "
            + ", ".join(pct(x) for x in row["per_seed_after"]) + " |")
    lines += ["", f"Warm start (before RL), mean over seeds: {pct(table[0]['before_mean'])}%.",
              f"Wall time of the RL runs: {meta['rl_time']}."]
    return "\n".join(lines) + "\n"


def write_section(path: str, text: str) -> None:
    """Replaces the marked section of `path` (creating the file or the section if missing)."""
    block = f"{START}\n{text}{END}\n"
    old = open(path).read() if os.path.isfile(path) else (
        "# Benchmarks\n\nMeasured numbers only: each with machine, date, seeds, steps and the "
        "command that produced it.\n\n")
    if START in old and END in old:
        head, rest = old.split(START, 1)
        new = head + block + rest.split(END, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    with open(path, "w") as f:
        f.write(new)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.platform()


def _parse_sets(items) -> dict:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected field=value (e.g. train.steps=60)")
        out[key] = value
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default="grpo,dapo,delta")
    p.add_argument("--out_dir", default=os.path.join(REPO, "runs", "compare"))
    p.add_argument("--set", action="append", default=[],
                   help="config override for every run (SFT and RL), field=value")
    p.add_argument("--markdown", default=None, help="write the table into this file's section")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    extra = _parse_sets(args.set)
    load_start = os.getloadavg()[0]

    results, sft_secs = {}, 0.0
    for seed in seeds:
        seed_dir = os.path.join(args.out_dir, f"seed{seed}")
        os.makedirs(seed_dir, exist_ok=True)
        export, secs = warm_start(seed_dir, seed, extra)
        sft_secs += secs
        for method in methods:
            r = rl_run(seed_dir, seed, method, export, extra)
            results[(seed, method)] = r
            print(f"seed {seed} {method:5s}: held-out {100 * r['before']:.1f}% -> "
                  f"{100 * r['after']:.1f}% ({r['seconds']:.0f} s)", flush=True)

    table = summarize(results, methods, seeds)
    cfg = _read_config(results[(seeds[0], methods[0])]["workdir"])
    rl, ev = cfg["rollout"], cfg["eval"]
    sft_cfg = _read_config(os.path.join(args.out_dir, f"seed{seeds[0]}", "sft"))
    rl_secs = [r["seconds"] for r in results.values() if r["seconds"] == r["seconds"]]
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {_cpu_model()}, {os.cpu_count()} cores, load average "
                   f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (reused "
                   "runs were measured earlier, under their own load)",
        "command": "python benchmarks/compare_methods.py " + shlex.join(
            (argv if argv is not None else sys.argv[1:])),
        "seeds": ", ".join(map(str, seeds)),
        "rl": f"{cfg['train']['steps']} steps x {rl['batch_prompts']} prompts x "
              f"{rl['group_size']} samples (max {rl['max_new_tokens']} new tokens), "
              f"{cfg['rollout']['batch_prompts'] // cfg['rl']['mini_batch_prompts']} updates per "
              f"step, lr {cfg['optim']['lr']}; SFT warm start: {sft_cfg['sft']['steps']} steps x "
              f"{sft_cfg['sft']['batch_size']} examples, lr {sft_cfg['sft']['lr']}",
        "eval": f"avg@{ev['k']} at T = {ev['temperature']}, top-p {ev['top_p']}, on "
                f"{ev['limit'] or cfg['data']['synthetic_test']} held-out problems of levels "
                f"{cfg['data']['synthetic_levels']} per seed",
        "rl_time": (f"{np.mean(rl_secs):.0f} s per run on average (min {np.min(rl_secs):.0f}, "
                    f"max {np.max(rl_secs):.0f}; the machine's load varied)" if rl_secs
                    else "not measured"),
    }
    text = to_markdown(table, meta)
    print(text)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump({"table": table, "meta": meta}, f, indent=2)
    if args.markdown:
        write_section(args.markdown, text)
        print(f"written to {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
