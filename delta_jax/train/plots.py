"""Run plots and the end-of-run report, drawn from a run's own files (matplotlib, Agg, no pyplot).

    append_weight_histogram(workdir, step, weights, advantages, mask, lam_min, lam_max)  # loop
    paths = write_plots(workdir)        # <workdir>/plots/training.png (+ delta_weights.png,
                                        #   + credit.png on the synthetic task)
    print(write_report(workdir))        # the plots + held-out accuracy before and after RL
                                        #   (+ the ground-truth credit summary)

Inputs:
  <workdir>/metrics.jsonl        every scalar the run wrote (SFT, RL steps, evals); see metrics.py
  <workdir>/delta_weights.jsonl  per RL step, histograms of the DelTA token weights per side
                                 (written by `append_weight_histogram` when the method is delta)

On the synthetic task the RL rows also hold the ground-truth credit metrics of delta_jax.rl.credit:
credit/weight_{class}_{side} (mean DelTA weight of the tokens of that class, side pos / neg),
credit/tokens_{class}_{side} and the AUCs credit/auc_first_error_neg, credit/auc_step_pos;
plots/credit.png draws them and the report summarises them (credit.summarize).

The SFT, RL and eval rows share the step counter (SFT step 300 and RL step 300 are different rows),
so series are picked by the keys a row holds, never by its step alone.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax import evaluation
from delta_jax.rl import credit
from delta_jax.train.metrics import read_jsonl

SIDES = ("pos", "neg", "zero")  # the sides of rl.delta: A > 0, A < 0, A = 0
CREDIT_AUCS = (("credit/auc_first_error_neg", "first_error vs other tokens, A < 0"),
               ("credit/auc_step_pos", "step vs boilerplate, A > 0"))
_CLASS_COLORS = {"boilerplate": "tab:gray", "step": "tab:blue", "first_error": "tab:red",
                 "after_error": "tab:orange"}
HISTOGRAM_FILE = "delta_weights.jsonl"
HISTOGRAM_BINS = 48
_SIDE_COLORS = {"pos": "tab:green", "neg": "tab:red", "zero": "tab:gray"}


# ----------------------------------------------------------------------------- reading


def read_metrics(workdir: str) -> list[dict]:
    """Rows of <workdir>/metrics.jsonl ([] if there is none)."""
    path = os.path.join(workdir, "metrics.jsonl")
    return read_jsonl(path) if os.path.isfile(path) else []


def series(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps int [S], values float [S]) of the rows holding `key`, sorted by step; a step written
    twice (a resumed run repeats the steps after its last checkpoint) keeps its last value;
    non-finite values are left out."""
    last = {}
    for row in rows:
        if key in row:
            try:
                value = float(row[key])
            except (TypeError, ValueError):
                continue
            if np.isfinite(value):  # the JSON writer stores nan / inf as strings: skipped
                last[int(row["step"])] = value
    steps = np.asarray(sorted(last), np.int64)
    return steps, np.asarray([last[s] for s in steps], np.float64)


def eval_metric_name(rows: Sequence[dict], kind: str = "eval") -> str | None:
    """The headline metric of `kind`'s evaluations: "eval/average/avg@k" (k of the run; "val/..."
    for the validations of data.val), or None without them."""
    for row in rows:
        for key in row:
            if key.startswith(f"{kind}/average/avg@"):
                return key
    return None


def eval_before_after(rows: Sequence[dict], rl_steps: int | None = None) -> dict | None:
    """Held-out accuracy of the first and the last evaluation of the run.

    Returns {"metric", "before_step", "before", "after_step", "after", "pass", "maj"}
    (accuracies as fractions; "pass": {k: (pass@k before, pass@k after)} for every pass@k both
    evaluations logged, "maj" the same of maj@k) or None when the run wrote fewer than two
    evaluations. rl_steps: when given, "after"
    must be the evaluation at that step (else None), so a half-finished run reports nothing.
    """
    key = eval_metric_name(rows)
    if key is None:
        return None
    steps, values = series(rows, key)
    if len(steps) < 2 or (rl_steps is not None and steps[-1] != rl_steps):
        return None
    before, after = int(steps[0]), int(steps[-1])
    out = {"metric": key, "before_step": before, "before": float(values[0]),
           "after_step": after, "after": float(values[-1])}
    for metric in ("pass", "maj"):
        prefix = key.rsplit("/", 1)[0] + f"/{metric}@"
        found = {}
        for name in {k for r in rows for k in r if k.startswith(prefix)}:
            at = dict(zip(*(x.tolist() for x in series(rows, name))))
            if before in at and after in at:
                found[int(name[len(prefix):])] = (float(at[before]), float(at[after]))
        out[metric] = dict(sorted(found.items()))
    return out


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` values (shorter at the start); same length."""
    values = np.asarray(values, np.float64)
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    start = np.maximum(idx - window, 0)
    return (csum[idx] - csum[start]) / (idx - start)


# ----------------------------------------------------------------------------- histograms


def histogram_edges(lam_min: float, lam_max: float, bins: int = HISTOGRAM_BINS) -> np.ndarray:
    """Bin edges [bins + 1] covering every weight DelTA can give: w = c * lambda with lambda in
    [lam_min, lam_max] and c = 1 / mean(lambda) in [1 / lam_max, 1 / lam_min]."""
    lo, hi = lam_min / lam_max, lam_max / lam_min
    if hi - lo < 1e-6:  # lam_min == lam_max: every weight is 1
        lo, hi = 0.5, 1.5
    return np.linspace(lo, hi, bins + 1)


@jax.jit
def side_histograms(weights: jax.Array, advantages: jax.Array, mask: jax.Array,
                    edges: jax.Array) -> jax.Array:
    """Token-weight histograms per side, computed where the arrays live (no host copy).

    weights fp32 [N, R]; advantages [N] or [N, R]; mask [N, R] (1 = valid response token);
    edges [E + 1] increasing. Returns fp32 [3, E]: token counts of sides pos (A > 0), neg (A < 0),
    zero (A = 0) per bin; the last bin includes its right edge, weights outside are dropped.
    """
    adv = advantages if advantages.ndim == 2 else advantages[:, None]
    adv = jnp.broadcast_to(adv, weights.shape)
    valid = mask > 0
    sides = jnp.stack([valid & (adv > 0), valid & (adv < 0), valid & (adv == 0)])
    w = weights.reshape(-1).astype(jnp.float32)
    return jnp.stack([jnp.histogram(w, bins=edges, weights=s.reshape(-1).astype(jnp.float32))[0]
                      for s in sides])


def append_weight_histogram(workdir: str, step: int, weights, advantages, mask,
                            lam_min: float, lam_max: float) -> dict:
    """Appends {"step", "edges", "counts": {side: [E]}} to <workdir>/delta_weights.jsonl."""
    edges = histogram_edges(lam_min, lam_max)
    counts = np.asarray(jax.device_get(side_histograms(weights, advantages, mask,
                                                       jnp.asarray(edges, jnp.float32))))
    record = {"step": int(step), "edges": [round(float(e), 6) for e in edges],
              "counts": {s: [int(round(c)) for c in counts[i]] for i, s in enumerate(SIDES)}}
    if jax.process_index() != 0:  # every process computed the (global) counts; one writes
        return record
    with open(os.path.join(workdir, HISTOGRAM_FILE), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return record


def read_weight_histograms(workdir: str) -> list[dict]:
    """Records of <workdir>/delta_weights.jsonl by step (last record of a repeated step)."""
    path = os.path.join(workdir, HISTOGRAM_FILE)
    if not os.path.isfile(path):
        return []
    by_step = {r["step"]: r for r in read_jsonl(path)}
    return [by_step[s] for s in sorted(by_step)]


# ----------------------------------------------------------------------------- plots


def _figure(rows: int, cols: int, size):
    from matplotlib.figure import Figure  # the Agg canvas; pyplot (and its global state) unused
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False).reshape(-1)


def plot_training(rows: Sequence[dict], path: str) -> str:
    """SFT loss, RL reward / accuracy with the held-out evals, response length; a PNG."""
    fig, (ax_sft, ax_rl, ax_len) = _figure(1, 3, (15, 4.2))
    steps, loss = series(rows, "sft/loss")
    if len(steps):
        ax_sft.plot(steps, loss, color="tab:purple")
        ax_sft.set_yscale("log")
    ax_sft.set(title="SFT warm start", xlabel="SFT step", ylabel="token NLL")

    for key, label, color in (("rollout/reward_mean", "rollout reward (shaped)", "tab:blue"),
                              ("rollout/accuracy", "rollout accuracy", "tab:orange")):
        s, v = series(rows, key)
        if len(s):
            ax_rl.plot(s, v, color=color, alpha=0.3, lw=0.8)
            ax_rl.plot(s, moving_average(v, 5), label=f"{label}, 5-step mean", color=color)
    for kind, label, style in (("eval", "held-out", "o-"), ("val", "validation", "s--")):
        key = eval_metric_name(rows, kind)
        if key is not None:
            s, v = series(rows, key)
            ax_rl.plot(s, v, style, color="black" if kind == "eval" else "dimgray",
                       label=f"{label} {key.rsplit('/', 1)[-1]}")
            for x, y in zip(s, v):
                ax_rl.annotate(f"{100 * y:.1f}%", (x, y), textcoords="offset points",
                               xytext=(0, 6 if kind == "eval" else -12), ha="center", fontsize=8)
    ax_rl.set(title="RL: reward and accuracy", xlabel="RL step", ylabel="fraction")
    ax_rl.grid(alpha=0.3)
    if ax_rl.get_legend_handles_labels()[0]:
        ax_rl.legend(fontsize=8, loc="lower right")

    s, v = series(rows, "rollout/response_len_mean")
    if len(s):
        ax_len.plot(s, v, color="tab:green", label="mean")
        s2, v2 = series(rows, "rollout/response_len_max")
        ax_len.plot(s2, v2, color="tab:green", alpha=0.4, ls="--", label="max")
        ax_len.legend(fontsize=8)
    ax_len.set(title="RL: response length", xlabel="RL step", ylabel="tokens")
    return _save(fig, path)


def plot_delta_weights(rows: Sequence[dict], histograms: Sequence[dict], path: str) -> str:
    """DelTA token weights per side: the distribution over all RL steps (and over the first and
    last quarter of them), and mean +- std per step; a PNG."""
    fig, (ax_all, ax_early_late, ax_steps) = _figure(1, 3, (15, 4.2))
    if histograms:
        edges = np.asarray(histograms[-1]["edges"])
        centers, width = 0.5 * (edges[1:] + edges[:-1]), np.diff(edges)
        q = max(1, len(histograms) // 4)
        for side in SIDES:
            per_step = np.asarray([h["counts"][side] for h in histograms
                                   if len(h["edges"]) == len(edges)], np.float64)
            if per_step.sum() == 0:
                continue
            total = per_step.sum(0)
            ax_all.step(centers, total / (total.sum() * width), where="mid",
                        color=_SIDE_COLORS[side], label=f"{side} ({int(total.sum())} tokens)")
            for part, ls, name in ((per_step[:q], ":", "first"), (per_step[-q:], "-", "last")):
                c = part.sum(0)
                if c.sum() > 0:
                    ax_early_late.step(centers, c / (c.sum() * width), where="mid", ls=ls,
                                       color=_SIDE_COLORS[side], label=f"{side}, {name} {q} steps")
        ax_all.axvline(1.0, color="black", lw=0.6)
        ax_early_late.axvline(1.0, color="black", lw=0.6)
    for ax, title in ((ax_all, "token weights, all RL steps"),
                      (ax_early_late, "early vs late RL steps")):
        ax.set(title=title, xlabel="DelTA weight w = c * lambda", ylabel="density")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for side in SIDES:
        s, mean = series(rows, f"delta/weight_mean_{side}")
        if not len(s):
            continue
        _, std = series(rows, f"delta/weight_std_{side}")
        s_tok, tokens = series(rows, f"delta/tokens_{side}")
        if len(s_tok) == len(s):  # a step without tokens on this side reports 0: leave it out
            keep = tokens > 0
            s, mean, std = s[keep], mean[keep], std[keep] if len(std) == len(keep) else std
        color = _SIDE_COLORS[side]
        ax_steps.plot(s, mean, color=color, label=f"{side} mean +- std")
        if len(std) == len(s):
            ax_steps.fill_between(s, mean - std, mean + std, color=color, alpha=0.2)
    ax_steps.set(title="weight per side, per RL step", xlabel="RL step", ylabel="weight")
    ax_steps.grid(alpha=0.3)
    if ax_steps.get_legend_handles_labels()[0]:
        ax_steps.legend(fontsize=8)
    return _save(fig, path)


def credit_classes(rows: Sequence[dict]) -> list[str]:
    """The classes (not "none") with a credit/weight_{class}_{side} series in the rows, in
    CLASS_NAMES order (classes unknown to this module after them, sorted)."""
    found = set()
    for row in rows:
        for key in row:
            if key.startswith("credit/weight_"):
                name = key[len("credit/weight_"):]
                for side in ("_pos", "_neg"):
                    if name.endswith(side):
                        found.add(name[:-len(side)])
    found.discard("none")
    known = [c for c in credit.CLASS_NAMES if c in found]  # code 0, "none", is not drawn
    return known + sorted(found - set(known))


def has_credit(rows: Sequence[dict]) -> bool:
    return any(k.startswith("credit/") for row in rows for k in row)


def plot_credit(rows: Sequence[dict], path: str) -> str:
    """Ground-truth token credit on the synthetic task: per side (A > 0, A < 0) the mean DelTA
    weight of each token class over the RL steps, and the AUC series; a PNG. Steps where a class
    has no token (credit/tokens_{class}_{side} == 0, or no finite weight) are left out."""
    fig, (ax_pos, ax_neg, ax_auc) = _figure(1, 3, (15, 4.2))
    for side, ax, title in (("pos", ax_pos, "A > 0 (correct-leaning)"),
                            ("neg", ax_neg, "A < 0 (wrong-leaning)")):
        for cls in credit_classes(rows):
            s, w = series(rows, f"credit/weight_{cls}_{side}")
            s_tok, tokens = series(rows, f"credit/tokens_{cls}_{side}")
            if len(s_tok):
                has_tokens = set(s_tok[tokens > 0].tolist())
                keep = np.asarray([int(x) in has_tokens for x in s], bool)
                s, w = s[keep], w[keep]
            if not len(s):
                continue
            color = _CLASS_COLORS.get(cls)
            ax.plot(s, w, color=color, alpha=0.3, lw=0.8)
            ax.plot(s, moving_average(w, 5), color=color, label=f"{cls}, 5-step mean")
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set(title=f"weight per token class, {title}", xlabel="RL step",
               ylabel="mean token weight (DelTA; 1 for grpo / dapo)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for (key, label), color in zip(CREDIT_AUCS, ("tab:red", "tab:blue")):
        s, v = series(rows, key)
        if len(s):
            ax_auc.plot(s, v, color=color, alpha=0.3, lw=0.8)
            ax_auc.plot(s, moving_average(v, 5), color=color, label=f"{label}, 5-step mean")
    ax_auc.axhline(0.5, color="black", lw=0.6, ls="--")
    ax_auc.set(title="AUC of the weight (0.5 = no separation)", xlabel="RL step", ylabel="AUC",
               ylim=(0, 1))
    ax_auc.grid(alpha=0.3)
    if ax_auc.get_legend_handles_labels()[0]:
        ax_auc.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def write_plots(workdir: str) -> list[str]:
    """<workdir>/plots/training.png, delta_weights.png when the run has DelTA weights, and
    credit.png when it has ground-truth credit metrics (the synthetic task)."""
    rows = read_metrics(workdir)
    out_dir = os.path.join(workdir, "plots")
    paths = [plot_training(rows, os.path.join(out_dir, "training.png"))]
    histograms = read_weight_histograms(workdir)
    if histograms or any("delta/weight_mean_pos" in r for r in rows):
        paths.append(plot_delta_weights(rows, histograms, os.path.join(out_dir,
                                                                       "delta_weights.png")))
    if has_credit(rows):
        paths.append(plot_credit(rows, os.path.join(out_dir, "credit.png")))
    return paths


def write_report(workdir: str, rl_steps: int | None = None) -> str:
    """Writes the plots; returns the end-of-run summary (held-out accuracy before / after RL)."""
    rows = read_metrics(workdir)
    paths = write_plots(workdir)
    lines = []
    result = eval_before_after(rows, rl_steps)
    if result is not None:
        metric = result["metric"].rsplit("/", 1)[-1]
        before_eval = _eval_file(workdir, result["before_step"])
        after_eval = _eval_file(workdir, result["after_step"])
        n = _num_questions(after_eval)
        on = f" on {n} held-out problems" if n else " (held out)"
        change = (evaluation.paired_change(before_eval, after_eval)
                  if before_eval is not None and after_eval is not None else {})
        lines.append(f"eval accuracy ({metric}{on}): before RL {100 * result['before']:.1f}% "
                     f"(step {result['before_step']}) -> after RL {100 * result['after']:.1f}% "
                     f"(step {result['after_step']}), "
                     f"{100 * (result['after'] - result['before']):+.1f} points"
                     + _interval_text(change.get(metric)))
        for metric in ("pass", "maj"):
            if result[metric]:
                lines.append(f"{metric}@k before -> after RL: " + ", ".join(
                    f"{metric}@{k} {100 * b:.1f}% -> {100 * a:.1f}% ({100 * (a - b):+.1f}"
                    f"{_interval_text(change.get(f'{metric}@{k}'), short=True)})"
                    for k, (b, a) in result[metric].items()))
        if change:
            lines.append("(95% intervals: Student t over the per-problem changes, paired by "
                         "problem; they cover which problems and samples were drawn, not the "
                         "spread between training runs)")
    from delta_jax.train.best import BEST, read_best
    record = read_best(workdir)
    if record is not None:  # train.best_metric
        lines.append(f"best {record['metric']} ({record['mode']}): {100 * record['value']:.1f}% "
                     f"at step {record['step']}; that policy: {os.path.join(workdir, BEST)}")
    if has_credit(rows):
        lines += credit_report_lines(rows, _run_method(workdir))
    lines.append("plots: " + ", ".join(paths))
    lines.append("metrics: " + os.path.join(workdir, "metrics.jsonl"))
    return "\n".join(lines)


def credit_summary(rows: Sequence[dict]) -> dict:
    """delta_jax.rl.credit.summarize(rows): the run's per-class weights and AUCs, keys
    "credit/..." ({} when the rows hold no credit metrics)."""
    if not has_credit(rows):
        return {}
    return dict(credit.summarize(rows))


def credit_report_lines(rows: Sequence[dict], method: str | None = None) -> list[str]:
    """The report's credit lines: mean token weight per class and side, the AUCs, and one line on
    how first-error tokens are weighted against boilerplate in wrong-leaning responses. method:
    the run's (None = delta); a grpo / dapo run's loss weights every token 1, so its lines name
    the method rather than DelTA."""
    who = "DelTA" if method in (None, "delta") else f"the {method} loss"
    summary = credit_summary(rows)
    fmt = lambda x: f"{x:.3f}" if isinstance(x, (int, float)) and x == x else "n/a"  # noqa: E731
    classes = list(credit.CLASS_NAMES[1:])
    lines = []
    for side, name in (("neg", "A < 0"), ("pos", "A > 0")):
        parts = [f"{c} {fmt(summary[f'credit/weight_{c}_{side}'])} "
                 f"({int(summary.get(f'credit/tokens_{c}_{side}', 0))} tokens)" for c in classes
                 if f"credit/weight_{c}_{side}" in summary]
        if parts:
            lines.append(f"credit, mean {'DelTA ' if who == 'DelTA' else ''}token weight per "
                         f"class ({name}): "
                         + ", ".join(parts))
    aucs = [f"{label} {fmt(summary[key])}" for key, label in CREDIT_AUCS if key in summary]
    if aucs:
        lines.append("credit, AUC of the weight: " + "; ".join(aucs) + " (0.5 = no separation)")
    fe = summary.get("credit/weight_first_error_neg")
    bp = summary.get("credit/weight_boilerplate_neg")
    if all(isinstance(x, (int, float)) and x == x for x in (fe, bp)) and bp > 0:
        verdict = ("more than" if fe > bp else "less than" if fe < bp else "the same as")
        lines.append(f"credit: in wrong-leaning responses {who} weights first-error tokens "
                     f"{verdict} boilerplate ({fe:.3f} vs {bp:.3f}, ratio {fe / bp:.3f})")
    else:
        lines.append("credit: no first-error vs boilerplate comparison (a class had no "
                     "tokens on the A < 0 side)")
    return lines


def _run_method(workdir: str) -> str | None:
    try:
        with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("method")
    except (OSError, ValueError, AttributeError):
        return None


def _interval_text(change: dict | None, short: bool = False) -> str:
    if not change or not np.isfinite(change["lo"]):
        return ""
    lo, hi = 100 * change["lo"], 100 * change["hi"]
    return f", 95% CI [{lo:+.1f}, {hi:+.1f}]" if short else f" (95% CI {lo:+.1f} to {hi:+.1f})"


def _eval_file(workdir: str, step: int) -> dict | None:
    """The run's eval/step_<step>.json (EvalResult.to_dict()), or None when absent or unreadable."""
    try:
        with open(os.path.join(workdir, "eval", f"step_{step}.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _num_questions(result: dict | None) -> int | None:
    try:
        return int(result["average"]["num_questions"])
    except (KeyError, ValueError, TypeError):
        return None
