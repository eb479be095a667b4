"""What DelTA does, token by token: a rollout batch from a checkpoint with each response token
shaded by its DelTA coefficient, and the tokens DelTA down- and up-weights most on each side.

    python -m delta_jax.token_view --workdir=runs/tiny [--step N] [--out view.html]
        [--png view.png] [--show 6] [--top 12] [--min_count 3]

The coefficients come from the trainer's own pieces, in the trainer's order: the run's config
(<workdir>/config.json), the checkpoint's parameters and data-iterator position, the run's data
pipeline (the prompts of RL step N + 1), the Sampler rollout with the step's seed, the reward scorer
(with the method's overlong shaping), the advantage estimator, the one old-policy pass (log p and
the final hidden states) and rl.delta.delta_coefficients with the run's delta.* settings. So for a
checkpoint at step N of a delta run the weights are the ones RL step N + 1 trained with. (For a
grpo / dapo run the view shows what DelTA would have done on that batch.)

What to look for (the paper's point): tokens every response shares whatever its reward (the "="
and "." of each worked step, "\\boxed{", the end-of-turn token) carry no information about the
outcome, and plain token-mean GRPO/DAPO gives them the same weight as the tokens that decide it.
DelTA's weights move mass between them: on the default tiny run, in wrong (A < 0) responses the
shared formatting tokens are the most down-weighted and the digits the model got wrong the most
up-weighted, so the penalty lands on the error rather than on the format.

On the synthetic task (data.train = "synthetic") every response token also gets its ground-truth
credit class (delta_jax.rl.credit, labelled by the run's own run.credit_labeller against the
prompt's reference solution): boilerplate, step (a digit of a correct intermediate result or of
the answer), first_error (where a response first departs from the reference), after_error. The
HTML and PNG mark the class on each token (an underline / box per class, with a legend), the text
output prints a few wrong responses with a class marker line under them, and the ranking adds the
mean weight per class and side (rl.credit.credit_metrics, the numbers the trainer logs as
credit/*).
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import json
import os
import sys
from typing import Sequence

import numpy as np

from delta_jax.errors import InputError, MissingInputError
from delta_jax.rl import credit

SIDES = ("pos", "neg")  # tokens of responses with A > 0 / A < 0 (A = 0 tokens get no gradient)


@dataclasses.dataclass
class TokenView:
    """One rollout batch and its DelTA coefficients; N rows = prompts x group_size, prompt-major.

    token_ids int32 [N, R] (response tokens, padding outside mask); mask fp32 [N, R];
    weights fp32 [N, R] (DelTA w = c * lambda, 0 on padding); token_prob fp32 [N, R] (p of the
    sampled token under the old policy at the rollout temperature); advantages fp32 [N];
    rewards fp32 [N] (shaped, what the advantages used); accuracy fp32 [N] (0/1);
    problems / answers: per prompt; token_text: id -> text for every id in token_ids;
    classes int8 [N, R] or None: the ground-truth credit classes (rl.credit codes, 0 on padding)
    when the run's task has them (the synthetic task), else None.
    """
    step: int
    method: str
    group_size: int
    token_ids: np.ndarray
    mask: np.ndarray
    weights: np.ndarray
    token_prob: np.ndarray
    advantages: np.ndarray
    rewards: np.ndarray
    accuracy: np.ndarray
    problems: list
    answers: list
    token_text: dict
    diagnostics: dict
    settings: dict
    classes: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])


# ----------------------------------------------------------------------------- computing


def load_run_config(workdir: str):
    """The run's resolved config (<workdir>/config.json) on top of today's schema, in train mode.

    config.json is written by delta_jax.main, so a field today's schema lacks was retired since
    the run started (as config.resume_changes treats it: e.g. debug, model.logprob_chunk,
    rollout.decode_split_k); such fields are skipped and named on stderr."""
    from ml_collections import config_dict

    from delta_jax.train.config import default_config, validate_config

    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise MissingInputError(f"{path} not found: --workdir must be a run directory written by "
                                "python -m delta_jax.main")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    cfg = default_config()
    retired = []

    def merge(node, values, prefix):
        for key, value in values.items():
            if key not in node:
                retired.append(prefix + key)
            elif isinstance(node[key], config_dict.ConfigDict):
                merge(node[key], value, f"{prefix}{key}.")
            else:
                node[key] = value

    merge(cfg, saved, "")
    if retired:
        print(f"{path}: skipped config fields this version no longer has: "
              f"{', '.join(sorted(retired))}", file=sys.stderr)
    cfg.mode = "train"
    cfg.train.progress_bar = False
    return validate_config(cfg)


def compute_token_view(workdir: str, step: int | None = None) -> TokenView:
    """Rolls out RL step `step` + 1's prompts with the policy of checkpoint `step` (default: the
    latest) and computes their DelTA coefficients with the trainer's own step
    (rl_step.prepare_batch, on the run's mesh)."""
    import jax

    from delta_jax.train import rl_step as rl_step_lib
    from delta_jax.train import run as run_lib

    cfg = load_run_config(workdir)
    run = run_lib.build_run(cfg, workdir, with_delta=True)
    try:
        steps = run.ckpt.all_steps()
        if not steps:
            raise MissingInputError(f"no checkpoint in {run.ckpt.directory}")
        step = max(steps) if step is None else int(step)
        if step not in steps:
            raise InputError(f"--step {step}: no such checkpoint in {run.ckpt.directory} "
                             f"(have {sorted(steps)})")
        state, data_state, _ = run.ckpt.restore(step, run_lib.abstract_state(run))
        run.take_initial_params(read=False)  # the checkpoint's stand in for them
        if run.ref_pass is not None:  # the KL reference, as the resumed run has it
            run.ref_params = run_lib.resumed_reference(run, state.params)
        run.data_iter.set_state(data_state)
        prep = rl_step_lib.prepare_batch(run, state.params, step + 1)
        rb, roll = prep.packed, prep.rollout
        # The DelTA weights whatever the run's method (grpo / dapo train with the mask).
        weights, logp = jax.device_get((prep.delta_weights, prep.batch["old_logp"]))
        token_ids = rb.input_ids[:, rb.prompt_len:]
        ids = np.unique(token_ids[rb.response_mask > 0])
        labeller = getattr(run, "credit_labeller", None)  # the synthetic task only
        classes = (None if labeller is None else
                   np.asarray(labeller(roll.records, token_ids, rb.response_mask), np.int8))
        return TokenView(
            step=step, method=cfg.method, group_size=cfg.rollout.group_size, token_ids=token_ids,
            mask=rb.response_mask, weights=np.asarray(weights, np.float32),
            token_prob=np.exp(np.asarray(logp, np.float32)) * rb.response_mask,
            advantages=rb.advantages, rewards=rb.rewards,
            accuracy=np.asarray(roll.accuracy, np.float32),
            problems=[r["problem"] for r in roll.records],
            answers=[str(r["answer"]) for r in roll.records],
            token_text={int(i): run.tokenizer.decode([int(i)]) for i in ids},
            diagnostics=dict(prep.delta_diagnostics),
            settings={"lam_min": cfg.delta.lam_min, "lam_max": cfg.delta.lam_max,
                      "num_refine": cfg.delta.num_refine,
                      "temperature": cfg.rollout.temperature,
                      # the ablation flags (DELTA_SPEC section 4), shown in the header
                      "proxy": cfg.delta.proxy, "fixed_gamma": cfg.delta.fixed_gamma,
                      "assignment": cfg.delta.assignment, "normalize": cfg.delta.normalize,
                      "weight": cfg.delta.weight, "random_lambda": cfg.delta.random_lambda},
            classes=classes)
    finally:
        run.close()


# ----------------------------------------------------------------------------- ranking


def rank_tokens(token_ids: np.ndarray, weights: np.ndarray, advantages: np.ndarray,
                mask: np.ndarray, min_count: int = 3, top: int = 10) -> dict:
    """Tokens by their average DelTA weight on each side.

    token_ids int [N, R]; weights [N, R]; advantages [N]; mask [N, R]. A token (id) counts on side
    pos (neg) for every valid occurrence in a response with A > 0 (A < 0); only ids with at least
    `min_count` occurrences on a side are ranked there. Returns {side: {"down": [...], "up": [...]}}
    with up to `top` entries (token_id, mean_weight, count): "down" lowest mean first, "up"
    highest first.
    """
    token_ids = np.asarray(token_ids)
    weights = np.asarray(weights, np.float64)
    valid = np.asarray(mask) > 0
    adv = np.broadcast_to(np.asarray(advantages, np.float64).reshape(-1, 1), valid.shape)
    size = int(token_ids.max(initial=0)) + 1
    out = {}
    for side, on_side in (("pos", valid & (adv > 0)), ("neg", valid & (adv < 0))):
        ids = token_ids[on_side]
        count = np.bincount(ids, minlength=size)
        total = np.bincount(ids, weights=weights[on_side], minlength=size)
        ranked = np.flatnonzero(count >= max(min_count, 1))
        mean = total[ranked] / count[ranked]
        order = np.lexsort((ranked, mean))  # by mean, ties by id: deterministic
        entries = [(int(ranked[i]), float(mean[i]), int(count[ranked[i]])) for i in order]
        out[side] = {"down": entries[:top], "up": entries[::-1][:top]}
    return out


def _shown(text: str) -> str:
    """A token's text made visible: spaces as a middle dot, newlines as a return sign, other
    control characters as escapes."""
    text = text.replace(" ", "\u00b7").replace("\n", "\u23ce").replace("\t", "\u21e5")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text) or "\u2205"


def format_ranking(view: TokenView, ranking: dict) -> str:
    """Plain-text tables of the most down- and up-weighted tokens on each side."""
    lines = []
    names = {"pos": "A > 0 (correct-leaning responses)", "neg": "A < 0 (wrong-leaning responses)"}
    for side in SIDES:
        for kind, label in (("down", "most down-weighted"), ("up", "most up-weighted")):
            lines.append(f"{label} tokens, side {names[side]}:")
            rows = ranking[side][kind]
            if not rows:
                lines.append("  (no token with enough occurrences)")
            for tid, mean, count in rows:
                lines.append(f"  {_shown(view.token_text.get(tid, str(tid))):>14s}  "
                             f"mean weight {mean:.3f}  ({count} tokens)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- credit classes

# Per rl.credit class (code 0, none: padding / prompt) the marker of the text output, the CSS of
# the HTML token and the PNG underline (color, line width, line style, box).
CLASS_NAMES = credit.CLASS_NAMES
CLASS_MARK = {"none": " ", "boilerplate": " ", "step": "^", "first_error": "X",
              "after_error": "~"}
CLASS_CSS = {"none": "", "boilerplate": "",
             "step": "border-bottom:2px solid #1f77b4",
             "first_error": "outline:2px solid #000;outline-offset:-1px;font-weight:bold",
             "after_error": "border-bottom:2px dotted #ff7f0e"}
CLASS_PNG = {"step": ("#1f77b4", 1.6, "-", False), "first_error": ("#000000", 1.4, "-", True),
             "after_error": ("#ff7f0e", 1.4, ":", False)}
CLASS_MEANING = {
    "boilerplate": "text the problem determines (operands, operators, '=', '.', \\boxed{})",
    "step": "a digit of a correct intermediate result or of the answer",
    "first_error": "where the response first departs from the reference solution",
    "after_error": "everything after the first error",
}


def class_name(code: int) -> str:
    return CLASS_NAMES[code] if 0 <= code < len(CLASS_NAMES) else str(code)


def class_weights(view: TokenView) -> dict:
    """Mean DelTA weight per credit class and side: rl.credit.credit_metrics of the view's
    classes, weights, advantages and mask (the credit/* metrics the trainer logs for this batch,
    scored with DelTA's weights). {} without classes."""
    if view.classes is None:
        return {}
    return credit.credit_metrics(view.classes, view.weights, view.advantages, view.mask)


def format_class_weights(metrics: dict) -> str:
    """Plain-text table of class_weights: per side, each class's mean weight and token count,
    then the AUCs."""
    if not metrics:
        return ""
    names = {"pos": "A > 0 (correct-leaning responses)", "neg": "A < 0 (wrong-leaning responses)"}
    lines = []
    for side in SIDES:
        lines.append(f"mean DelTA weight per credit class, side {names[side]}:")
        for cls in CLASS_NAMES[1:]:
            n = int(metrics.get(f"credit/tokens_{cls}_{side}", 0))
            w = metrics.get(f"credit/weight_{cls}_{side}")
            lines.append(f"  {cls:>12s}  " + (f"mean weight {w:.3f}  ({n} tokens)" if n else
                                               "(no tokens)"))
    return "\n".join(lines + _auc_lines(metrics))


def _auc_lines(metrics: dict) -> list[str]:
    out = []
    for key, label in (("credit/auc_first_error_neg", "first_error vs the other tokens, A < 0"),
                       ("credit/auc_step_pos", "step vs boilerplate, A > 0")):
        n = int(metrics.get(key + "_responses", 0))
        value = metrics.get(key)
        out.append(f"AUC of the weight, {label}: "
                   + (f"{value:.3f} over {n} responses" if value is not None else "n/a")
                   + " (0.5 = no separation)")
    return out


def format_credit_responses(view: TokenView, max_rows: int = 3, width_chars: int = 96) -> str:
    """A few wrong-leaning responses (A < 0) with a first_error token, as text with a marker line
    under each line of tokens: '^' step, 'X' first_error, '~' after_error, blank boilerplate.
    "" without classes."""
    if view.classes is None:
        return ""
    first_error = CLASS_NAMES.index("first_error")
    rows = [r for r in range(view.num_rows) if view.advantages[r] < 0
            and np.any((view.classes[r] == first_error) & (view.mask[r] > 0))][:max_rows]
    legend = ", ".join(f"{m!r} {c}" for c, m in CLASS_MARK.items() if m.strip())
    out = [f"credit classes under the tokens ({legend}; blank: boilerplate):"]
    for r in rows:
        out.append(f"response {r} (A = {view.advantages[r]:+.3f}, problem "
                   f"{r // view.group_size}, gold {view.answers[r // view.group_size]}):")
        text, marks = "", ""
        for t in np.flatnonzero(view.mask[r] > 0):
            piece = _shown(view.token_text.get(int(view.token_ids[r, t]), "?"))
            if len(text) + len(piece) > width_chars and text:
                out += ["  " + text, "  " + marks]
                text, marks = "", ""
            text += piece
            marks += CLASS_MARK.get(class_name(int(view.classes[r, t])), "?") * len(piece)
        if text:
            out += ["  " + text, "  " + marks]
    if not rows:
        out.append("  (no wrong-leaning response with a first_error token in this batch)")
    return "\n".join(out)


# ----------------------------------------------------------------------------- rendering


def _color(weight: float, scale: float, active: bool) -> str:
    """Diverging shading around 1: red above (up-weighted), blue below; gray without gradient."""
    if not active:
        return "rgb(235,235,235)"
    t = max(-1.0, min(1.0, (weight - 1.0) / scale))
    k = int(round(255 * (1 - abs(t) * 0.85)))
    return f"rgb(255,{k},{k})" if t > 0 else f"rgb({k},{k},255)"


def _scale(view: TokenView) -> float:
    """Half-width of the color scale: the largest |w - 1| on a side with gradient."""
    active = (view.mask > 0) & (view.advantages[:, None] != 0)
    return float(max(np.max(np.abs(view.weights - 1.0)[active], initial=0.0), 1e-3))


def render_html(view: TokenView, ranking: dict, show_prompts: int = 6) -> str:
    """A standalone HTML page: per prompt its responses with every token shaded by its weight
    (hover for weight, p, advantage), then the ranking tables."""
    scale = _scale(view)
    G = view.group_size
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>DelTA token view</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        ".resp{font-family:monospace;white-space:pre-wrap;line-height:1.9;margin:.2em 0 .6em}"
        ".tok{padding:1px 0;border-radius:2px}.meta{color:#666;font-size:.85em}"
        "table{border-collapse:collapse;margin:.5em 2em 1em 0;display:inline-table;"
        "vertical-align:top}td,th{border:1px solid #ccc;padding:2px 8px;font-size:.9em}"
        "</style></head><body>",
        f"<h1>DelTA token view, checkpoint step {view.step}</h1>",
        f"<p>Run method: <b>{esc(view.method)}</b>. Each response token is shaded by its DelTA "
        f"weight w = c &middot; &lambda; (mean 1 over the batch's valid tokens; &lambda; in "
        f"[{view.settings['lam_min']}, {view.settings['lam_max']}], K = "
        f"{view.settings['num_refine']}): <span style='background:{_color(1 + scale, scale, 1)}'>"
        f"&nbsp;up-weighted (w = {1 + scale:.3f})&nbsp;</span> <span style='background:"
        f"{_color(1 - scale, scale, 1)}'>&nbsp;down-weighted (w = {1 - scale:.3f})&nbsp;</span> "
        f"<span style='background:{_color(1, scale, 0)}'>&nbsp;advantage 0 (no gradient)"
        f"&nbsp;</span>. Hover a token for its numbers.</p>",
        "<p class='meta'>DelTA settings: " + ", ".join(
            f"{k} = {v}" for k, v in view.settings.items()) + "</p>",
        "<p class='meta'>" + ", ".join(f"{k} = {v:.4g}" for k, v in view.diagnostics.items()
                                       if not k.startswith(("weight_", "tokens_")))
        + "</p>",
    ]
    if view.classes is not None:
        parts.append("<p>Ground-truth credit class of each token (synthetic task, against the "
                     "reference solution): " + ", ".join(
                         f"<span class='tok' style='{CLASS_CSS[c]}'>&nbsp;{c}&nbsp;</span> "
                         f"({esc(CLASS_MEANING[c])})" for c in CLASS_NAMES[2:])
                     + ", unmarked: boilerplate (" + esc(CLASS_MEANING["boilerplate"])
                     + ").</p>")
    for i in range(min(show_prompts, len(view.problems))):
        parts.append(f"<h3>{esc(view.problems[i])} <span class='meta'>(gold answer "
                     f"{esc(view.answers[i])})</span></h3>")
        for r in range(i * G, (i + 1) * G):
            adv, active = float(view.advantages[r]), float(view.advantages[r]) != 0
            parts.append(f"<div class='meta'>response {r - i * G}: reward "
                         f"{view.rewards[r]:.2f}, correct {int(view.accuracy[r])}, advantage "
                         f"{adv:+.3f}</div><div class='resp'>")
            for t in np.flatnonzero(view.mask[r] > 0):
                w, tid = float(view.weights[r, t]), int(view.token_ids[r, t])
                text = view.token_text.get(tid, str(tid))
                title = f"w={w:.4f} p={float(view.token_prob[r, t]):.3f} A={adv:+.3f} id={tid}"
                style = f"background:{_color(w, scale, active)}"
                if view.classes is not None:
                    cls = class_name(int(view.classes[r, t]))
                    title += f" class={cls}"
                    style += f";{CLASS_CSS[cls]}" if CLASS_CSS.get(cls) else ""
                parts.append(f"<span class='tok' style='{style}' "
                             f"title='{esc(title)}'>{esc(text)}</span>")
            parts.append("</div>")
    parts.append("<h2>Tokens by average weight (over the whole batch)</h2>")
    for side in SIDES:
        for kind in ("down", "up"):
            parts.append(f"<table><tr><th colspan=3>side {side} (A {'>' if side == 'pos' else '<'}"
                         f" 0): most {kind}-weighted</th></tr>"
                         "<tr><th>token</th><th>mean w</th><th>count</th></tr>")
            for tid, mean, count in ranking[side][kind]:
                text = esc(_shown(view.token_text.get(tid, str(tid))))
                parts.append(f"<tr><td style='font-family:monospace;background:"
                             f"{_color(mean, scale, True)}'>{text}</td><td>{mean:.3f}</td>"
                             f"<td>{count}</td></tr>")
            parts.append("</table>")
    metrics = class_weights(view)
    if metrics:
        parts.append("<h2>Mean DelTA weight per credit class (over the whole batch)</h2><table>"
                     "<tr><th>class</th><th>A &gt; 0: mean w</th><th>tokens</th>"
                     "<th>A &lt; 0: mean w</th><th>tokens</th></tr>")
        for cls in CLASS_NAMES[1:]:
            cells = []
            for side in SIDES:
                w = metrics.get(f"credit/weight_{cls}_{side}")
                cells.append(f"<td>{'' if w is None else f'{w:.3f}'}</td><td>"
                             f"{int(metrics.get(f'credit/tokens_{cls}_{side}', 0))}</td>")
            parts.append(f"<tr><td><span class='tok' style='{CLASS_CSS[cls]}'>{cls}</span></td>"
                         + "".join(cells) + "</tr>")
        parts.append("</table><p class='meta'>" + "<br>".join(esc(x) for x in _auc_lines(metrics))
                     + "</p>")
    parts.append("</body></html>")
    return "".join(parts)


def render_png(view: TokenView, path: str, max_rows: int = 12, width_chars: int = 96) -> str:
    """A PNG of the first `max_rows` responses with an advantage != 0, tokens shaded as in the
    HTML (matplotlib Agg, monospace layout)."""
    from matplotlib.figure import Figure

    scale = _scale(view)
    rows = [r for r in range(view.num_rows) if view.advantages[r] != 0][:max_rows]
    lines = []  # per display line: [(text, color, class)], with a header line per response
    if view.classes is not None:
        lines.append([("credit class: underline = step, box = first_error, dotted = "
                       "after_error, unmarked = boilerplate", None, None)])
    for r in rows:
        lines.append([(f"A = {view.advantages[r]:+.2f}  reward {view.rewards[r]:.2f}", None,
                       None)])
        line, used = [], 0
        for t in np.flatnonzero(view.mask[r] > 0):
            text = _shown(view.token_text.get(int(view.token_ids[r, t]), "?")).replace("\u00b7",
                                                                                         " ")
            if used + len(text) > width_chars and line:
                lines.append(line)
                line, used = [], 0
            cls = None if view.classes is None else class_name(int(view.classes[r, t]))
            line.append((text, _color(float(view.weights[r, t]), scale, True), cls))
            used += len(text)
        lines.append(line)
    width_chars = min(width_chars, max(60, max(sum(len(t) for t, _, _ in ln) for ln in lines) + 2))
    height = max(1.0, 0.22 * len(lines) + 0.6)
    fig = Figure(figsize=(0.085 * width_chars + 0.4, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    ax.set_xlim(0, width_chars + 2)
    ax.set_ylim(len(lines) + 1, 0)
    ax.text(1, 0.5, f"DelTA weights, checkpoint step {view.step} (red > 1 > blue, scale "
            f"+-{scale:.3f})", fontsize=8, va="center", weight="bold")
    for y, line in enumerate(lines, start=1):
        x = 1.0
        for text, color, cls in line:
            if color is None:
                ax.text(x, y + 0.5, text, fontsize=7, va="center", color="#555")
                continue
            ax.add_patch(_rect(x, y + 0.1, len(text), 0.8, color))
            if cls in CLASS_PNG:
                mark, lw, ls, box = CLASS_PNG[cls]
                if box:
                    ax.add_patch(_box(x, y + 0.1, len(text), 0.8, mark, lw))
                else:
                    ax.plot([x + 0.1, x + len(text) - 0.1], [y + 0.85, y + 0.85], color=mark,
                            lw=lw, ls=ls, solid_capstyle="butt")
            ax.text(x, y + 0.5, text, fontsize=7.5, va="center", family="monospace")
            x += len(text)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _rect(x, y, w, h, color):
    from matplotlib.patches import Rectangle
    rgb = tuple(int(v) / 255 for v in color[4:-1].split(","))
    return Rectangle((x, y), w, h, facecolor=rgb, edgecolor="none")


def _box(x, y, w, h, color, lw):
    from matplotlib.patches import Rectangle
    return Rectangle((x, y), w, h, facecolor="none", edgecolor=color, lw=lw)


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="run directory of delta_jax.main")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--out", default=None, help="HTML file (default <workdir>/token_view.html)")
    parser.add_argument("--png", default=None, help="also render a PNG of some responses here")
    parser.add_argument("--show", type=int, default=6, help="prompts shown in the HTML")
    parser.add_argument("--top", type=int, default=12, help="tokens listed per table")
    parser.add_argument("--min_count", type=int, default=3,
                        help="occurrences a token needs on a side to be ranked")
    args = parser.parse_args(argv)

    from delta_jax.train.config import ConfigError
    try:
        view = compute_token_view(args.workdir, args.step)
    except (InputError, ConfigError) as e:  # the run directory's, named in the message
        print(f"error: {e}", file=sys.stderr)
        return 1
    ranking = rank_tokens(view.token_ids, view.weights, view.advantages, view.mask,
                          min_count=args.min_count, top=args.top)
    out = args.out or os.path.join(args.workdir, "token_view.html")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(render_html(view, ranking, show_prompts=args.show))
    valid = view.mask > 0
    print(f"checkpoint step {view.step}: {view.num_rows} responses, {int(valid.sum())} tokens, "
          f"accuracy {view.accuracy.mean():.3f}, sides pos/neg/zero = "
          f"{int((valid & (view.advantages[:, None] > 0)).sum())}/"
          f"{int((valid & (view.advantages[:, None] < 0)).sum())}/"
          f"{int((valid & (view.advantages[:, None] == 0)).sum())} tokens")
    print(format_ranking(view, ranking))
    if view.classes is not None:
        print(format_class_weights(class_weights(view)))
        print(format_credit_responses(view))
    print(f"html: {out}")
    if args.png:
        print(f"png: {render_png(view, args.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
