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
margin_count, margin_mean, margin_m2) = (centroid_sum, weight_sum, count, margin_mean, margin_m2). The initial centroids (2.2) are this pass with
use_alpha=False (weights |a|; mu_pos/mu_neg then only feed the unused margins).

`delta_pass_reference` is plain jnp; `delta_pass` is a Pallas (Triton backend) kernel with a
persistent grid: each program walks a strided set of token tiles, computes the scores of a tile
from H-blocks of h, then re-reads the same tile (now in L1/L2) to accumulate its weighted sums into
a private [2, H] fp32 row of a partial-sum output; a tiny jnp sum over programs finishes the job
(deterministic, no atomics). `delta_pass_auto` picks one (see kernels/backend.py).
Padding rows (mask == 0) may hold anything, NaN included: they never reach a sum.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from delta_jax.kernels import backend

_HIGHEST = lax.Precision.HIGHEST
_NUM_STATS = 16  # per-program scalar slots (12 used), a power of two for Triton


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
# by the jnp reference, inside the Pallas kernel (pure jnp on the tile's values), for the
# per-program and per-device combination, and by delta_jax.rl.delta. Never raw sums of squares.


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


def reduce_moments(count, mean, m2, axis=0):
    """Merges the moments along `axis` (static size) by a balanced tree of `merge_moments`;
    returns (count, mean, m2) without that axis. An empty part (count 0) merges as identity."""
    parts = [jnp.moveaxis(x, axis, 0) for x in (count, mean, m2)]
    while parts[0].shape[0] > 1:
        if parts[0].shape[0] % 2:
            parts = [jnp.concatenate([x, jnp.zeros_like(x[:1])]) for x in parts]
        half = parts[0].shape[0] // 2
        parts = list(merge_moments(*(x[:half] for x in parts), *(x[half:] for x in parts)))
    return tuple(x[0] for x in parts)


def add_sums(x: DeltaPassSums, y: DeltaPassSums) -> DeltaPassSums:
    """Statistics of two chunks of tokens together (the per-token `lam` is dropped)."""
    count, mean, m2 = merge_moments(x.count, x.margin_mean, x.margin_m2,
                                    y.count, y.margin_mean, y.margin_m2)
    return DeltaPassSums(
        centroid_sum=x.centroid_sum + y.centroid_sum, weight_sum=x.weight_sum + y.weight_sum,
        count=count, margin_mean=mean, margin_m2=m2, correct=x.correct + y.correct,
        lam_sum=x.lam_sum + y.lam_sum, num_valid=x.num_valid + y.num_valid, lam=None)


def centroids_from_sums(sums: DeltaPassSums, eps: float = 1e-8) -> tuple[jax.Array, jax.Array]:
    """(mu_pos, mu_neg) [H] = centroid_sum / max(weight_sum, eps) per side (spec 2.2 / 2.5)."""
    mu = sums.centroid_sum / jnp.maximum(sums.weight_sum, eps)[:, None]
    return mu[0], mu[1]


def margin_std_from_sums(sums: DeltaPassSums, var_floor: float = 1e-8) -> tuple[jax.Array, jax.Array]:
    """(gamma_pos, gamma_neg): population std of the margins per side, count clamped >= 1 (2.4)."""
    var = jnp.maximum(sums.margin_m2 / jnp.maximum(sums.count, 1.0), var_floor)
    gamma = jnp.sqrt(var)
    return gamma[0], gamma[1]


# ----------------------------------------------------------------------------- jnp reference


def delta_pass_reference(h, p, a, mask, mu_pos, mu_neg, gamma_pos, gamma_neg, use_alpha=True, *,
                         lam_range=None, with_centroids=True) -> DeltaPassSums:
    """Plain-jnp DelTA pass. h [..., H] (bf16/fp32), p/a/mask [...], mu_* [H], gamma_* scalars.

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


# ----------------------------------------------------------------------------- Pallas kernel


def _delta_kernel(h_ref, p_ref, a_ref, m_ref, w_ref, prm_ref, *out_refs, n_tokens, hidden,
                  block_tokens, block_hidden, num_programs, tiles_per_program, use_alpha,
                  with_centroids, with_lambda):
    """One program of the persistent grid; see the module docstring for the outputs."""
    out_refs = list(out_refs)
    stats_ref = out_refs.pop(0)
    csum_ref = out_refs.pop(0) if with_centroids else None
    lam_ref = out_refs.pop(0) if with_lambda else None
    bn, bh = block_tokens, block_hidden
    n_hblocks = pl.cdiv(hidden, bh)
    g = pl.program_id(0)
    cols = jnp.arange(bh)
    f32 = jnp.float32
    bias, gamma_pos, gamma_neg = prm_ref[0], prm_ref[1], prm_ref[2]
    lam_min, lam_max = prm_ref[3], prm_ref[4]

    if with_centroids:
        def zero_block(j, carry):
            col_ok = j * bh + cols < hidden
            for side in range(2):
                pltriton.store(csum_ref.at[2 * g + side, pl.ds(j * bh, bh)], jnp.zeros((bh,), f32),
                               mask=col_ok)
            return carry

        lax.fori_loop(0, n_hblocks, zero_block, 0)

    def load_h_block(start, row_ok, j):
        col_ok = j * bh + cols < hidden
        blk = pltriton.load(h_ref.at[pl.ds(start, bn), pl.ds(j * bh, bh)],
                            mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        return blk.astype(f32), col_ok

    def tile_body(i, carry):
        start = (g + i * num_programs) * bn
        rows = start + jnp.arange(bn)
        in_range = rows < n_tokens
        p = pltriton.load(p_ref.at[pl.ds(start, bn)], mask=in_range, other=0.0)
        a = pltriton.load(a_ref.at[pl.ds(start, bn)], mask=in_range, other=0.0)
        m = pltriton.load(m_ref.at[pl.ds(start, bn)], mask=in_range, other=0.0)
        valid = in_range & (m > 0)
        pos = valid & (a > 0)
        neg = valid & (a < 0)
        side = pos | neg

        # Phase 1: h . W over H-blocks (the one read of this tile from device memory).
        def score_block(j, acc):
            blk, col_ok = load_h_block(start, valid, j)
            wj = pltriton.load(w_ref.at[pl.ds(j * bh, bh)], mask=col_ok, other=0.0)
            return acc + jnp.sum(blk * wj[None, :], axis=1)

        hw = lax.fori_loop(0, n_hblocks, score_block, jnp.zeros((bn,), f32))
        one_minus_p = jnp.where(valid, 1.0 - p, 0.0)
        s = one_minus_p * hw + bias
        margin = jnp.where(pos, 2.0 * s, jnp.where(neg, -2.0 * s, 0.0))
        if use_alpha:
            gamma = jnp.where(pos, gamma_pos, gamma_neg)
            alpha = 1.0 / (1.0 + jnp.exp(-(margin / gamma)))
        else:
            alpha = jnp.ones((bn,), f32)
        weight = jnp.where(side, jnp.abs(a) * alpha, 0.0)

        # Phase 2: re-read the tile (cache-hot) and add its weighted sums to this program's rows.
        if with_centroids:
            coeff_pos = jnp.where(pos, weight * one_minus_p, 0.0)
            coeff_neg = jnp.where(neg, weight * one_minus_p, 0.0)

            def accumulate_block(j, c):
                blk, col_ok = load_h_block(start, valid, j)
                for side_idx, coeff in ((0, coeff_pos), (1, coeff_neg)):
                    acc_ref = csum_ref.at[2 * g + side_idx, pl.ds(j * bh, bh)]
                    part = jnp.sum(coeff[:, None] * blk, axis=0)
                    old = pltriton.load(acc_ref, mask=col_ok, other=0.0)
                    pltriton.store(acc_ref, old + part, mask=col_ok)
                return c

            lax.fori_loop(0, n_hblocks, accumulate_block, 0)

        lam = jnp.where(side, lam_min + (lam_max - lam_min) * alpha, jnp.where(valid, lam_min, 0.0))
        if with_lambda:
            pltriton.store(lam_ref.at[pl.ds(start, bn)], lam, mask=in_range)

        (w_p, w_n, n_p, n_n, mean_p, mean_n, m2_p, m2_n, c_p, c_n, lam_total, n_valid) = carry
        # Margin moments: exact (count, mean, m2) of this tile, Chan-merged into the running ones.
        moments = []
        for side_f, n_run, mean_run, m2_run in ((pos.astype(f32), n_p, mean_p, m2_p),
                                                (neg.astype(f32), n_n, mean_n, m2_n)):
            tile = masked_moments(margin, side_f, axis=0)
            moments.append(merge_moments(n_run, mean_run, m2_run, *tile))
        (n_p, mean_p, m2_p), (n_n, mean_n, m2_n) = moments
        return (
            w_p + jnp.sum(jnp.where(pos, weight, 0.0)), w_n + jnp.sum(jnp.where(neg, weight, 0.0)),
            n_p, n_n, mean_p, mean_n, m2_p, m2_n,
            c_p + jnp.sum(jnp.where(pos & (s > 0), 1.0, 0.0)),
            c_n + jnp.sum(jnp.where(neg & (s < 0), 1.0, 0.0)),
            lam_total + jnp.sum(lam), n_valid + jnp.sum(valid.astype(f32)),
        )

    zero = jnp.zeros((), f32)
    totals = lax.fori_loop(0, tiles_per_program, tile_body, (zero,) * 12)
    slots = jnp.arange(_NUM_STATS)
    packed = jnp.zeros((_NUM_STATS,), f32)
    for k, value in enumerate(totals):
        packed = jnp.where(slots == k, value, packed)
    stats_ref[g, :] = packed


def _is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def delta_pass(h, p, a, mask, mu_pos, mu_neg, gamma_pos, gamma_neg, use_alpha=True, *,
               lam_range=None, with_centroids=True, block_tokens=32, block_hidden=256,
               num_programs=None, num_warps=4, num_stages=2, interpret=None) -> DeltaPassSums:
    """Pallas DelTA pass; same arguments and result as `delta_pass_reference`.

    Tuning knobs: block_tokens / block_hidden (powers of two; the h tile loaded at once is
    [block_tokens, block_hidden]), num_programs (persistent grid size; default a few per SM),
    num_warps / num_stages (Triton). interpret=None runs interpret mode off-GPU.
    """
    h2, p, a, mask, lead, w, b = _check_and_flatten(h, p, a, mask, mu_pos, mu_neg)
    n_tokens, hidden = h2.shape
    if not (_is_power_of_two(block_tokens) and _is_power_of_two(block_hidden)):
        raise ValueError(f"delta_pass: block_tokens={block_tokens} and block_hidden={block_hidden} "
                         "must be powers of two")
    block_hidden = min(block_hidden, pl.next_power_of_2(hidden))
    num_tiles = max(1, pl.cdiv(n_tokens, block_tokens))
    if num_programs is None:
        num_programs = backend.default_num_programs(num_tiles)
    num_programs = max(1, min(int(num_programs), num_tiles))
    tiles_per_program = pl.cdiv(num_tiles, num_programs)
    with_lambda = lam_range is not None
    lam_min, lam_max = lam_range if with_lambda else (0.0, 0.0)
    params = jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in
                        (b, gamma_pos, gamma_neg, lam_min, lam_max, 0.0, 0.0, 0.0)])

    out_shape = [jax.ShapeDtypeStruct((num_programs, _NUM_STATS), jnp.float32)]
    if with_centroids:
        out_shape.append(jax.ShapeDtypeStruct((2 * num_programs, hidden), jnp.float32))
    if with_lambda:
        out_shape.append(jax.ShapeDtypeStruct((n_tokens,), jnp.float32))
    kernel = functools.partial(
        _delta_kernel, n_tokens=n_tokens, hidden=hidden, block_tokens=block_tokens,
        block_hidden=block_hidden, num_programs=num_programs, tiles_per_program=tiles_per_program,
        use_alpha=use_alpha, with_centroids=with_centroids, with_lambda=with_lambda)
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(num_programs,),
        interpret=backend.default_interpret(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="delta_pass",
    )(h2, p, a, mask, w, params)
    outs = list(outs)
    per_program = outs.pop(0)  # [G, 16]
    stats = jnp.sum(per_program, axis=0)  # valid for the additive slots
    # Margin moments: the programs' (count, mean, m2) merged exactly.
    count, margin_mean, margin_m2 = reduce_moments(per_program[:, 2:4], per_program[:, 4:6],
                                                   per_program[:, 6:8])
    if with_centroids:
        centroid_sum = jnp.sum(outs.pop(0).reshape(num_programs, 2, hidden), axis=0)
    else:
        centroid_sum = jnp.zeros((2, hidden), jnp.float32)
    lam = outs.pop(0).reshape(lead) if with_lambda else None
    return DeltaPassSums(
        centroid_sum=centroid_sum,
        weight_sum=stats[0:2],
        count=count,
        margin_mean=margin_mean,
        margin_m2=margin_m2,
        correct=stats[8:10],
        lam_sum=stats[10],
        num_valid=stats[11],
        lam=lam,
    )


def delta_pass_auto(h, p, a, mask, mu_pos, mu_neg, gamma_pos, gamma_neg, use_alpha=True, *,
                    lam_range=None, with_centroids=True, impl=None, **kernel_options) -> DeltaPassSums:
    """The Pallas kernel on GPU, the jnp reference elsewhere; impl= or $DELTA_JAX_KERNELS overrides
    ("pallas" | "interpret" | "reference" | "auto"). kernel_options go to `delta_pass`."""
    choice = backend.resolve_impl(impl)
    args = (h, p, a, mask, mu_pos, mu_neg, gamma_pos, gamma_neg, use_alpha)
    if choice == "reference":
        return delta_pass_reference(*args, lam_range=lam_range, with_centroids=with_centroids)
    return delta_pass(*args, lam_range=lam_range, with_centroids=with_centroids,
                      interpret=(choice == "interpret"), **kernel_options)
