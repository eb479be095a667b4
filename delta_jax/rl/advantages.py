"""Outcome-reward advantage estimators for group-sampled rollouts (one scalar per sequence).

Every estimator compares a sequence's reward with the other responses to the same prompt (its
group). Groups are contiguous blocks of `group_size` sequences (the layout the sampler produces:
prompt i's n samples at rows i*n .. i*n+n-1).

* grpo:   A_i = (R_i - mean_g R) / (std_g R + eps), std with ddof=1.
          GRPO, Shao et al. 2024, "DeepSeekMath", https://arxiv.org/abs/2402.03300.
* drgrpo: A_i = R_i - mean_g R (no std normalisation, which biases towards easy/hard prompts).
          Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training",
          https://arxiv.org/abs/2503.20783.
* rloo:   A_i = R_i - mean_{j in g, j != i} R_j = n/(n-1) (R_i - mean_g R) (leave-one-out baseline).
          RLOO, Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization",
          https://arxiv.org/abs/2402.14740 (after Kool et al. 2019).
* batch_std: A_i = (R_i - mean_g R) / (std_batch R + eps): the group's mean as the baseline, the
          standard deviation of every reward of the batch (ddof=1) as the scale, so a prompt whose
          group nearly agrees is not blown up by its own small std. "Group-level mean,
          batch-level std" of Lite PPO, Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for
          LLM Reasoning", https://arxiv.org/abs/2508.08221; REINFORCE++-baseline, Hu et al. 2025,
          https://arxiv.org/abs/2501.03262; TRL's scale_rewards="batch".

A group of a single sequence has no baseline: its advantage is 0 for every estimator (documented
choice; verl instead uses mean 0 / std 1 there). A group with identical rewards gets 0
(grpo: 0 / eps).
All outputs are fp32 [N] and every function is jittable (shapes and group_size are static).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class GroupStats(NamedTuple):
    """Per-sequence statistics of its group, each fp32 [N]."""
    mean: Array
    std: Array  # ddof=1; 0 for a group of one
    count: Array


def group_stats(rewards: Array, *, group_size: int) -> GroupStats:
    """Mean, ddof=1 std and size of each sequence's group, broadcast back to the sequences.

    rewards [N]; groups are contiguous blocks of group_size (>= 1, dividing N).
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"advantages: rewards must be 1-D [N], got shape {rewards.shape}")
    n = rewards.shape[0]
    if group_size < 1 or n % group_size:
        raise ValueError(f"advantages: group_size={group_size} must be >= 1 and divide the "
                         f"number of rewards {n}")
    grouped = rewards.reshape(n // group_size, group_size)
    mean = grouped.mean(axis=1, keepdims=True)
    # Two-pass form (deviations from the group mean), no E[R^2] - E[R]^2 cancellation.
    sq_dev = jnp.square(grouped - mean).sum(axis=1, keepdims=True)
    std = jnp.sqrt(sq_dev / max(group_size - 1, 1)) * (group_size > 1)
    count = jnp.full_like(grouped, float(group_size))
    return GroupStats(jnp.broadcast_to(mean, grouped.shape).reshape(n),
                      jnp.broadcast_to(std, grouped.shape).reshape(n), count.reshape(n))


def grpo_advantages(rewards: Array, stats: GroupStats, eps: float = 1e-6) -> Array:
    """GRPO: (R - mean) / (std_ddof1 + eps) (https://arxiv.org/abs/2402.03300)."""
    adv = (rewards - stats.mean) / (stats.std + eps)
    return jnp.where(stats.count > 1, adv, 0.0)


def drgrpo_advantages(rewards: Array, stats: GroupStats, eps: float = 1e-6) -> Array:
    """Dr. GRPO: R - mean, no std division (https://arxiv.org/abs/2503.20783). eps unused."""
    del eps
    return jnp.where(stats.count > 1, rewards - stats.mean, 0.0)


def rloo_advantages(rewards: Array, stats: GroupStats, eps: float = 1e-6) -> Array:
    """RLOO: R_i - mean of the other rewards of the group (https://arxiv.org/abs/2402.14740)."""
    del eps
    scale = stats.count / jnp.maximum(stats.count - 1, 1.0)
    return jnp.where(stats.count > 1, scale * (rewards - stats.mean), 0.0)


def batch_std_advantages(rewards: Array, stats: GroupStats, eps: float = 1e-6) -> Array:
    """(R - group mean) / (std of the batch's rewards, ddof=1, + eps)
    (https://arxiv.org/abs/2508.08221, https://arxiv.org/abs/2501.03262)."""
    batch_std = group_stats(rewards, group_size=rewards.shape[0]).std  # one group: the batch
    return jnp.where(stats.count > 1, (rewards - stats.mean) / (batch_std + eps), 0.0)


AdvantageFn = Callable[[Array, GroupStats, float], Array]
ADVANTAGE_FNS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "batch_std": batch_std_advantages,
}


def compute_advantages(rewards: Array, *, group_size: int, method: str = "grpo",
                       eps: float = 1e-6) -> Array:
    """Per-sequence advantages fp32 [N] from rewards [N] in contiguous groups of group_size
    with the estimator `method` (a key of ADVANTAGE_FNS: "grpo", "drgrpo", "rloo", "batch_std").
    Broadcast to tokens with adv[:, None] * mask.
    """
    if method not in ADVANTAGE_FNS:
        raise ValueError(f"advantages: unknown method {method!r}; choose one of "
                         f"{sorted(ADVANTAGE_FNS)}")
    rewards = jnp.asarray(rewards, jnp.float32)
    stats = group_stats(rewards, group_size=group_size)
    return ADVANTAGE_FNS[method](rewards, stats, eps)
