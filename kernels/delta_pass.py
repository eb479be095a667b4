"""Fused DelTA pass over cached features: one read of h per refinement round.

DELTA_SPEC.md sections 2.0-2.7. For every token of a (flattened) batch of cached features

    v = (1 - p) h                                  (last-layer proxy, fp32)
    s = v . W + b,  W = mu+ - mu-,  b = -(|mu+|^2 - |mu-|^2) / 2   (discriminator score;
                                                   b is formed as -W . (mu+ + mu-) / 2)
    Delta = 2 sign(a) s                            (margin; sign(a) picks the side)
    alpha = sigmoid(Delta / gamma_side)            (or 1 when use_alpha=False)

and the pass returns, per side (row 0 = P: a > 0, row 1 = N: a < 0; only tokens with mask > 0):

    centroid_sum  [2, H]  sum |a| alpha v        -> next centroids (divide by weight_sum)
    weight_sum    [2]     sum |a| alpha
    count         [2]     number of tokens
    margin_mean   [2]     mean of Delta over the side's tokens (unweighted)
    margin_m2     [2]     sum of squared deviations of Delta from that mean (Var = m2 / count)
    correct       [2]     tokens with sign(a) s > 0 (discriminator accuracy, a diagnostic)
    lam_sum       []      sum of lambda over all valid tokens (Z included; 0 unless lam_range)
    num_valid     []      number of valid tokens (Z included)
    lam           [...]   optional per-token lambda = lam_min + (lam_max - lam_min) alpha on P/N,
                          lam_min on Z (a == 0), 0 on padding; shape of h without the last axis.

Results of several chunks / devices combine with `add_sums` (plain sums, and Chan et al.'s
pairwise merge of the margin moments, which avoids the fp32 cancellation of raw sums of squares).
The fields map one-to-one onto delta_jax.rl.delta.PassStats: (weighted_sum, weight_total,
margin_count, margin_mean, margin_m2) = (centroid_sum, weight_sum, count, margin_mean,
margin_m2). The initial centroids (2.2) are this pass with use_alpha=False (weights |a|;
mu_pos/mu_neg then only feed the unused margins).

`delta_pass` is plain jnp that XLA compiles on every backend. A Pallas (Triton) version with a
persistent grid lived here until 2026-11-23; it was retired (issue #16): on an H100 (1M tokens x
4096, bf16) it read h at 962 GB/s in a refinement pass against XLA's 883 GB/s (+9%), but the
final-lambda pass ran at 88% of copy bandwidth against XLA's 102%, the whole DelTA phase was
0.018 s of an 11.2 s DAPO step (0.17%), and the Triton backend of Pallas is deprecated in jax 0.11.
See BENCHMARKS.md, "Kernel decisions".

Padding rows (mask == 0) may hold anything, NaN included: they never reach a sum.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST


class DeltaPassSums(NamedTuple):
    """Additive statistics of one DelTA pass (see the module docstring). fp32 throughout."""

    centroid_sum: jax.Array
    weight_sum: jax.Array
    count: jax.Array
    margin_mean: jax.Array
    margin_m2: jax.Array
    correct: jax.Array
    lam_sum: jax.Array
    num_valid: jax.Array
    lam: jax.Array | None = None


# ----------------------------------------------------------------------------- shared helpers


def _check_and_flatten(h, p, a, mask, mu_pos, mu_neg):
    """Validates shapes; returns h [N, H], p/a/mask [N] fp32, the leading shape, W [H], b []."""
    if h.ndim < 2:
        raise ValueError(f"delta_pass: h must be [..., H], got shape {h.shape}")
    lead, hidden = h.shape[:-1], h.shape[-1]
    for name, x in (("p", p), ("a", a), ("mask", mask)):
        if x.shape != lead:
            raise ValueError(f"delta_pass: {name} has shape {x.shape}, expected {lead} (h is {h.shape})")
    for name, x in (("mu_pos", mu_pos), ("mu_neg", mu_neg)):
        if x.shape != (hidden,):
            raise ValueError(f"delta_pass: {name} has shape {x.shape}, expected ({hidden},)")
    if not jnp.issubdtype(h.dtype, jnp.floating):
        raise ValueError(f"delta_pass: h must be floating point, got {h.dtype}")
    n = 1
    for d in lead:
        n *= d
    mu_pos = mu_pos.astype(jnp.float32)
    mu_neg = mu_neg.astype(jnp.float32)
    w = mu_pos - mu_neg
    # |mu+|^2 - |mu-|^2 = (mu+ - mu-) . (mu+ + mu-): no difference of large squared norms (which
    # loses O(|mu|^2 * eps) in fp32), the same form as delta_jax.rl.delta._scores.
    b = -0.5 * jnp.dot(w, mu_pos + mu_neg, precision=_HIGHEST)
    return (
        h.reshape(n, hidden),
        p.reshape(n).astype(jnp.float32),
        a.reshape(n).astype(jnp.float32),
        mask.reshape(n).astype(jnp.float32),
        lead,
        w,
        b,
    )


# (count, mean, m2) moments: the one implementation of the DelTA statistics' exact moments, used
# by the pass, for the per-chunk and per-device combination, and by delta_jax.rl.delta. Never raw
# sums of squares.


def masked_moments(x, mask, axis):
    """Exact (count, mean, m2) of the values of `x` selected by the 0/1 float `mask` (broadcast
    against x), reduced over `axis` (an int or a tuple); m2 is the sum of squared deviations."""
    count = jnp.sum(mask, axis)
    mean = jnp.sum(mask * x, axis) / jnp.maximum(count, 1.0)
    centred = x - (jnp.expand_dims(mean, axis) if jnp.ndim(mean) else mean)
    return count, mean, jnp.sum(mask * centred * centred, axis)


def merge_moments(count_a, mean_a, m2_a, count_b, mean_b, m2_b):
    """Chan et al.'s pairwise merge of (count, mean, m2) moments (any matching shapes)."""
    count = count_a + count_b
    delta = mean_b - mean_a
    frac = count_b / jnp.maximum(count, 1.0)
    return count, mean_a + delta * frac, m2_a + m2_b + delta * delta * count_a * frac


def add_sums(x: DeltaPassSums, y: DeltaPassSums) -> DeltaPassSums:
    """Statistics of two chunks of tokens together (the per-token `lam` is dropped)."""
    count, mean, m2 = merge_moments(x.count, x.margin_mean, x.margin_m2,
                                    y.count, y.margin_mean, y.margin_m2)
    return DeltaPassSums(
        centroid_sum=x.centroid_sum + y.centroid_sum, weight_sum=x.weight_sum + y.weight_sum,
        count=count, margin_mean=mean, margin_m2=m2, correct=x.correct + y.correct,
        lam_sum=x.lam_sum + y.lam_sum, num_valid=x.num_valid + y.num_valid, lam=None)


# ----------------------------------------------------------------------------- the pass


def delta_pass(h, p, a, mask, mu_pos, mu_neg, gamma_pos, gamma_neg, use_alpha=True, *,
               lam_range=None, with_centroids=True) -> DeltaPassSums:
    """The DelTA pass (plain jnp). h [..., H] (bf16/fp32), p/a/mask [...], mu_* [H], gamma_*
    scalars.

    lam_range=(lam_min, lam_max) also returns the per-token lambda and its sum; with_centroids=False
    skips the [2, H] weighted sums (returned as zeros), e.g. for a margins-only pass.
    """
    h2, p, a, mask, lead, w, b = _check_and_flatten(h, p, a, mask, mu_pos, mu_neg)
    valid = mask > 0
    pos = valid & (a > 0)
    neg = valid & (a < 0)
    side = pos | neg
    # Padding rows may hold garbage (NaN): zero them before they meet a dot product.
    hz = jnp.where(valid[:, None], h2, jnp.zeros((), h2.dtype))
    one_minus_p = jnp.where(valid, 1.0 - p, 0.0)
    # s = (1 - p) (h . W) + b: one fp32 dot per token, v never materialised.
    hw = jnp.einsum("nh,h->n", hz, w, precision=_HIGHEST, preferred_element_type=jnp.float32)
    s = one_minus_p * hw + b
    sign = pos.astype(jnp.float32) - neg.astype(jnp.float32)
    margin = jnp.where(side, 2.0 * sign * s, 0.0)
    if use_alpha:
        gamma = jnp.where(pos, jnp.asarray(gamma_pos, jnp.float32), jnp.asarray(gamma_neg, jnp.float32))
        alpha = jax.nn.sigmoid(margin / gamma)
    else:
        alpha = jnp.ones_like(margin)
    weight = jnp.where(side, jnp.abs(a) * alpha, 0.0)
    side_masks = jnp.stack([pos, neg]).astype(jnp.float32)  # [2, N]
    if with_centroids:
        # sum |a| alpha v = sum (|a| alpha (1 - p)) h: fold (1 - p) into the weights.
        coeff = side_masks * (weight * one_minus_p)[None, :]
        centroid_sum = jnp.einsum("sn,nh->sh", coeff, hz, precision=_HIGHEST,
                                  preferred_element_type=jnp.float32)
    else:
        centroid_sum = jnp.zeros((2, h2.shape[1]), jnp.float32)
    correct = jnp.stack([pos & (s > 0), neg & (s < 0)]).astype(jnp.float32)
    lam, lam_sum = None, jnp.zeros((), jnp.float32)
    if lam_range is not None:
        lam_min, lam_max = (jnp.asarray(x, jnp.float32) for x in lam_range)
        lam = jnp.where(side, lam_min + (lam_max - lam_min) * alpha, jnp.where(valid, lam_min, 0.0))
        lam_sum = jnp.sum(lam)
        lam = lam.reshape(lead)
    count, margin_mean, margin_m2 = masked_moments(margin[None, :], side_masks, axis=1)
    return DeltaPassSums(
        centroid_sum=centroid_sum,
        weight_sum=side_masks @ weight,
        count=count,
        margin_mean=margin_mean,
        margin_m2=margin_m2,
        correct=jnp.sum(correct, axis=1),
        lam_sum=lam_sum,
        num_valid=jnp.sum(valid.astype(jnp.float32)),
        lam=lam,
    )
