"""The sampler-vs-trainer log-prob mismatch: its diagnostics and an optional importance-sampling
correction of the policy loss.

    weights, metrics = rollout_is_weights(old_logp, rollout_logp, mask, mode="tis", cap=2.0)

Response tokens are drawn by the rollout engine (paged decode attention, one token at a time),
and the PPO surrogate takes them as samples of pi_old, whose log-probs the old-policy pass
recomputes (a full-sequence forward: other kernels, another summation order). In fp32 on a CPU
the two agree to ~1e-6; in bf16 on accelerators they differ per token, and more when the sampler
runs weights older than the trainer's. Yao et al. 2025 ("Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl) correct the
gradient with the per-token ratio r = pi_old(y) / pi_rollout(y), truncated (TIS); TRL's
GRPOTrainer (vllm_importance_sampling_correction, cap 2) and verl (rollout importance sampling,
token level, "truncate" / "mask") do the same.

Per valid token, with d = old_logp - rollout_logp and r = exp(d):
* mode "none": weight 1 (the mask): the surrogate as the paper trains it (the default).
* mode "tis": weight min(r, cap) (truncated importance sampling).
* mode "mis": weight r where r <= cap, else 0 (masked importance sampling: tokens whose ratio is
  beyond the cap are dropped from the gradient, not down-weighted).
The weights are constants of the loss (they multiply the per-token surrogate like DelTA's
weights, rl/losses.policy_loss's token_weights); padding gets 0.

Metrics (any mode; means over valid tokens): rollout/is_ratio_mean (mean r),
rollout/is_beyond_cap_fraction (share of tokens with r > cap), rollout/mismatch_k3 (the k3
estimate of KL(pi_rollout || pi_old) from the rollout's own samples: mean of r - 1 - log r, >= 0,
0 when the two agree), rollout/sampler_logp_abs_diff_mean and _max (|d|).

rollout_logp must be the log-prob under the same distribution the old-policy pass computes:
softmax(z / T) unfiltered (the sampler's tempered_logprobs), so with top-p / top-k < full
sampling r compares the unfiltered distributions (as TRL and verl do with vLLM's raw log-probs).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MODES = ("none", "tis", "mis")
# |d| above this is clamped before exp (a token the sampler found ~e^-20 less likely than the
# trainer does is beyond any cap anyway; keeps r finite in fp32).
_LOG_RATIO_CLAMP = 20.0


def rollout_is_weights(old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, *,
                       mode: str = "none", cap: float = 2.0):
    """old_logp, rollout_logp, mask [N, R] (mask 1 on valid response tokens) -> (weights fp32
    [N, R], metrics dict of fp32 scalars); see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"rollout importance sampling mode must be one of {MODES}, got {mode!r}")
    if not cap >= 1.0:
        raise ValueError(f"the importance-sampling cap must be >= 1, got {cap}")
    shapes = {"old_logp": old_logp.shape, "rollout_logp": rollout_logp.shape, "mask": mask.shape}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"old_logp, rollout_logp and mask must have one shape, got {shapes}")
    mask = mask.astype(jnp.float32)
    valid = mask > 0
    raw = jnp.where(valid, old_logp.astype(jnp.float32) - rollout_logp.astype(jnp.float32), 0.0)
    d = jnp.clip(raw, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    r = jnp.exp(d)
    beyond = valid & (d > math.log(cap))
    if mode == "tis":
        weights = jnp.minimum(r, cap) * mask
    elif mode == "mis":
        weights = jnp.where(beyond, 0.0, r) * mask
    else:
        weights = mask
    count = jnp.maximum(jnp.sum(mask), 1.0)
    metrics = {
        "rollout/is_ratio_mean": jnp.sum(r * mask) / count,
        "rollout/is_beyond_cap_fraction": jnp.sum(beyond.astype(jnp.float32)) / count,
        # r - 1 - d >= 0 per token; expm1 and the floor keep fp32 rounding from going negative
        "rollout/mismatch_k3": jnp.sum(jnp.maximum(jnp.expm1(d) - d, 0.0) * mask) / count,
        "rollout/sampler_logp_abs_diff_mean": jnp.sum(jnp.abs(raw) * mask) / count,
        "rollout/sampler_logp_abs_diff_max": jnp.max(jnp.abs(raw) * mask),
    }
    return jax.lax.stop_gradient(weights), metrics
