"""What the policy wrote, on disk, one JSON line a response (TRL's logged completions, verl's
rollout and validation data dumps):

    workdir/rollouts/step_<N>.jsonl           train.rollouts_every: RL step N's batch as trained
    workdir/eval/<stem>_responses.jsonl       eval.save_responses: every eval sample

A rollout row: step, row (prompt-major, row = group * G + sample), group, sample, id (the data
record's, or null), prompt (text), answer (the reference), response (text, stop token dropped),
reward (shaped: what the advantages used), correct (unshaped 0/1), advantage, response_tokens,
truncated (cut at rollout.max_new_tokens), in_loss (false for a truncated response under
rl.mask_truncated, or one without response tokens) and token_weight_mean (the mean over its
tokens of the weight the loss gave them: DelTA's coefficient for method delta, times the
rollout-correction weight with rl.rollout_is; 1 for grpo / dapo; null when not in the loss);
with several rewards.python_fn functions reward_fns ({function name: its own reward}, TRL's
per-function columns); with train.rollouts_token_weights also token_ids (the stop token
included) and token_weights (that weight token by token, 0 outside the loss).

An eval row: benchmark, id, sample, prompt, answer, response, correct (and response_tokens,
truncated where the generate_fn reported them, as the sampler's does).

Files are written whole (delta_jax.files), by process 0; a resumed run that redoes a step
rewrites its file.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping, Sequence

import jax
import numpy as np

from delta_jax import files

log = logging.getLogger("delta_jax.train")

ROLLOUTS_DIR = "rollouts"


def rollout_rows(step: int, records: Sequence[dict], texts: Sequence[Sequence[str]],
                 rewards, correct, advantages, response_lengths, truncated, loss_mask,
                 token_weights, response_ids: Sequence[Sequence[Sequence[int]]] | None = None,
                 reward_fns: Mapping[str, Sequence[float]] | None = None) -> list[dict]:
    """The rows of one RL step's batch (see the module docstring), prompt-major.

    records: the P prompt records ("prompt", "answer", optionally "id"); texts[i][j] the
    responses; rewards, correct, advantages, response_lengths, truncated: [P * G];
    loss_mask, token_weights: [P * G, R] host arrays (the response tokens the loss takes and the
    weight it gives each). response_ids[i][j] (optional): the responses' token ids; given, each
    row also holds them ("token_ids") and the loss's weight of each ("token_weights", rounded
    to 4 decimals, 0 outside the loss). reward_fns (optional): each reward function's own
    rewards {name: [P * G]} (several rewards.python_fn functions); given, each row holds its
    {name: reward} ("reward_fns")."""
    G = len(texts[0]) if texts else 0
    mask = np.asarray(loss_mask, np.float64)
    counted = mask.sum(axis=1)
    weight_sum = (np.asarray(token_weights, np.float64) * mask).sum(axis=1)
    rows = []
    for i, record in enumerate(records):
        for j, text in enumerate(texts[i]):
            r = i * G + j
            in_loss = bool(counted[r] > 0)
            rows.append({
                "step": int(step), "row": r, "group": i, "sample": j,
                "id": record.get("id"), "prompt": record.get("prompt"),
                "answer": str(record.get("answer")), "response": text,
                "reward": float(rewards[r]), "correct": float(correct[r]),
                "advantage": float(advantages[r]),
                "response_tokens": int(response_lengths[r]), "truncated": bool(truncated[r]),
                "in_loss": in_loss,
                "token_weight_mean": float(weight_sum[r] / counted[r]) if in_loss else None,
            })
            if reward_fns:
                rows[-1]["reward_fns"] = {name: float(v[r]) for name, v in reward_fns.items()}
            if response_ids is not None:
                ids = [int(t) for t in response_ids[i][j]]
                w = np.asarray(token_weights[r, :len(ids)], np.float64) * mask[r, :len(ids)]
                rows[-1].update(token_ids=ids, token_weights=[round(float(x), 4) for x in w])
    return rows


def rollouts_due(cfg, step: int) -> bool:
    every = cfg.train.rollouts_every
    return bool(every) and step % every == 0


def write_rollouts(run, step: int, out) -> str | None:
    """A step hook of loop.train: RL step `step`'s batch to workdir/rollouts/step_<step>.jsonl
    when train.rollouts_every says so; returns the path (None when not due, and on processes
    other than 0). Collective when due: every process fetches the token weights."""
    from delta_jax.sampling.output import fetch_global

    if not rollouts_due(run.cfg, step):
        return None
    prep = out.prepared
    rb, roll = prep.packed, prep.rollout
    weights = np.asarray(fetch_global(prep.batch["token_weights"]), np.float32)
    if jax.process_index() != 0:
        return None
    rows = rollout_rows(step, roll.records, roll.samples.texts, rb.rewards, roll.accuracy,
                        rb.advantages, rb.response_lengths, rb.truncated,
                        prep.loss_mask, weights,
                        roll.samples.response_ids if run.cfg.train.rollouts_token_weights
                        else None, reward_fns=roll.reward_fns)
    path = files.write_jsonl(os.path.join(run.workdir, ROLLOUTS_DIR, f"step_{step}.jsonl"), rows)
    log.debug("step %d: %d responses written to %s", step, len(rows), path)
    return path


def eval_rows(result) -> list[dict]:
    """The rows of an evaluation.EvalResult made by evaluation.evaluate (see the module
    docstring), benchmark by benchmark, question-major."""
    rows = []
    for name, b in result.benchmarks.items():
        if b.responses is None:
            raise ValueError(f"benchmark {name!r}: the result holds no responses (not made by "
                             "evaluation.evaluate)")
        for q, qid in enumerate(b.ids):
            for j, text in enumerate(b.responses[q]):
                row = {"benchmark": name, "id": qid, "sample": j, "prompt": b.prompts[q],
                       "answer": str(b.answers[q]), "response": text,
                       "correct": float(b.correct[q, j])}
                if b.votes is not None:  # maj@k: the answer it voted for (None: none)
                    row["vote"] = b.votes[q][j]
                if b.response_tokens is not None:
                    row.update(response_tokens=int(b.response_tokens[q, j]),
                               truncated=bool(b.truncated[q, j]))
                rows.append(row)
    return rows


def write_eval_responses(workdir: str, stem: str, result) -> str:
    """eval_rows(result) to workdir/eval/<stem>_responses.jsonl; returns the path."""
    return files.write_jsonl(os.path.join(workdir, "eval", f"{stem}_responses.jsonl"),
                             eval_rows(result))
