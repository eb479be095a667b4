"""DAPO dynamic sampling: keep prompt groups whose rewards differ, refill until the batch is full.

A group whose G samples all got the same reward (all solved or all failed) has zero advantage
under GRPO-style baselines and contributes no gradient; DAPO (Yu et al. 2025, sec. 3.2) drops such
groups and keeps generating until the batch holds `num_groups` groups with signal.

    group_has_signal(rewards [P, G]) -> bool [P]                 pure, jittable
    fill_batch_with_signal(generate_and_score, prompt_iter, num_groups, ...) -> FilledBatch
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from typing import Any, Callable, Iterator, Sequence

import numpy as np

ON_MAX_ROUNDS = ("raise", "pad")  # config rl.dynamic_sampling_on_max_rounds


class BatchNotFilled(RuntimeError):
    """fill_batch_with_signal could not fill the batch with groups that carry reward signal."""


def group_has_signal(rewards, atol: float = 0.0):
    """True for groups whose rewards are not all equal: max - min > atol.

    Args:
      rewards: float [P, G] (NumPy or JAX array; jittable).
      atol: rewards closer than this count as equal (0.0: exact, right for binary rewards).
    Returns:
      bool [P].
    """
    if rewards.ndim != 2:
        raise ValueError(f"group_has_signal: rewards must be [P, G], got shape {rewards.shape}")
    return (rewards.max(axis=-1) - rewards.min(axis=-1)) > atol


@dataclasses.dataclass
class FilledBatch:
    """The kept groups, in the order their prompts came from the iterator.

    prompts: list [N]; groups: list [N] (whatever generate_and_score returned per prompt);
    rewards: float32 [N, G]; stats: dict (see fill_batch_with_signal).
    """
    prompts: list
    groups: list
    rewards: np.ndarray
    stats: dict


def fill_batch_with_signal(
    generate_and_score: Callable[[list], tuple[Sequence[Any], Any]],
    prompt_iter: Iterator,
    num_groups: int,
    prompts_per_round: int | None = None,
    max_rounds: int = 10,
    on_max_rounds: str = "raise",
    atol: float = 0.0,
) -> FilledBatch:
    """Generates rounds of prompt groups, drops groups without reward signal, until full.

    Args:
      generate_and_score: prompts (list, length P) -> (groups: sequence of length P, one entry per
        prompt, e.g. its G responses; rewards: float [P, G]).
      prompt_iter: iterator of prompts (any objects; e.g. data rows).
      num_groups: groups wanted in the batch (exactly this many are returned).
      prompts_per_round: prompts drawn per generation round (DAPO's gen batch size);
        default num_groups.
      max_rounds: cap on generation rounds.
      on_max_rounds: what to do when max_rounds rounds (or the prompt iterator) run out first:
        "raise" a BatchNotFilled (a RuntimeError); "pad": warn and fill the batch with the
        latest dropped (zero-signal) groups, which carry zero GRPO advantage, so the batch keeps
        its fixed shape (a BatchNotFilled still when too few groups were dropped to pad with:
        the prompt iterator ran out).
      atol: reward spread at or below which a group counts as having no signal.
    Returns:
      FilledBatch. stats: rounds, prompts_generated, groups_kept, groups_dropped (no signal),
      groups_surplus (had signal but the batch was already full), groups_padded,
      dropped_mean_reward (mean reward of dropped groups: for 0/1 rewards, the fraction of them
      that were all-correct), keep_rate (groups with signal / groups generated),
      prompts_exhausted.
    """
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    if on_max_rounds not in ON_MAX_ROUNDS:
        raise ValueError(f"on_max_rounds must be one of {ON_MAX_ROUNDS}, got {on_max_rounds!r}")
    per_round = prompts_per_round or num_groups
    prompt_iter = iter(prompt_iter)

    kept_prompts, kept_groups, kept_rewards = [], [], []
    dropped: list[tuple[Any, Any, np.ndarray]] = []  # only the latest num_groups are kept
    n_dropped = n_surplus = n_generated = rounds = 0
    dropped_reward_sum = 0.0
    exhausted = False
    group_size = None

    while len(kept_prompts) < num_groups and rounds < max_rounds:
        prompts = list(itertools.islice(prompt_iter, per_round))
        if not prompts:
            exhausted = True
            break
        rounds += 1
        groups, rewards = generate_and_score(prompts)
        rewards = np.asarray(rewards, np.float32)
        if rewards.ndim != 2 or rewards.shape[0] != len(prompts):
            raise ValueError(f"generate_and_score returned rewards of shape {rewards.shape} for "
                             f"{len(prompts)} prompts; want [{len(prompts)}, G]")
        if len(groups) != len(prompts):
            raise ValueError(f"generate_and_score returned {len(groups)} groups for "
                             f"{len(prompts)} prompts")
        if group_size is not None and rewards.shape[1] != group_size:
            raise ValueError(f"group size changed between rounds: {group_size} -> "
                             f"{rewards.shape[1]}")
        group_size = rewards.shape[1]
        n_generated += len(prompts)
        signal = group_has_signal(rewards, atol)
        for prompt, group, r, ok in zip(prompts, groups, rewards, signal):
            if not ok:
                n_dropped += 1
                dropped_reward_sum += float(r.mean())
                dropped.append((prompt, group, r))
                del dropped[:-num_groups]
            elif len(kept_prompts) < num_groups:
                kept_prompts.append(prompt)
                kept_groups.append(group)
                kept_rewards.append(r)
            else:
                n_surplus += 1

    missing = num_groups - len(kept_prompts)
    n_padded = 0
    if missing > 0:
        why = ("the prompt iterator ran out" if exhausted
               else f"max_rounds={max_rounds} generation rounds were used")
        msg = (f"dynamic sampling: only {len(kept_prompts)} of {num_groups} groups with reward "
               f"signal after {rounds} rounds ({n_generated} prompts, {n_dropped} groups dropped "
               f"for equal rewards): {why}. Raise max_rounds / prompts_per_round, or check the "
               f"rewards (all groups solved or all failed?).")
        if on_max_rounds == "raise":
            raise BatchNotFilled(msg)
        if len(dropped) < missing:
            raise BatchNotFilled(f"{msg} Too few groups were dropped ({len(dropped)}) to pad "
                                 f"the batch with.")
        for prompt, group, r in dropped[-missing:]:
            kept_prompts.append(prompt)
            kept_groups.append(group)
            kept_rewards.append(r)
        n_padded = missing
        warnings.warn(f"{msg} Padded with {missing} zero-signal groups.", RuntimeWarning,
                      stacklevel=2)

    stats = {
        "rounds": rounds,
        "prompts_generated": n_generated,
        "groups_kept": len(kept_prompts) - n_padded,
        "groups_dropped": n_dropped,
        "groups_surplus": n_surplus,
        "groups_padded": n_padded,
        "dropped_mean_reward": dropped_reward_sum / n_dropped if n_dropped else 0.0,
        "keep_rate": (n_generated - n_dropped) / n_generated if n_generated else 0.0,
        "prompts_exhausted": exhausted,
    }
    return FilledBatch(kept_prompts, kept_groups, np.stack(kept_rewards).astype(np.float32),
                       stats)
