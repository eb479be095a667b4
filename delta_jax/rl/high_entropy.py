"""The high-entropy minority of a batch's tokens (Wang et al. 2025, "Beyond the 80/20 Rule:
High-Entropy Minority Tokens Drive Effective Reinforcement Learning for LLM Reasoning",
https://arxiv.org/abs/2506.01939): the policy gradient only through the tokens whose entropy
is in the top `top_frac` of the batch's response tokens (the paper's 20%), the "forking" tokens
where the reasoning branches; the others leave the loss. Config rl.entropy_top_frac (0 = off);
another token-level answer to the credit problem DelTA addresses, here as a baseline beside it.

    keep, threshold = high_entropy_mask(entropy, mask, top_frac)   # fp32 [N, R], scalar

The threshold is the (1 - top_frac) quantile (linear interpolation, as torch.quantile) of the
entropies of the tokens `mask` holds, over the whole batch (every device's rows: the arrays are
global), so the selection does not depend on the device layout; tokens at or above it are kept.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def high_entropy_mask(entropy: jax.Array, mask: jax.Array, top_frac: float
                      ) -> tuple[jax.Array, jax.Array]:
    """(keep fp32 [N, R]: 1 for a token of `mask` whose entropy is at or above the threshold,
    0 elsewhere; the threshold, fp32 scalar). entropy fp32 [N, R]; mask [N, R] (1 = a response
    token in the loss); 0 < top_frac <= 1. A mask without tokens keeps none."""
    if not 0 < top_frac <= 1:
        raise ValueError(f"high_entropy_mask: top_frac must be in (0, 1], got {top_frac}")
    entropy = jnp.asarray(entropy, jnp.float32)
    live = jnp.asarray(mask) > 0
    threshold = jnp.nanquantile(jnp.where(live, entropy, jnp.nan), 1.0 - top_frac)
    keep = live & (entropy >= threshold)
    return keep.astype(jnp.float32), threshold
