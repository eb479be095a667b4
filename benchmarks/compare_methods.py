"""GRPO vs DAPO vs DelTA (and DelTA's ablations, SAPO, FIPO) on the built-in synthetic task, several
seeds, the same compute, with confidence intervals and paired tests.

    python benchmarks/compare_methods.py [--seeds 0,1,2,3,4] [--variants grpo,dapo,delta]
        [--config experiments/tiny.py] [--jobs 1] [--out_dir runs/compare]
        [--set train.steps=60 --set optim.lr=1e-4 ...] [--markdown BENCHMARKS.md]

Variants (VARIANTS below): the methods grpo, dapo, delta, and the DelTA paper's ablations
(DELTA_SPEC.md section 4) as delta + config overrides: delta_k0 / delta_k2 / delta_k3
(delta.num_refine), delta_fixed_gamma (delta.fixed_gamma=1.0), delta_hard (delta.assignment=hard),
delta_no_norm (delta.normalize=False), delta_alpha (delta.weight=alpha), delta_random
(delta.random_lambda=True), delta_topk (delta.proxy=hidden_topk); and the paper's strongest
baselines on DAPO's recipe: sapo (rl.surrogate=sapo), fipo (rl.fipo=True). `--variants all` runs
every one.

Per seed the SFT warm start of the config is trained ONCE (`--config.mode=sft`, exported as a
Hugging Face directory), and every variant starts its RL from that same checkpoint with the same
steps, prompts per step, samples per prompt, learning rate and evaluation (the eval before RL is
therefore the same number for every variant of a seed): the comparison isolates the RL method, and
two variants of one seed form a pair. Each run is a real `python -m delta_jax.main` process
(`--jobs N` runs N at once; a seed's RL runs start when its warm start is done); finished runs are
reused when the script is run again with the same --out_dir (a reused run whose config.json
disagrees with what the variant asks for is an error, not silently reused).

Reported per variant, over the seeds where it finished: held-out accuracy (avg@k on the seed's
synthetic test split) after RL and the gain over the shared warm start, mean and sample standard
deviation, a 95% confidence interval of the mean gain (Student t, n - 1 degrees of freedom); against
dapo on the same seeds: the mean paired difference of after-RL accuracy with its 95% t interval,
the paired t-test p-value, an exact sign-flip permutation p-value (all 2^n sign patterns of the n
differences, two-sided; it cannot go below 2 / 2^n, 0.0625 at 5 seeds) and wins / losses; and,
when the runs logged DelTA's ground-truth credit metrics (delta_jax.rl.credit, synthetic task
only), credit.summarize of each run averaged over seeds. With --markdown all of it is written into
that file's "compare_methods" section (between marker comments; the rest of the file is kept),
whatever the outcome; failed runs are listed there, not hidden.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from delta_jax.stats import paired_comparison, t_interval  # noqa: E402
from delta_jax.train import plots  # noqa: E402

CONFIG = os.path.join(REPO, "experiments", "tiny.py")
START, END = "<!-- compare_methods:start -->", "<!-- compare_methods:end -->"
BASELINE = "dapo"  # the paired comparisons are against this variant

# name -> (method, config overrides on top of the method). The ablations follow the DelTA
# paper's ablation table (DELTA_SPEC.md section 4); every one changes a single delta.* field.
VARIANTS: dict[str, tuple[str, dict]] = {
    "grpo": ("grpo", {}),
    "dapo": ("dapo", {}),
    "delta": ("delta", {}),
    "delta_k0": ("delta", {"delta.num_refine": 0}),
    "delta_k2": ("delta", {"delta.num_refine": 2}),
    "delta_k3": ("delta", {"delta.num_refine": 3}),
    "delta_fixed_gamma": ("delta", {"delta.fixed_gamma": 1.0}),
    "delta_hard": ("delta", {"delta.assignment": "hard"}),
    "delta_no_norm": ("delta", {"delta.normalize": False}),
    "delta_alpha": ("delta", {"delta.weight": "alpha"}),
    "delta_random": ("delta", {"delta.random_lambda": True}),
    "delta_topk": ("delta", {"delta.proxy": "hidden_topk"}),
    # The paper's strongest baselines (DELTA_SPEC.md section 4: SAPO at 8B, FIPO at 14B), each on
    # DAPO's recipe with its own per-token objective.
    "sapo": ("dapo", {"rl.surrogate": "sapo"}),
    "fipo": ("dapo", {"rl.fipo": True}),
}
DEFAULT_VARIANTS = "grpo,dapo,delta"
DEFAULT_SEEDS = "0,1,2,3,4"

# The per-run credit values shown (keys of delta_jax.rl.credit.summarize), with their headers.
CREDIT_COLUMNS = (
    ("credit/weight_first_error_neg", "w first_error (A<0)"),
    ("credit/weight_boilerplate_neg", "w boilerplate (A<0)"),
    ("credit/weight_step_pos", "w step (A>0)"),
    ("credit/weight_boilerplate_pos", "w boilerplate (A>0)"),
    ("credit/auc_first_error_neg", "AUC first_error vs other tokens (A<0)"),
    ("credit/auc_step_pos", "AUC step vs boilerplate (A>0)"),
)


def _nanmean(values) -> float:
    v = [float(x) for x in values if isinstance(x, (int, float)) and math.isfinite(float(x))]
    return float(np.mean(v)) if v else math.nan


def summarize(results: dict, variants, seeds, baseline: str = BASELINE) -> list[dict]:
    """Per variant, over the seeds where its run finished (results[(seed, variant)] a dict with
    "before", "after" and optionally "credit" {name: value}; a missing key or one holding
    {"error": ...} is a failed run): after-RL accuracy and gain (mean, sample sd, the 95% t
    interval of the mean gain), per-seed values, the paired comparison against `baseline` on the
    seeds both finished (None for the baseline itself or when it did not run), and the credit
    values averaged over seeds."""
    ok = lambda s, v: "after" in results.get((s, v), {})  # noqa: E731
    table = []
    for v in variants:
        done = [s for s in seeds if ok(s, v)]
        after = np.asarray([results[(s, v)]["after"] for s in done], np.float64)
        before = np.asarray([results[(s, v)]["before"] for s in done], np.float64)
        gain = after - before
        a_mean, a_sd, _, _ = t_interval(after)
        g_mean, g_sd, g_lo, g_hi = t_interval(gain)
        row = {"variant": v, "method": VARIANTS.get(v, (v, {}))[0],
               "overrides": VARIANTS.get(v, (v, {}))[1], "seeds": done,
               "failed": [s for s in seeds if not ok(s, v)], "n": len(done),
               "after_mean": a_mean, "after_std": a_sd,
               "before_mean": float(before.mean()) if len(done) else math.nan,
               "gain_mean": g_mean, "gain_std": g_sd, "gain_lo": g_lo, "gain_hi": g_hi,
               "improved": int((gain > 0).sum()), "per_seed_after": after.tolist(),
               "per_seed_gain": gain.tolist(), "vs_baseline": None, "credit": {}}
        if v != baseline and baseline in variants:
            both = [s for s in done if ok(s, baseline)]
            if both:
                row["vs_baseline"] = paired_comparison(
                    [results[(s, v)]["after"] for s in both],
                    [results[(s, baseline)]["after"] for s in both])
                row["vs_baseline"]["seeds"] = both
        names = sorted({k for s in done for k in results[(s, v)].get("credit") or {}})
        row["credit"] = {k: _nanmean([(results[(s, v)].get("credit") or {}).get(k)
                                      for s in done]) for k in names}
        table.append(row)
    return table


# ----------------------------------------------------------------------------- markdown


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}"


def _pts(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:+.1f}"


def _p(x) -> str:
    return "n/a" if x is None or x != x else (f"{x:.3f}" if x >= 0.001 else f"{x:.1e}")


def _num(x) -> str:
    return "n/a" if x is None or x != x else f"{x:.3f}"


def _overrides_text(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "-"


def to_markdown(table, meta: dict, baseline: str = BASELINE) -> str:
    """The BENCHMARKS.md section: settings, the accuracy table, the paired comparison against
    the baseline, the credit table (when any run has credit metrics), failures, a plain reading."""
    lines = [
        "## Method comparison on the synthetic task (benchmarks/compare_methods.py)",
        "",
        f"- Measured: {meta['date']} on {meta['machine']}",
        f"- Command: `{meta['command']}`",
        f"- Config: {meta['config']}",
        f"- Seeds: {meta['seeds']} (the seed also draws the synthetic train/test split); per seed "
        "one SFT warm start shared by every variant, so the variants of one seed are paired.",
        f"- RL: {meta['rl']}",
        f"- Eval: {meta['eval']}",
        f"- Wall time: {meta['wall_time']}; RL runs: {meta['rl_time']}.",
        "",
        "| variant | overrides | seeds | acc. after RL, mean +- sd (%) | gain over warm start, "
        "mean +- sd (points) | 95% CI of the mean gain (t) | seeds improved | per seed after RL "
        "(%) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in table:
        lines.append(
            f"| {row['variant']} | {_overrides_text(row['overrides'])} | {row['n']} | "
            f"{_pct(row['after_mean'])} +- {_pct(row['after_std'])} | "
            f"{_pts(row['gain_mean'])} +- {_pct(row['gain_std'])} | "
            f"[{_pts(row['gain_lo'])}, {_pts(row['gain_hi'])}] | "
            f"{row['improved']}/{row['n']} | "
            + ", ".join(_pct(x) for x in row["per_seed_after"]) + " |")
    before = [r["before_mean"] for r in table if r["n"]]
    lines += ["", f"Warm start (before RL), mean over seeds: {_pct(before[0]) if before else 'n/a'}"
              "%."]

    paired = [r for r in table if r["vs_baseline"]]
    if paired:
        lines += [
            "",
            f"Paired against {baseline} (after-RL accuracy, same seed = same warm start and "
            "split): difference variant - " + baseline + " in points.",
            "",
            "| variant | pairs | mean difference (points) | 95% CI (t) | paired t-test p | exact "
            "sign-flip p | wins / losses / ties | per seed difference |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in paired:
            c = row["vs_baseline"]
            lines.append(
                f"| {row['variant']} | {c['n']} | {_pts(c['diff_mean'])} | "
                f"[{_pts(c['diff_lo'])}, {_pts(c['diff_hi'])}] | {_p(c['p_t'])} | "
                f"{_p(c['p_sign_flip'])} | {c['wins']} / {c['losses']} / {c['ties']} | "
                + ", ".join(_pts(x) for x in c["per_seed_diff"]) + " |")
        n_pairs = max(r["vs_baseline"]["n"] for r in paired)
        lines += ["", f"With {n_pairs} pairs the exact sign-flip test cannot give p below "
                  f"{2 / 2 ** n_pairs:.4f} (2 / 2^{n_pairs}); the p-values are not corrected for "
                  "the number of variants compared."]

    credit_rows = [r for r in table if r["credit"]]
    if credit_rows:
        lines += [
            "",
            "Ground-truth token credit (delta_jax.rl.credit.summarize, synthetic task): mean "
            "token weight of a class over the run's RL steps (weighted by token counts), per "
            "side, and the per-response AUC of the weight ranking first_error tokens above the "
            "response's other tokens (A<0) or step tokens above its boilerplate (A>0), 0.5 = no "
            "separation; each averaged over seeds. Classes: first_error = where a wrong response "
            "first departs from the reference solution, step = the digits of correct "
            "intermediate results and of the answer, boilerplate = the text the problem "
            "determines (operands, operators, '=', '.', \\boxed{}). grpo / dapo train with "
            "weight 1 on every token (weights 1, AUC 0.5 when logged).",
            "",
            "| variant | " + " | ".join(h for _, h in CREDIT_COLUMNS)
            + " | first_error / boilerplate (A<0) |",
            "|---|" + "---:|" * (len(CREDIT_COLUMNS) + 1),
        ]
        for row in credit_rows:
            c = row["credit"]
            fe = c.get("credit/weight_first_error_neg", math.nan)
            bp = c.get("credit/weight_boilerplate_neg", math.nan)
            ratio = fe / bp if fe == fe and bp == bp and bp > 0 else math.nan
            lines.append(f"| {row['variant']} | "
                         + " | ".join(_num(c.get(k, math.nan)) for k, _ in CREDIT_COLUMNS)
                         + f" | {_num(ratio)} |")

    failed = [(r["variant"], r["failed"]) for r in table if r["failed"]]
    if failed or meta.get("errors"):
        lines += ["", "Failed or missing runs (left out of the statistics above): "
                  + "; ".join(f"{v}: seeds {', '.join(map(str, s))}" for v, s in failed) + "."]
        for err in meta.get("errors", []):
            lines.append(f"- {err}")

    lines += ["", "Reading (generated from the numbers above): " + _reading(table, baseline)]
    return "\n".join(lines) + "\n"


def _reading(table, baseline: str) -> str:
    parts = []
    for row in table:
        c = row["vs_baseline"]
        if not c or c["n"] < 2 or c["diff_lo"] != c["diff_lo"]:
            continue
        if c["diff_lo"] > 0:
            verdict = f"better than {baseline} (the 95% CI excludes 0)"
        elif c["diff_hi"] < 0:
            verdict = f"worse than {baseline} (the 95% CI excludes 0)"
        else:
            verdict = f"not distinguishable from {baseline} (the 95% CI contains 0)"
        parts.append(f"{row['variant']} {_pts(c['diff_mean'])} points, {verdict}")
    return ("; ".join(parts) + ".") if parts else (
        f"no paired comparison against {baseline} (it did not run, or fewer than 2 pairs).")


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


# ----------------------------------------------------------------------------- runs


def _main_cmd(config: str, workdir: str, overrides: dict) -> list[str]:
    return ([sys.executable, "-m", "delta_jax.main", f"--config={config}", f"--workdir={workdir}"]
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


def _same_value(want, have) -> bool:
    if str(want) == str(have):
        return True
    try:
        return float(want) == float(have)
    except (TypeError, ValueError):
        return False


def config_mismatches(saved: dict, overrides: dict) -> list[str]:
    """The overrides a run's config.json (as a dict) does not hold: ["field: want X, has Y"]."""
    out = []
    for key, want in overrides.items():
        node = saved
        for part in key.split("."):
            node = node.get(part, "<absent>") if isinstance(node, dict) else "<absent>"
        if not _same_value(want, node):
            out.append(f"{key}: want {want!r}, has {node!r}")
    return out


def warm_start(config: str, seed_dir: str, seed: int, extra: dict, log=print) -> tuple[str, float]:
    """The seed's SFT checkpoint (trained once); returns (HF directory, seconds spent now)."""
    workdir = os.path.join(seed_dir, "sft")
    export = os.path.join(workdir, "sft")
    if os.path.isfile(os.path.join(export, "config.json")):
        return export, 0.0
    overrides = {**extra, "seed": seed, "mode": "sft", "train.progress_bar": False}
    log(f"seed {seed} sft: started")
    secs = _run(_main_cmd(config, workdir, overrides), os.path.join(seed_dir, "sft.log"))
    return export, secs


def credit_summary(rows) -> dict:
    """delta_jax.rl.credit.summarize of a run's metrics rows when it logged credit/* metrics
    (the synthetic task): its numeric values, keys "credit/..."; {} otherwise."""
    if not any(k.startswith("credit/") for r in rows for k in r):
        return {}
    from delta_jax.rl import credit
    return {k: v for k, v in credit.summarize(rows).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def rl_run(config: str, seed_dir: str, seed: int, variant: str, sft_export: str, extra: dict,
           log=print) -> dict:
    """RL of one variant from the shared warm start; returns its eval before/after, credit
    summary and time (a finished run in its workdir is reused after checking its config)."""
    method, variant_overrides = VARIANTS[variant]
    workdir = os.path.join(seed_dir, variant)
    # --set values apply to every run, but never undo what makes this an RL run of this variant
    # from the export.
    overrides = {**extra, "seed": seed, "method": method, **variant_overrides,
                 "model.random_init": False, "model.path": sft_export,
                 "tokenizer.path": sft_export, "sft.steps": 0, "train.progress_bar": False,
                 "train.export_final": False}
    rows = plots.read_metrics(workdir)
    steps = None
    if os.path.isfile(os.path.join(workdir, "config.json")):
        saved = _read_config(workdir)
        steps = saved["train"]["steps"]
        bad = config_mismatches(saved, {k: v for k, v in overrides.items()
                                        if k not in ("train.progress_bar",)})
        if bad:
            raise RuntimeError(f"{workdir} holds a run with another config ({'; '.join(bad)}); "
                               "use another --out_dir or remove it")
    result = plots.eval_before_after(rows, steps) if steps is not None else None
    reused = result is not None
    # A reused run's time: from its config.json (written at start) to its last metrics line.
    secs = (os.path.getmtime(os.path.join(workdir, "metrics.jsonl"))
            - os.path.getmtime(os.path.join(workdir, "config.json"))) if reused else math.nan
    if not reused:  # not run yet, or unfinished: (re)run; it resumes from its checkpoint
        log(f"seed {seed} {variant}: started")
        secs = _run(_main_cmd(config, workdir, overrides), os.path.join(seed_dir,
                                                                         f"{variant}.log"))
        steps = _read_config(workdir)["train"]["steps"]
        rows = plots.read_metrics(workdir)
        result = plots.eval_before_after(rows, steps)
        if result is None:
            raise RuntimeError(f"{workdir}: no eval before and after RL in metrics.jsonl")
    result.update(seconds=secs, steps=steps, workdir=workdir, reused=reused,
                  credit=credit_summary(rows))
    return result


# ----------------------------------------------------------------------------- CLI


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


def _parse_variants(text: str) -> list[str]:
    names = list(VARIANTS) if text.strip() == "all" else [v.strip() for v in text.split(",")
                                                          if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}, all")
    return names


def run_all(config: str, out_dir: str, seeds, variants, extra: dict, jobs: int = 1):
    """Every warm start and RL run, `jobs` processes at once; returns (results, sft seconds,
    error messages). results[(seed, variant)] is rl_run's dict, or {"error": message}."""
    lock = threading.Lock()
    total = len(seeds) * (1 + len(variants))
    done = [0]
    t_start = time.perf_counter()

    def log(msg):
        with lock:
            print(f"[{time.perf_counter() - t_start:7.0f} s] {msg}", flush=True)

    def finished(msg):
        with lock:
            done[0] += 1
            k = done[0]
        log(f"({k}/{total}) {msg}")

    def sft_task(seed):
        seed_dir = os.path.join(out_dir, f"seed{seed}")
        os.makedirs(seed_dir, exist_ok=True)
        export, secs = warm_start(config, seed_dir, seed, extra, log)
        finished(f"seed {seed} sft: " + (f"done in {secs:.0f} s" if secs else "reused"))
        return export, secs

    def rl_task(seed, variant, export):
        seed_dir = os.path.join(out_dir, f"seed{seed}")
        r = rl_run(config, seed_dir, seed, variant, export, extra, log)
        finished(f"seed {seed} {variant}: held-out {100 * r['before']:.1f}% -> "
                 f"{100 * r['after']:.1f}% "
                 + ("(reused)" if r["reused"] else f"({r['seconds']:.0f} s)"))
        return r

    results, errors, sft_secs = {}, [], 0.0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        sft_futs = {pool.submit(sft_task, s): s for s in seeds}
        rl_futs = {}
        for fut in concurrent.futures.as_completed(sft_futs):
            seed = sft_futs[fut]
            try:
                export, secs = fut.result()
            except Exception as e:  # noqa: BLE001 - reported, the other seeds go on
                errors.append(f"seed {seed} sft: {e}")
                finished(f"seed {seed} sft: FAILED ({e})")
                for v in variants:
                    results[(seed, v)] = {"error": f"warm start failed: {e}"}
                    finished(f"seed {seed} {v}: skipped (no warm start)")
                continue
            sft_secs += secs
            for v in variants:
                rl_futs[pool.submit(rl_task, seed, v, export)] = (seed, v)
        for fut in concurrent.futures.as_completed(rl_futs):
            seed, v = rl_futs[fut]
            try:
                results[(seed, v)] = fut.result()
            except Exception as e:  # noqa: BLE001
                errors.append(f"seed {seed} {v}: {e}")
                results[(seed, v)] = {"error": str(e)}
                finished(f"seed {seed} {v}: FAILED ({e})")
    return results, sft_secs, errors


def _settings(out_dir: str, results: dict, seeds, variants) -> tuple[str, str]:
    """The RL and eval settings lines of the markdown, from a finished run's config.json."""
    ok = [r for r in results.values() if "workdir" in r]
    if not ok:
        return "no run finished", "no run finished"
    cfg = _read_config(ok[0]["workdir"])
    rl, ev = cfg["rollout"], cfg["eval"]
    sft_line = ""
    for s in seeds:
        path = os.path.join(out_dir, f"seed{s}", "sft")
        if os.path.isfile(os.path.join(path, "config.json")):
            sft = _read_config(path)
            sft_line = (f"; SFT warm start: {sft['sft']['steps']} steps x "
                        f"{sft['sft']['batch_size']} examples, lr {sft['sft']['lr']}")
            break
    d = cfg["data"]
    task = (f"levels {d['synthetic_levels']}"
            + (f", {d['synthetic_steps']} operations" if d.get("synthetic_steps") else "")
            + (f", values < 10^{d['synthetic_digits']}" if "synthetic_digits" in d else "")
            + (f", {d['synthetic_distractors']} distractors" if d.get("synthetic_distractors")
               else ""))
    rl_line = (f"{cfg['train']['steps']} steps x {rl['batch_prompts']} prompts x "
               f"{rl['group_size']} samples (max {rl['max_new_tokens']} new tokens), "
               f"{rl['batch_prompts'] // cfg['rl']['mini_batch_prompts']} updates per step, "
               f"lr {cfg['optim']['lr']}, dynamic sampling "
               f"{'on' if cfg['rl']['dynamic_sampling'] else 'off'}, entropy bonus "
               f"{cfg['rl']['entropy_coef']}; model {cfg['model']['num_layers']} layers x hidden "
               f"{cfg['model']['hidden_size']}{sft_line}")
    ev_line = (f"avg@{ev['k']} at T = {ev['temperature']}, top-p {ev['top_p']}, on "
               f"{ev['limit'] or d['synthetic_test']} held-out problems per seed; task: {task}")
    return rl_line, ev_line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default=DEFAULT_SEEDS)
    p.add_argument("--variants", "--methods", dest="variants", default=DEFAULT_VARIANTS,
                   help=f"comma-separated names of {', '.join(VARIANTS)}, or all")
    p.add_argument("--config", default=CONFIG, help="experiment config file (default tiny.py)")
    p.add_argument("--jobs", type=int, default=1, help="training processes at once")
    p.add_argument("--out_dir", default=os.path.join(REPO, "runs", "compare"))
    p.add_argument("--set", action="append", default=[],
                   help="config override for every run (SFT and RL), field=value")
    p.add_argument("--markdown", default=None, help="write the tables into this file's section")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = _parse_variants(args.variants)
    config = os.path.abspath(args.config)
    extra = _parse_sets(args.set)
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    os.makedirs(args.out_dir, exist_ok=True)

    results, sft_secs, errors = run_all(config, args.out_dir, seeds, variants, extra, args.jobs)
    wall = time.perf_counter() - t0
    table = summarize(results, variants, seeds)
    rl_line, ev_line = _settings(args.out_dir, results, seeds, variants)
    rl_secs = [r["seconds"] for r in results.values()
               if "seconds" in r and r["seconds"] == r["seconds"]]
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {_cpu_model()}, {os.cpu_count()} cores, load average "
                   f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (reused "
                   "runs were measured earlier, under their own load)",
        "command": "python benchmarks/compare_methods.py " + shlex.join(
            (argv if argv is not None else sys.argv[1:])),
        "config": os.path.relpath(config, REPO),
        "seeds": ", ".join(map(str, seeds)),
        "seed_list": seeds,
        "rl": rl_line,
        "eval": ev_line,
        "wall_time": f"{wall:.0f} s for this invocation with --jobs {args.jobs} (SFT warm starts "
                     f"trained now: {sft_secs:.0f} s of process time)",
        "rl_time": (f"{np.mean(rl_secs):.0f} s per run on average (min {np.min(rl_secs):.0f}, "
                    f"max {np.max(rl_secs):.0f}; the machine's load varied)" if rl_secs
                    else "not measured"),
        "errors": errors,
    }
    text = to_markdown(table, meta)
    print(text)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump({"table": table, "meta": meta}, f, indent=2)
    if args.markdown:
        write_section(args.markdown, text)
        print(f"written to {args.markdown}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
