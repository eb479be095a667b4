"""How well token weights find the tokens that matter: a report against ground-truth labels.

On a task with known worked solutions (the synthetic arithmetic task: data.synthetic.token_classes)
every response token gets a class:

    code  name          meaning
    0     none          not a response token (prompt, padding)
    1     boilerplate   before the first error; restated operands, operators, "=", ".", spaces,
                        "\\boxed{", "}" and special tokens: the text the problem determines
    2     step          before the first error and carries a decisive character: a digit of an
                        intermediate result or of the boxed answer (matching the reference)
    3     first_error   the first place the response departs from the reference (the whole wrong
                        number, or the one wrong character)
    4     after_error   everything after the first error

A credit-assignment method (DelTA's token weights; ones for GRPO / DAPO) does well when, in wrong
responses (advantage < 0), the first_error tokens weigh more than the rest, and in right responses
(advantage > 0) the step tokens weigh more than the boilerplate.

    m = credit_metrics(classes, weights, advantages, mask)   # one RL step -> {"credit/...": float}
    run_values = summarize(metrics_rows)                     # the steps of a run -> per-run values

Metric keys (side "pos" = tokens of responses with A > 0, "neg" = A < 0; classes CLASS_NAMES[1:]):

    credit/weight_{cls}_{side}         mean token weight of that class on that side (absent when
                                       the step has no such token)
    credit/tokens_{cls}_{side}         how many such tokens (always present)
    credit/auc_first_error_neg         mean over wrong responses (A < 0) that have a first_error
                                       token and another valid token of the per-response AUC
                                       P(w(first_error token) > w(another token)), ties 1/2
                                       (absent when no response qualifies)
    credit/auc_first_error_neg_responses   how many responses that AUC averaged
    credit/auc_step_pos                likewise over right responses (A > 0): step tokens against
                                       the boilerplate tokens of the same response
    credit/auc_step_pos_responses

Pure numpy, host side; nothing here knows about tokenizers or the task (label_batch takes the
labelling function).
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np

NONE, BOILERPLATE, STEP, FIRST_ERROR, AFTER_ERROR = 0, 1, 2, 3, 4
CLASS_NAMES = ("none", "boilerplate", "step", "first_error", "after_error")
SIDES = ("pos", "neg")
PREFIX = "credit/"

# AUC metric key -> (side, class of the "positive" tokens, classes of the tokens they are ranked
# against (None: every other valid token of the response)).
AUCS = {
    "credit/auc_first_error_neg": ("neg", FIRST_ERROR, None),
    "credit/auc_step_pos": ("pos", STEP, (BOILERPLATE,)),
}


def weight_key(cls: str, side: str) -> str:
    return f"{PREFIX}weight_{cls}_{side}"


def tokens_key(cls: str, side: str) -> str:
    return f"{PREFIX}tokens_{cls}_{side}"


def count_key(auc_key: str) -> str:
    """The key of the number of responses an AUC metric averaged."""
    return f"{auc_key}_responses"


def pairwise_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(x > y) + P(x == y) / 2 for x drawn from `pos` and y from `neg` (all pairs); NaN when
    either is empty. O((n + m) log m) by sorting, no pair matrix."""
    pos = np.asarray(pos, np.float64).reshape(-1)
    neg = np.sort(np.asarray(neg, np.float64).reshape(-1))
    if pos.size == 0 or neg.size == 0:
        return float("nan")
    below = np.searchsorted(neg, pos, side="left")
    at_or_below = np.searchsorted(neg, pos, side="right")
    return float((below.sum() + 0.5 * (at_or_below - below).sum()) / (pos.size * neg.size))


def _sides(advantages: np.ndarray, valid: np.ndarray):
    """Per-token side masks (pos, neg) [N, R] and per-row signs [N] (row sign of a per-token
    advantage: the sign of its sum over the row's valid tokens)."""
    adv = np.asarray(advantages, np.float64)
    if adv.ndim == 1:
        row = adv
        tok = np.broadcast_to(adv[:, None], valid.shape)
    elif adv.shape == valid.shape:
        tok = adv
        row = np.where(valid, adv, 0.0).sum(axis=1)
    else:
        raise ValueError(f"advantages must be [N] or [N, R] = {valid.shape}, got {adv.shape}")
    return {"pos": valid & (tok > 0), "neg": valid & (tok < 0)}, np.sign(row)


def credit_metrics(classes, weights, advantages, mask) -> dict[str, float]:
    """The credit-assignment report of one RL step (module docstring for the keys).

    classes int [N, R] (CLASS_NAMES codes); weights [N, R] (the token weights the loss uses);
    advantages [N] or [N, R]; mask [N, R] (response tokens > 0). Tokens count when the mask is
    set and their class is not `none`.
    """
    classes = np.asarray(classes)
    weights = np.asarray(weights, np.float64)
    mask = np.asarray(mask)
    if not classes.shape == weights.shape == mask.shape or classes.ndim != 2:
        raise ValueError(f"classes {classes.shape}, weights {weights.shape} and mask "
                         f"{mask.shape} must be the same [N, R]")
    valid = (mask > 0) & (classes != NONE)
    sides, row_sign = _sides(advantages, valid)
    out: dict[str, float] = {}
    for side, on_side in sides.items():
        for code, name in enumerate(CLASS_NAMES):
            if code == NONE:
                continue
            sel = on_side & (classes == code)
            n = int(sel.sum())
            out[tokens_key(name, side)] = float(n)
            if n:
                out[weight_key(name, side)] = float(weights[sel].mean())
    for key, (side, cls, against) in AUCS.items():
        want = row_sign > 0 if side == "pos" else row_sign < 0
        is_pos = valid & (classes == cls)
        is_neg = valid & ~is_pos if against is None else valid & np.isin(classes, against)
        rows = np.flatnonzero(want & is_pos.any(axis=1) & is_neg.any(axis=1))
        aucs = [pairwise_auc(weights[i][is_pos[i]], weights[i][is_neg[i]]) for i in rows]
        out[count_key(key)] = float(len(aucs))
        if aucs:
            out[key] = float(np.mean(aucs))
    return out


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def summarize(rows: Sequence[Mapping]) -> dict[str, float]:
    """Per-run values from a run's metrics rows (dicts, e.g. metrics.jsonl lines; rows without
    credit/* keys are skipped): tokens_* summed, weight_* averaged weighted by their token counts,
    the AUCs averaged weighted by their response counts (and the counts summed). A value with no
    tokens / responses behind it is absent, as in credit_metrics."""
    out: dict[str, float] = {}
    for side in SIDES:
        for name in CLASS_NAMES[1:]:
            wk, tk = weight_key(name, side), tokens_key(name, side)
            total = weighted = 0.0
            seen = False
            for row in rows:
                n = row.get(tk)
                if not _finite(n):
                    continue
                seen = True
                n = float(n)
                total += n
                if n > 0 and _finite(row.get(wk)):
                    weighted += n * float(row[wk])
            if seen:
                out[tk] = total
                if total > 0:
                    out[wk] = weighted / total
    for key in AUCS:
        ck = count_key(key)
        total = weighted = 0.0
        seen = False
        for row in rows:
            n = row.get(ck)
            if not _finite(n):
                continue
            seen = True
            n = float(n)
            if n > 0 and _finite(row.get(key)):
                total += n
                weighted += n * float(row[key])
        if seen:
            out[ck] = total
            if total > 0:
                out[key] = weighted / total
    return out


def label_batch(solutions: Sequence[str], token_ids, mask,
                decode_token: Callable[[int], str],
                classify: Callable[[str, Sequence[str]], np.ndarray]) -> np.ndarray:
    """Classes int8 [N, R] of packed response rows: row i's valid tokens (mask > 0, in order),
    decoded one by one with decode_token (memoised per id), are labelled by
    classify(solutions[i], pieces) (e.g. data.synthetic.token_classes); `none` elsewhere."""
    token_ids = np.asarray(token_ids)
    mask = np.asarray(mask)
    if token_ids.shape != mask.shape or token_ids.ndim != 2:
        raise ValueError(f"token_ids {token_ids.shape} and mask {mask.shape} must be [N, R]")
    if len(solutions) != token_ids.shape[0]:
        raise ValueError(f"{len(solutions)} solutions for {token_ids.shape[0]} rows")
    out = np.zeros(token_ids.shape, np.int8)
    pieces_of: dict[int, str] = {}
    for i, solution in enumerate(solutions):
        cols = np.flatnonzero(mask[i] > 0)
        if cols.size == 0:
            continue
        pieces = []
        for t in token_ids[i, cols].tolist():
            if t not in pieces_of:
                pieces_of[t] = decode_token(t)
            pieces.append(pieces_of[t])
        out[i, cols] = np.asarray(classify(solution, pieces), np.int8)
    return out
