"""DelTA token coefficients (Zhang, Wu, Lin, "DelTA: Discriminative Token Credit Assignment for
Reinforcement Learning from Verifiable Rewards", arXiv 2605.21467), as stated in DELTA_SPEC.md.

Every response token gets a feature v (a proxy for its policy gradient). Tokens of sequences with a
positive advantage (side P) and a negative advantage (side N) define two advantage-weighted
centroids; a token's margin says how much closer it sits to its own side's centroid than to the
other's. A sigmoid of the temperature-scaled margin maps to lambda in [lam_min, lam_max], the
centroids are refined K times with those soft assignments, and the lambdas are normalised to mean 1
over the valid tokens. The weights multiply the per-token policy loss (see rl/losses.py).

Layout of this module
* Proxies: the paper's default v = (1 - p) h (spec 2.0, the gradient of log p(y) w.r.t. the
  sampled token's LM-head row), which `delta_coefficients(hidden, token_prob, ...)` applies on
  the fly (a FeatureChunk's scale 1 - p) without materialising v, and `hidden_topk_proxy` /
  `hidden_topk_proxy_from_head` (the paper's best ablation, v = W_y - sum_{j in topK} p~_j W_j).
* Streaming pieces, pure functions on small state pytrees, each one pass over feature chunks:
  `init_pass` / `accumulate_centroids` / `accumulate_margins` / `finalize_pass`, then
  `init_final` / `accumulate_final` / `normaliser`, and `diagnostics`. A chunk is any block of
  tokens (split over sequences, over time, or both): every statistic is a sum over tokens.
* `delta_coefficients`: the one-shot form, written with the same pieces (one chunk = the whole
  batch), global statistics by default or per data shard via jax.shard_map.
* `delta_coefficients_streaming`: the same result from chunks given one at a time.
* pass_impl="kernel" (both forms): each of the K + 3 passes is one call of the fused pass
  kernels.delta_pass on (h, p) (one XLA program per pass), v never stored;
  `fit_discriminator_fused` runs the same passes as `fit_discriminator`, and `add_final_lambdas`
  turns the final pass's lambdas into the same `FinalStats`.
* `Ablations`: the paper's ablation rows (DELTA_SPEC section 4; config delta.fixed_gamma,
  delta.assignment, delta.normalize, delta.weight, delta.random_lambda), one small hashable value
  threaded through the same pieces (`_alpha`, `_lambdas`, `fit_discriminator[_fused]`,
  `normaliser`, `diagnostics`) as a static argument. The default `Ablations()` is the full method
  and computes exactly what the code computed before the options existed.

Side index convention for the [2]/[3]-shaped statistics: 0 = positive (P), 1 = negative (N),
2 = zero advantage (Z, only in the final-pass statistics).

Numerics: all statistics in fp32 (bf16 features are upcast where they are read), matmuls at
HIGHEST precision, margins in the affine form of spec 2.3, margin variances merged across chunks
with Chan et al.'s pairwise formula (count, mean, sum of squared deviations) rather than raw sums of
squares, which would cancel catastrophically in fp32 when the mean margin is large.

Edge cases (all finite, never NaN):
* No P (or no N) tokens: that centroid is 0 (sum / max(0, 1e-8)); its gamma is sqrt(1e-8) = 1e-4.
* All advantages zero: every valid token is in Z, lambda = lam_min everywhere, all weights are 1.
* A side with a single token, or constant margins: variance 0, gamma = 1e-4; the sigmoid saturates
  to 0 or 1 (or is 0.5 for a zero margin), lambda stays in [lam_min, lam_max].
* No valid token at all: weights are all 0, c = 0.
* Padding positions may hold any values (even NaN/inf): they are masked out before any arithmetic.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from delta_jax.kernels.delta_pass import masked_moments, merge_moments

Array = jax.Array

_WEIGHT_FLOOR = 1e-8  # spec 2.2 / 2.7: max(sum, 1e-8)
_VAR_FLOOR = 1e-8  # spec 2.4: gamma = sqrt(max(Var, 1e-8))
_HIGHEST = jax.lax.Precision.HIGHEST
SIDE_NAMES = ("pos", "neg", "zero")


# ----------------------------------------------------------------------------- proxies


def hidden_topk_proxy(head_rows_y: Array, topk_rows: Array, topk_probs: Array) -> Array:
    """Top-K hidden-gradient proxy (the paper's best ablation): v = W_y - sum_{j in topK} p~_j W_j.

    This is the gradient of log p(y) with respect to the hidden state h, with the softmax
    expectation restricted to the K most likely vocabulary entries and p~ = p_topk / sum(p_topk).
    W_j are LM-head rows, i.e. columns of the [H, V] head matrix.

    head_rows_y [B, T, H]: head row of the sampled token; topk_rows [B, T, K, H]: head rows of the
    top-K tokens; topk_probs [B, T, K]: their probabilities (any scale, renormalised here; an
    all-zero row gives p~ = 0). Returns v fp32 [B, T, H]; pass it as `features=` to
    `delta_coefficients`.
    """
    if topk_rows.ndim != 4 or topk_rows.shape[:2] != head_rows_y.shape[:2]:
        raise ValueError(f"hidden_topk_proxy: topk_rows must be [B, T, K, H] matching head_rows_y "
                         f"{head_rows_y.shape}, got {topk_rows.shape}")
    if topk_probs.shape != topk_rows.shape[:3]:
        raise ValueError(f"hidden_topk_proxy: topk_probs must be {topk_rows.shape[:3]}, "
                         f"got {topk_probs.shape}")
    probs = topk_probs.astype(jnp.float32)
    probs = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)
    expected_row = jnp.einsum("btk,btkh->bth", probs, topk_rows.astype(jnp.float32),
                              precision=_HIGHEST)
    return head_rows_y.astype(jnp.float32) - expected_row


def hidden_topk_proxy_from_head(head: Array, labels: Array, topk_ids: Array,
                                topk_probs: Array) -> Array:
    """`hidden_topk_proxy` gathering the rows from the LM head itself.

    head [H, V] (`model.lm_head_weight()`), labels int [B, T] (sampled tokens), topk_ids int
    [B, T, K] and topk_probs [B, T, K] (e.g. `jax.lax.top_k(softmax(logits / T), K)`) -> v fp32
    [B, T, H]. Gathers [B, T, K, H] rows: call it per chunk for long sequences.
    """
    rows = head.T  # [V, H]
    return hidden_topk_proxy(jnp.take(rows, labels, axis=0), jnp.take(rows, topk_ids, axis=0),
                             topk_probs)


# ----------------------------------------------------------------------------- state pytrees


class FeatureChunk(NamedTuple):
    """A block of tokens: features [b, t, H] (any float dtype), advantages [b] or [b, t],
    mask [b, t] (1 = valid response token), feature_scale [b, t] or None.

    The proxy is v = feature_scale * features (feature_scale = 1 - p with features = h for the
    last-layer proxy; None means 1, i.e. features are v already).
    """
    features: Array
    advantages: Array
    mask: Array
    feature_scale: Array | None = None


class PassStats(NamedTuple):
    """Accumulators of one pass over the chunks (side 0 = P, 1 = N).

    weighted_sum [2, H]: sum over the side of weight * v (weight = |A| * alpha);
    weight_total [2]: sum of the weights; margin_count / margin_mean / margin_m2 [2]: token count,
    mean and sum of squared deviations of the margins Delta (population variance = m2 / count).
    """
    weighted_sum: Array
    weight_total: Array
    margin_count: Array
    margin_mean: Array
    margin_m2: Array


class Ablations(NamedTuple):
    """The paper's ablation rows (DELTA_SPEC section 4) as options of the weights; the defaults
    are the full method. Hashable: a static argument of the jitted pieces. Config: delta.<field>.

    fixed_gamma: > 0 fixes both temperatures gamma+ = gamma- = fixed_gamma in every use (the
      refinement alphas of spec 2.5 and the final alpha* of 2.6; the temperature pass of 2.4 is
      skipped, so a streaming source is read K + 2 times); 0 = the adaptive temperatures of 2.4.
    assignment: "soft" = alpha = sigmoid(Delta / gamma); "hard" = alpha = 1[Delta > 0], a 0/1
      step, both in the refinement centroid weights (2.5) and the final alpha* (2.6). The
      temperatures are then unused (still computed, and reported as diagnostics).
    normalize: False = no self-normalisation: w = lambda (c = 1 in spec 2.7; the "normaliser"
      diagnostic is then 1).
    weight: "lambda" (spec 2.6) or "alpha": lambda = alpha* on P and N (lam_min / lam_max unused),
      0 on Z, then normalised or not per `normalize` (a batch whose lambdas are all 0, e.g. all Z,
      gets weight 0 everywhere: c = N_tok / 1e-8 stays finite).
    random_lambda: the control: lambda ~ Uniform[lam_min, lam_max] i.i.d. per P/N token, lam_min
      on Z, 0 on padding (then normalised or not per `normalize`). Needs a PRNG key; the
      discriminator still runs, for the diagnostics only. Cannot be combined with weight="alpha".
    """
    fixed_gamma: float = 0.0
    assignment: str = "soft"
    normalize: bool = True
    weight: str = "lambda"
    random_lambda: bool = False


FULL_METHOD = Ablations()
ASSIGNMENTS = ("soft", "hard")
WEIGHTS = ("lambda", "alpha")
_NO_KEY = "delta.random_lambda needs a PRNG key (key=jax.random.key(...))"
_HARD_IN_KERNEL = ("delta.assignment='hard' is not supported by the fused pass "
                   "(delta.pass_impl='kernel' computes sigmoid assignments): use "
                   "delta.pass_impl='jnp'")


def check_ablations(ablations: Ablations | None, pass_impl: str = "jnp") -> Ablations:
    """Validates the options (errors name the delta.* config field) and returns them with plain
    Python field types (a float, bools, strs: hashable and stable as a jit static argument)."""
    if ablations is None:
        return FULL_METHOD
    if not isinstance(ablations, Ablations):
        raise TypeError(f"delta: ablations must be a delta.Ablations, got {type(ablations)}")
    fixed_gamma = float(ablations.fixed_gamma)
    if not fixed_gamma >= 0.0 or fixed_gamma == float("inf"):
        raise ValueError(f"delta.fixed_gamma must be finite and >= 0 (0 = the adaptive "
                         f"temperatures of spec 2.4), got {ablations.fixed_gamma}")
    if ablations.assignment not in ASSIGNMENTS:
        raise ValueError(f"delta.assignment must be one of {ASSIGNMENTS}, "
                         f"got {ablations.assignment!r}")
    if ablations.weight not in WEIGHTS:
        raise ValueError(f"delta.weight must be one of {WEIGHTS}, got {ablations.weight!r}")
    if ablations.random_lambda and ablations.weight == "alpha":
        raise ValueError("delta.random_lambda draws lambda in [lam_min, lam_max]; it cannot be "
                         "combined with delta.weight='alpha'")
    if ablations.assignment == "hard" and pass_impl == "kernel":
        raise ValueError(_HARD_IN_KERNEL)
    return Ablations(fixed_gamma, str(ablations.assignment), bool(ablations.normalize),
                     str(ablations.weight), bool(ablations.random_lambda))


def _check_key(ablations: Ablations, key) -> None:
    if ablations.random_lambda and key is None:
        raise ValueError(_NO_KEY)


def lambda_noise(key: Array, shape: tuple[int, ...]) -> Array:
    """The per-token draws of delta.random_lambda: u ~ Uniform[0, 1) fp32 of `shape`
    (lambda = lam_min + (lam_max - lam_min) u on P/N tokens)."""
    return jax.random.uniform(key, shape, jnp.float32)


class Discriminator(NamedTuple):
    """Centroids mu [2, H] (row 0 = mu+, row 1 = mu-), temperatures gamma [2] (gamma+, gamma-)."""
    mu: Array
    gamma: Array


class FinalStats(NamedTuple):
    """Accumulators of the final pass (side 0 = P, 1 = N, 2 = Z).

    token_count [3]; lam_sum []: sum of lambda over all valid tokens (for the normaliser);
    lam_mean / lam_m2 / lam_min / lam_max [3]: lambda statistics per side (for diagnostics;
    min/max are +inf/-inf for an empty side until reported); correct []: number of P/N tokens with
    sign(A) * s > 0 (discriminator accuracy, spec 2.9).
    """
    token_count: Array
    lam_sum: Array
    lam_mean: Array
    lam_m2: Array
    lam_min: Array
    lam_max: Array
    correct: Array


def init_pass(hidden_size: int) -> PassStats:
    """Empty accumulators for one centroid / margin pass."""
    z2 = jnp.zeros((2,), jnp.float32)
    return PassStats(jnp.zeros((2, hidden_size), jnp.float32), z2, z2, z2, z2)


def init_final() -> FinalStats:
    """Empty accumulators for the final pass."""
    z3 = jnp.zeros((3,), jnp.float32)
    return FinalStats(z3, jnp.zeros((), jnp.float32), z3, z3, jnp.full((3,), jnp.inf, jnp.float32),
                      jnp.full((3,), -jnp.inf, jnp.float32), jnp.zeros((), jnp.float32))


# ----------------------------------------------------------------------------- per-chunk helpers


def _check_chunk(chunk: FeatureChunk) -> None:
    f, a, m, s = chunk
    if f.ndim != 3:
        raise ValueError(f"delta: features/hidden must be [B, T, H], got shape {f.shape}")
    if m.shape != f.shape[:2]:
        raise ValueError(f"delta: mask must be [B, T] = {f.shape[:2]}, got shape {m.shape}")
    if a.shape not in (f.shape[:1], f.shape[:2]):
        raise ValueError(f"delta: advantages must be [B] = {f.shape[:1]} or [B, T] = {f.shape[:2]},"
                         f" got shape {a.shape}")
    if s is not None and s.shape != f.shape[:2]:
        raise ValueError(f"delta: token_prob/feature_scale must be [B, T] = {f.shape[:2]}, "
                         f"got shape {s.shape}")


class _Tokens(NamedTuple):
    """Per-token quantities of a chunk, everything masked and fp32."""
    features: Array  # [b, t, H] fp32, 0 on padding
    scale: Array  # [b, t] fp32, 0 on padding
    side: Array  # [3, b, t] float 0/1 masks for P, N, Z (valid tokens only)
    abs_adv: Array  # [b, t] |A|, 0 on padding
    sign: Array  # [b, t] +1 on P, -1 on N, 0 elsewhere


def _token_advantages(advantages: Array, mask: Array) -> Array:
    """Advantages [b] or [b, t] -> fp32 [b, t], 0 on padding."""
    adv = advantages.astype(jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    return jnp.where(mask > 0, jnp.broadcast_to(adv, mask.shape), 0.0)


def _side_masks(adv: Array, mask: Array) -> Array:
    """[3, b, t] float 0/1 masks of the valid tokens on P, N, Z (adv from _token_advantages)."""
    valid = mask > 0
    pos, neg = valid & (adv > 0), valid & (adv < 0)
    return jnp.stack([pos, neg, valid & ~pos & ~neg]).astype(jnp.float32)


def _tokens(chunk: FeatureChunk) -> _Tokens:
    _check_chunk(chunk)
    f, a, m, s = chunk
    valid = m > 0
    adv = _token_advantages(a, m)
    side = _side_masks(adv, m)
    scale = jnp.ones(m.shape, jnp.float32) if s is None else s.astype(jnp.float32)
    # Padding may hold garbage (even NaN): select, do not multiply, so it never reaches a sum.
    feats = jnp.where(valid[..., None], f.astype(jnp.float32), 0.0)
    scale = jnp.where(valid, scale, 0.0)
    return _Tokens(feats, scale, side, jnp.abs(adv), side[0] - side[1])


def _scores(tok: _Tokens, mu: Array) -> Array:
    """Discriminator score s_t = v . (mu+ - mu-) - (|mu+|^2 - |mu-|^2) / 2, [b, t] (spec 2.3)."""
    direction = mu[0] - mu[1]
    # |mu+|^2 - |mu-|^2 = (mu+ - mu-) . (mu+ + mu-): no difference of large squares.
    offset = -0.5 * jnp.dot(direction, mu[0] + mu[1], precision=_HIGHEST)
    proj = jnp.einsum("bth,h->bt", tok.features, direction, precision=_HIGHEST)
    return tok.scale * proj + offset


def _margins(tok: _Tokens, mu: Array) -> tuple[Array, Array]:
    """Margins Delta = 2 sign(A) s (0 off P/N) and scores s, both [b, t]."""
    score = _scores(tok, mu)
    return 2.0 * tok.sign * score, score


def _merge_moments(count, mean, m2, x, side):
    """Running (count, mean, m2) per side merged (Chan et al.) with the moments of the values
    x [b, t] selected by side [S, b, t]; returns the updated (count, mean, m2) [S]."""
    return merge_moments(count, mean, m2, *masked_moments(x, side, axis=(1, 2)))


def _alpha(margin: Array, tok: _Tokens, gamma: Array,
           ablations: Ablations = FULL_METHOD) -> Array:
    """alpha_t = sigmoid(Delta_t / gamma_side) (spec 2.5), [b, t]; 0.5 off P/N (unused there).
    ablations.assignment "hard": alpha_t = 1[Delta_t > 0] (0 off P/N)."""
    if ablations.assignment == "hard":
        return (margin > 0).astype(jnp.float32)
    off_side = 1.0 - tok.side[0] - tok.side[1]  # Z and padding: divide by 1, never by 0
    gamma_tok = tok.side[0] * gamma[0] + tok.side[1] * gamma[1] + off_side
    return jax.nn.sigmoid(margin / gamma_tok)


# ----------------------------------------------------------------------------- the passes


def accumulate_centroids(stats: PassStats, chunk: FeatureChunk,
                         disc: Discriminator | None = None,
                         ablations: Ablations = FULL_METHOD) -> PassStats:
    """One chunk of a centroid pass.

    disc None: initial centroids (spec 2.2), token weight |A|.
    disc = (mu^k, gamma^k): refinement round k (spec 2.5), token weight |A| * alpha_t with
    alpha_t = sigmoid(Delta_t(mu^k) / gamma^k_side) (1[Delta_t > 0] with hard assignment); the
    margins Delta(mu^k) are accumulated too, so `finalize_pass` gives mu^{k+1} and the lagged
    temperature gamma^{k+1} = std Delta(mu^k).
    """
    tok = _tokens(chunk)
    weight = tok.abs_adv
    count, mean, m2 = stats.margin_count, stats.margin_mean, stats.margin_m2
    if disc is not None:
        margin, _ = _margins(tok, disc.mu)
        weight = weight * _alpha(margin, tok, disc.gamma, ablations)
        count, mean, m2 = _merge_moments(count, mean, m2, margin, tok.side[:2])
    side_weight = tok.side[:2] * weight  # [2, b, t]
    weighted_sum = jnp.einsum("sbt,bth->sh", side_weight * tok.scale, tok.features,
                              precision=_HIGHEST)
    return PassStats(stats.weighted_sum + weighted_sum,
                     stats.weight_total + side_weight.sum((1, 2)), count, mean, m2)


def accumulate_margins(stats: PassStats, chunk: FeatureChunk, mu: Array) -> PassStats:
    """One chunk of the temperature pass: margin moments of Delta(mu) per side (spec 2.4)."""
    tok = _tokens(chunk)
    margin, _ = _margins(tok, mu)
    count, mean, m2 = _merge_moments(stats.margin_count, stats.margin_mean, stats.margin_m2,
                                     margin, tok.side[:2])
    return stats._replace(margin_count=count, margin_mean=mean, margin_m2=m2)


def finalize_pass(stats: PassStats) -> Discriminator:
    """Centroids mu = weighted_sum / max(weight_total, 1e-8) and temperatures
    gamma = sqrt(max(m2 / max(count, 1), 1e-8)) (population std, spec 2.2 / 2.4)."""
    mu = stats.weighted_sum / jnp.maximum(stats.weight_total, _WEIGHT_FLOOR)[:, None]
    var = stats.margin_m2 / jnp.maximum(stats.margin_count, 1.0)
    return Discriminator(mu, jnp.sqrt(jnp.maximum(var, _VAR_FLOOR)))


def _lambda_range(lam_min: float, lam_max: float, ablations: Ablations) -> tuple[float, float]:
    """(lo, hi) with lambda = lo + (hi - lo) alpha* on P/N and lo on Z: (lam_min, lam_max), or
    (0, 1) for weight="alpha" (lambda = alpha* on P/N, 0 on Z). The fused pass's lam_range."""
    return (0.0, 1.0) if ablations.weight == "alpha" else (lam_min, lam_max)


def _random_lambdas(side: Array, noise: Array, lam_min: float, lam_max: float) -> Array:
    """delta.random_lambda: lam_min + (lam_max - lam_min) u on P/N, lam_min on Z, 0 on padding;
    side [3, b, t] P/N/Z masks, noise u [b, t] in [0, 1)."""
    if noise is None:
        raise ValueError(_NO_KEY)
    on_side = side[0] + side[1]
    return on_side * (lam_min + (lam_max - lam_min) * noise) + side[2] * lam_min


def _lambdas(tok: _Tokens, disc: Discriminator, lam_min: float, lam_max: float,
             ablations: Ablations = FULL_METHOD, noise: Array | None = None):
    margin, score = _margins(tok, disc.mu)
    if ablations.random_lambda:
        return _random_lambdas(tok.side, noise, lam_min, lam_max), score
    alpha = _alpha(margin, tok, disc.gamma, ablations)
    lo, hi = _lambda_range(lam_min, lam_max, ablations)
    on_side = tok.side[0] + tok.side[1]
    lam = on_side * (lo + (hi - lo) * alpha) + tok.side[2] * lo
    return lam, score


def accumulate_final(stats: FinalStats, chunk: FeatureChunk, disc: Discriminator,
                     lam_min: float = 0.8, lam_max: float = 1.2,
                     ablations: Ablations = FULL_METHOD,
                     noise: Array | None = None) -> tuple[FinalStats, Array]:
    """One chunk of the final pass: returns the updated statistics and lambda [b, t] of this chunk.
    The chunk's weights are `normaliser(final_stats, ablations) * lambda` once every chunk has been
    seen. noise: the chunk's `lambda_noise` draws [b, t], required with ablations.random_lambda."""
    tok = _tokens(chunk)
    lam, score = _lambdas(tok, disc, lam_min, lam_max, ablations, noise)
    correct = ((tok.side[0] + tok.side[1]) * (tok.sign * score > 0)).sum()
    return add_final_lambdas(stats, tok.side, lam, correct), lam


def add_final_lambdas(stats: FinalStats, side: Array, lam: Array, correct: Array) -> FinalStats:
    """Final-pass statistics of a chunk given its lambdas: side [3, b, t] (P/N/Z masks), lambda
    [b, t] (0 on padding), correct [] (P/N tokens with sign(A) s > 0)."""
    count, mean, m2 = _merge_moments(stats.token_count, stats.lam_mean, stats.lam_m2, lam, side)
    on_side = side > 0
    lam_min_s = jnp.min(jnp.where(on_side, lam, jnp.inf), axis=(1, 2))
    lam_max_s = jnp.max(jnp.where(on_side, lam, -jnp.inf), axis=(1, 2))
    return FinalStats(count, stats.lam_sum + lam.sum(), mean, m2,
                      jnp.minimum(stats.lam_min, lam_min_s), jnp.maximum(stats.lam_max, lam_max_s),
                      stats.correct + correct)


def normaliser(stats: FinalStats, ablations: Ablations = FULL_METHOD) -> Array:
    """Spec 2.7: c = N_tok / max(sum lambda, 1e-8) over all valid tokens (Z included); 1 when
    ablations.normalize is off."""
    if not ablations.normalize:
        return jnp.ones((), jnp.float32)
    return stats.token_count.sum() / jnp.maximum(stats.lam_sum, _WEIGHT_FLOOR)


def diagnostics(disc: Discriminator, final: FinalStats,
                ablations: Ablations = FULL_METHOD) -> dict[str, Array]:
    """Scalar diagnostics (spec 2.9 and 5.5), all fp32:

    disc_accuracy (fraction of P/N tokens with sign(A) s > 0, s from the final centroids),
    gamma_pos / gamma_neg (the temperatures used for the final weights), centroid_norm_pos /
    centroid_norm_neg / centroid_cosine, weight_{mean,std,min,max}_{pos,neg,zero} (0 for an empty
    side), tokens_{pos,neg,zero}, normaliser (c; 1 without normalisation). With fixed_gamma the
    gammas are the fixed value; with hard assignment they are the (unused) margin spreads.
    """
    c = normaliser(final, ablations)
    count = final.token_count
    norms = jnp.linalg.norm(disc.mu, axis=-1)
    out = {
        "disc_accuracy": final.correct / jnp.maximum(count[0] + count[1], 1.0),
        "gamma_pos": disc.gamma[0],
        "gamma_neg": disc.gamma[1],
        "centroid_norm_pos": norms[0],
        "centroid_norm_neg": norms[1],
        "centroid_cosine": jnp.dot(disc.mu[0], disc.mu[1], precision=_HIGHEST)
        / jnp.maximum(norms[0] * norms[1], 1e-30),
        "normaliser": c,
    }
    present = count > 0
    std = jnp.sqrt(final.lam_m2 / jnp.maximum(count, 1.0))
    for i, name in enumerate(SIDE_NAMES):
        out[f"tokens_{name}"] = count[i]
        out[f"weight_mean_{name}"] = c * final.lam_mean[i]
        out[f"weight_std_{name}"] = c * std[i]
        out[f"weight_min_{name}"] = jnp.where(present[i], c * final.lam_min[i], 0.0)
        out[f"weight_max_{name}"] = jnp.where(present[i], c * final.lam_max[i], 0.0)
    return out


# ----------------------------------------------------------------------------- drivers


# fold(update, init, *extra) -> the state after update(state, chunk, *extra) over every chunk.
Fold = Callable[..., Any]


def _fixed_gamma(ablations: Ablations) -> Array | None:
    """gamma [2] = (fixed_gamma, fixed_gamma) when delta.fixed_gamma > 0, else None."""
    if ablations.fixed_gamma > 0:
        return jnp.full((2,), ablations.fixed_gamma, jnp.float32)
    return None


def _with_fixed_gamma(disc: Discriminator, ablations: Ablations) -> Discriminator:
    fixed = _fixed_gamma(ablations)
    return disc if fixed is None else disc._replace(gamma=fixed)


def fit_discriminator(fold: Fold, hidden_size: int | None, num_refine: int,
                      ablations: Ablations = FULL_METHOD) -> Discriminator:
    """Spec 2.2-2.5 given a way to run one pass over the chunks; returns (mu^K, gamma^K).
    hidden_size None: fold gets state None and creates it from the first chunk it sees.

    Passes: initial centroids mu^0; margins Delta(mu^0) -> gamma^0; then K refinement rounds, each
    one pass producing mu^{k+1} and gamma^{k+1} = std Delta(mu^k) (lagged: gamma^1 = gamma^0).
    ablations.fixed_gamma > 0: no temperature pass, gamma^k = the fixed value for every k;
    ablations.assignment: the refinement alphas (see `_alpha`).
    """
    if num_refine < 0:
        raise ValueError(f"delta: num_refine must be >= 0, got {num_refine}")
    init = lambda: None if hidden_size is None else init_pass(hidden_size)  # noqa: E731
    mu = finalize_pass(fold(accumulate_centroids, init(), None)).mu
    gamma = _fixed_gamma(ablations)
    if gamma is None:
        gamma = finalize_pass(fold(accumulate_margins, init(), mu)).gamma
    disc = Discriminator(mu, gamma)
    for _ in range(num_refine):
        disc = _with_fixed_gamma(finalize_pass(fold(accumulate_centroids, init(), disc,
                                                    ablations)), ablations)
    return disc


# ----------------------------------------------------------------------------- fused-pass form
#
# pass_impl="kernel": every pass over the features is one call of kernels.delta_pass (the fused
# pass; plain XLA since its Pallas version was retired, see kernels/delta_pass.py) on (h, p): the
# proxy v = (1 - p) h is formed inside the pass, never stored. Precomputed features v
# (features=, e.g. the top-K proxy) go through the same pass with p = 0. The [B, T]-sized final
# statistics (lambda moments per side) are plain jnp.

PASS_IMPLS = ("jnp", "kernel")
# pass_fn(mu [2, H], gamma [2], use_alpha, lam_range, with_centroids) -> kernels.DeltaPassSums
PassFn = Callable[..., Any]


def _as_pass_stats(sums) -> PassStats:
    """kernels.DeltaPassSums -> PassStats (the fields map one-to-one)."""
    return PassStats(sums.centroid_sum, sums.weight_sum, sums.count, sums.margin_mean,
                     sums.margin_m2)


def fit_discriminator_fused(pass_fn: PassFn, hidden_size: int | None, num_refine: int,
                            ablations: Ablations = FULL_METHOD) -> Discriminator:
    """`fit_discriminator` with one fused pass per round (same passes, same lagged gammas, the
    same fixed_gamma handling). hidden_size None: pass_fn gets mu None for the initial pass (zeros
    of the features' size). Hard assignment has no fused form (`check_ablations` refuses it)."""
    if num_refine < 0:
        raise ValueError(f"delta: num_refine must be >= 0, got {num_refine}")
    if ablations.assignment != "soft":
        raise ValueError(_HARD_IN_KERNEL)
    unit = jnp.ones((2,), jnp.float32)
    # Initial centroids: weights |A| (alpha off); the margins of this pass are unused.
    mu0 = None if hidden_size is None else jnp.zeros((2, hidden_size), jnp.float32)
    mu = finalize_pass(_as_pass_stats(pass_fn(mu0, unit, use_alpha=False))).mu
    gamma = _fixed_gamma(ablations)
    if gamma is None:
        gamma = finalize_pass(_as_pass_stats(pass_fn(mu, unit, use_alpha=False,
                                                     with_centroids=False))).gamma
    disc = Discriminator(mu, gamma)
    for _ in range(num_refine):
        disc = _with_fixed_gamma(
            finalize_pass(_as_pass_stats(pass_fn(disc.mu, disc.gamma, use_alpha=True))),
            ablations)
    return disc


def _kernel_pass(h, p, adv, mask, mu, gamma, *, use_alpha=True, lam_range=None,
                 with_centroids=True):
    from delta_jax.kernels.delta_pass import delta_pass

    if mu is None:  # the initial pass: weights |A| only, the margins are unused
        mu = jnp.zeros((2, h.shape[-1]), jnp.float32)
    return delta_pass(h, p, adv, mask, mu[0], mu[1], gamma[0], gamma[1], use_alpha,
                      lam_range=lam_range, with_centroids=with_centroids)


def _final_from_sums(sums, adv, mask, lam_min, lam_max, ablations, noise, stats=None):
    """The final pass's FinalStats and lambdas from its DeltaPassSums (kernel lambdas, or with
    random_lambda the draws of `_random_lambdas`: the kernel's alphas only feed the accuracy)."""
    side = _side_masks(adv, mask)
    lam = (_random_lambdas(side, noise, lam_min, lam_max) if ablations.random_lambda
           else sums.lam)
    stats = init_final() if stats is None else stats
    return add_final_lambdas(stats, side, lam, sums.correct.sum()), lam


def _fused_one_shot(h, p, adv, mask, num_refine, lam_min, lam_max, ablations=FULL_METHOD,
                    noise=None):
    """`_one_shot` with fused passes. h [B, T, H], p [B, T] (0 when h is v already), adv [B, T]
    masked (from _token_advantages), mask [B, T]. Each pass is one XLA reduction over the whole
    batch: on sharded inputs XLA's partitioner reduces each shard where it lives and all-reduces
    the [2, H] / [2] sums."""
    pass_fn = functools.partial(_kernel_pass, h, p, adv, mask)
    disc = fit_discriminator_fused(pass_fn, h.shape[-1], num_refine, ablations)
    sums = pass_fn(disc.mu, disc.gamma, use_alpha=True,
                   lam_range=_lambda_range(lam_min, lam_max, ablations), with_centroids=False)
    final, lam = _final_from_sums(sums, adv, mask, lam_min, lam_max, ablations, noise)
    return normaliser(final, ablations) * lam, diagnostics(disc, final, ablations)


def _kernel_inputs(chunk: FeatureChunk, token_prob: Array | None = None):
    """(h, p, adv [b, t] masked fp32, mask) of a chunk for the fused pass. p = token_prob when
    given, else 1 - feature_scale (0 for precomputed features: v = h)."""
    _check_chunk(chunk)
    f, a, m, scale = chunk
    if token_prob is None:
        token_prob = (jnp.zeros(m.shape, jnp.float32) if scale is None
                      else 1.0 - scale.astype(jnp.float32))
    return f, token_prob.astype(jnp.float32), _token_advantages(a, m), m.astype(jnp.float32)


def _check_pass_impl(pass_impl: str) -> None:
    if pass_impl not in PASS_IMPLS:
        raise ValueError(f"delta: pass_impl must be one of {PASS_IMPLS} (config delta.pass_impl),"
                         f" got {pass_impl!r}")


def _check_lambda_range(lam_min: float, lam_max: float) -> None:
    if not 0.0 < lam_min <= lam_max:
        raise ValueError(f"delta: need 0 < lam_min <= lam_max, got lam_min={lam_min}, "
                         f"lam_max={lam_max}")


def _one_shot(chunk: FeatureChunk, num_refine: int, lam_min: float, lam_max: float,
              ablations: Ablations = FULL_METHOD, noise: Array | None = None):
    """The whole batch as a single chunk: weights [B, T] and the diagnostics dict."""
    _check_chunk(chunk)
    fold = lambda update, state, *extra: update(state, chunk, *extra)  # noqa: E731
    disc = fit_discriminator(fold, chunk.features.shape[-1], num_refine, ablations)
    final, lam = accumulate_final(init_final(), chunk, disc, lam_min, lam_max, ablations, noise)
    return normaliser(final, ablations) * lam, diagnostics(disc, final, ablations)


def _reduce_shard_diagnostics(diag: dict[str, Array]) -> dict[str, Array]:
    """Per-shard diagnostics [S] -> scalars: counts summed, min/max over shards, others averaged."""
    out = {}
    for key, value in diag.items():
        if key.startswith("tokens_"):
            out[key] = value.sum()
        elif key.startswith("weight_min_"):
            count = diag["tokens_" + key.rsplit("_", 1)[1]]
            out[key] = jnp.min(jnp.where(count > 0, value, jnp.inf))
            out[key] = jnp.where(jnp.isfinite(out[key]), out[key], 0.0)
        elif key.startswith("weight_max_"):
            out[key] = value.max()
        else:
            out[key] = value.mean()
    return out


def delta_coefficients(hidden: Array | None, token_prob: Array | None, advantages: Array,
                       mask: Array, num_refine: int = 1, lam_min: float = 0.8,
                       lam_max: float = 1.2, *, features: Array | None = None,
                       stats_mode: str = "global", mesh: Mesh | None = None,
                       data_axes: str | tuple[str, ...] = "data", pass_impl: str = "jnp",
                       ablations: Ablations | None = None,
                       key: Array | None = None):
    """DelTA token weights (DELTA_SPEC sections 2.0-2.7), jitted.

    Args:
      hidden: [B, T, H] final hidden states (after the final norm) at the positions that produced
        each response token; any float dtype (bf16 is upcast to fp32 where it is read).
      token_prob: [B, T] probability of the sampled token at the rollout temperature. With `hidden`
        gives the paper's last-layer proxy v = (1 - p) h (spec 2.0).
      advantages: [B] per sequence (e.g. GRPO) or [B, T] per token; sides are taken per token from
        its sign (P: A > 0, N: A < 0, Z: A = 0).
      mask: [B, T], 1 for valid response tokens, 0 for prompt/padding.
      num_refine: K, refinement rounds (paper default 1).
      lam_min, lam_max: range of lambda before normalisation (paper [0.8, 1.2]).
      features: precomputed proxy v [B, T, H] instead of hidden/token_prob (e.g. from
        `hidden_topk_proxy`); then pass hidden=None, token_prob=None.
      stats_mode: "global" (default): every sum runs over the whole batch, so the result does not
        depend on how the inputs are sharded. "per_shard": centroids, temperatures and the
        normaliser are computed separately on each data shard of `mesh` (the reference
        implementation's behaviour), via jax.shard_map.
      mesh, data_axes: for "per_shard": the mesh and the axis name(s) over which the batch
        dimension is split (B must be divisible by their total size). "global" mode does not
        read them: its sums over sharded inputs are partitioned by XLA (each shard reduced where
        it lives, the [2, H] / [2] statistics all-reduced), for either pass_impl.
      pass_impl: "jnp" (rl/delta.py's XLA code) or "kernel" (each of the K + 3 passes is one
        kernels.delta_pass call on (h, p), v never materialised; features= go through it
        with p = 0). Same results to fp32 rounding.
      ablations: an `Ablations` (the paper's ablation rows; None = the full method). The fused
        passes support all but assignment="hard" (a ValueError naming delta.assignment).
      key: PRNG key for ablations.random_lambda (required then, ignored otherwise): the draws are
        `lambda_noise(key, mask.shape)` over the whole batch, so every stats_mode / pass_impl sees
        the same per-token draws for the same key (per_shard mode normalises them per shard).

    Returns (no gradient flows through either):
      weights fp32 [B, T]: c * lambda, mean 1 over the valid tokens (of each shard in per_shard
        mode), 0 on padding, in [c lam_min, c lam_max] (without normalisation c = 1; with
        weight="alpha" lambda is in [0, 1], 0 on Z).
      diagnostics: dict of fp32 scalars, see `diagnostics`. In per_shard mode each value is the
        mean over shards of the shard's value, except token counts (summed) and weight min/max
        (min/max over shards).
    """
    _check_pass_impl(pass_impl)
    ablations = check_ablations(ablations, pass_impl)
    _check_key(ablations, key)
    return _delta_coefficients(hidden, token_prob, advantages, mask, num_refine, lam_min, lam_max,
                               features=features, stats_mode=stats_mode, mesh=mesh,
                               data_axes=data_axes, pass_impl=pass_impl, ablations=ablations,
                               key=key if ablations.random_lambda else None)


def _mesh_axes(mesh: Mesh, data_axes, batch: int):
    """The data axes as a tuple (B must split evenly over them)."""
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"delta_coefficients: data_axes {missing} not in mesh axes "
                         f"{mesh.axis_names}")
    num_shards = 1
    for a in axes:
        num_shards *= mesh.shape[a]
    if batch % num_shards:
        raise ValueError(f"delta_coefficients: batch size {batch} is not divisible by "
                         f"the {num_shards} data shards of axes {axes}")
    return axes


@functools.partial(jax.jit, static_argnames=("num_refine", "lam_min", "lam_max", "stats_mode",
                                             "mesh", "data_axes", "pass_impl", "ablations"))
def _delta_coefficients(hidden, token_prob, advantages, mask, num_refine, lam_min, lam_max, *,
                        features, stats_mode, mesh, data_axes, pass_impl, ablations, key):
    _check_lambda_range(lam_min, lam_max)
    # Spec 2: the coefficients are constants for the policy update.
    hidden, token_prob, advantages, mask, features = jax.lax.stop_gradient(
        (hidden, token_prob, advantages, mask, features))
    if features is not None:
        if hidden is not None or token_prob is not None:
            raise ValueError("delta_coefficients: pass either features= or hidden and token_prob, "
                             "not both")
        chunk = FeatureChunk(features, advantages, mask, None)
    else:
        if hidden is None or token_prob is None:
            raise ValueError("delta_coefficients: hidden and token_prob are required when "
                             "features= is not given")
        chunk = FeatureChunk(hidden, advantages, mask, 1.0 - token_prob.astype(jnp.float32))
    _check_chunk(chunk)
    if stats_mode not in ("global", "per_shard"):
        raise ValueError(f"delta_coefficients: stats_mode must be 'global' or 'per_shard', "
                         f"got {stats_mode!r}")
    fused = pass_impl == "kernel"
    # delta.random_lambda: one draw per token of the whole batch (sharded like the mask).
    noise = lambda_noise(key, mask.shape) if ablations.random_lambda else None

    def one_shot(c: FeatureChunk, p, u):
        if not fused:
            return _one_shot(c, num_refine, lam_min, lam_max, ablations, u)
        h, p, adv, m = _kernel_inputs(c, p)
        return _fused_one_shot(h, p, adv, m, num_refine, lam_min, lam_max, ablations, u)

    if stats_mode == "global":  # whole-batch sums: XLA partitions them over sharded inputs
        return one_shot(chunk, token_prob, noise)
    if mesh is None:
        raise ValueError("delta_coefficients: stats_mode='per_shard' needs mesh=")
    axes = _mesh_axes(mesh, data_axes, mask.shape[0])
    if chunk.feature_scale is None:
        chunk = chunk._replace(feature_scale=jnp.ones(mask.shape, jnp.float32))
    probs = (jnp.zeros(mask.shape, jnp.float32) if token_prob is None
             else token_prob.astype(jnp.float32))
    spec = PartitionSpec(axes)

    def per_shard(c: FeatureChunk, p, u):
        weights, diag = one_shot(c, p, u)
        return weights, {k: v[None] for k, v in diag.items()}

    weights, diag = jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec, spec),
                                  out_specs=(spec, spec))(chunk, probs, noise)
    return weights, _reduce_shard_diagnostics(diag)


# Per-chunk passes, compiled once per chunk shape for the streaming driver.
_accumulate_centroids_jit = jax.jit(accumulate_centroids, static_argnames=("ablations",))
_accumulate_margins_jit = jax.jit(accumulate_margins)
_accumulate_final_jit = jax.jit(accumulate_final,
                                static_argnames=("lam_min", "lam_max", "ablations"))


@functools.partial(jax.jit, static_argnames=("shape",))
def _chunk_noise(key: Array, index: int, shape: tuple[int, ...]) -> Array:
    """Streaming delta.random_lambda: the draws of chunk `index` (its position in the source)."""
    return lambda_noise(jax.random.fold_in(key, index), shape)


def delta_coefficients_streaming(chunks: Iterable[FeatureChunk] | Callable[[], Iterable],
                                 num_refine: int = 1, lam_min: float = 0.8, lam_max: float = 1.2,
                                 *, pass_impl: str = "jnp", ablations: Ablations | None = None,
                                 key: Array | None = None
                                 ) -> tuple[list[Array], dict[str, Array]]:
    """DelTA weights from feature chunks given one at a time (the same pieces as the one-shot form).

    chunks: a re-iterable sequence of `FeatureChunk`s, or a zero-argument callable returning a fresh
      iterable of them (e.g. one that recomputes hidden states chunk by chunk). It is iterated
      K + 3 times: initial centroids, temperatures, K refinement rounds, final lambdas.
      For the last-layer proxy give FeatureChunk(hidden, adv, mask, feature_scale=1 - token_prob).
      Chunks may split the batch over sequences and/or time; all statistics are token sums, so the
      result equals the one-shot result on the concatenated batch (up to fp32 summation order).
    Returns the list of weight chunks [b, t] (in chunk order) and the diagnostics dict.
    Only the [b, t] lambdas of the final pass are kept between chunks, never the features.
    pass_impl: as in `delta_coefficients` ("kernel": one fused pass per chunk and
    round, with p = 1 - feature_scale).
    ablations: as in `delta_coefficients` (with fixed_gamma the source is read K + 2 times).
    key: for ablations.random_lambda: chunk i (its position in each iteration of the source) draws
      `lambda_noise(fold_in(key, i), its mask shape)`. Deterministic for a given key and chunking,
      in [lam_min, lam_max]; NOT the one-shot form's draws (those are one draw over the batch).
    """
    _check_lambda_range(lam_min, lam_max)
    _check_pass_impl(pass_impl)
    ablations = check_ablations(ablations, pass_impl)
    _check_key(ablations, key)

    def noise(index: int, chunk: FeatureChunk):
        if not ablations.random_lambda:
            return None
        return _chunk_noise(key, index, tuple(chunk.mask.shape))

    if pass_impl == "kernel":
        return _streaming_fused(chunks, num_refine, lam_min, lam_max, ablations, noise)
    # The hidden size comes from the first chunk of the first pass: probing the source separately
    # would cost one more trunk pass when it recomputes features.
    get_chunks = chunks if callable(chunks) else (lambda: chunks)
    jitted = {accumulate_centroids: _accumulate_centroids_jit,
              accumulate_margins: _accumulate_margins_jit}

    def fold(update, state, *extra):
        for chunk in get_chunks():
            chunk = FeatureChunk(*chunk)
            if state is None:
                state = init_pass(chunk.features.shape[-1])
            state = jitted[update](state, chunk, *extra)
        if state is None:
            raise ValueError("delta_coefficients_streaming: no chunks")
        return state

    disc = fit_discriminator(fold, None, num_refine, ablations)
    final, lams = init_final(), []
    for i, chunk in enumerate(get_chunks()):
        chunk = FeatureChunk(*chunk)
        final, lam = _accumulate_final_jit(final, chunk, disc, lam_min=lam_min, lam_max=lam_max,
                                           ablations=ablations, noise=noise(i, chunk))
        lams.append(lam)
    c = normaliser(final, ablations)
    return [c * lam for lam in lams], diagnostics(disc, final, ablations)


@functools.partial(jax.jit, static_argnames=("use_alpha", "lam_range", "with_centroids"))
def _fused_chunk_pass(chunk: FeatureChunk, mu, gamma, *, use_alpha=True, lam_range=None,
                      with_centroids=True):
    h, p, adv, m = _kernel_inputs(chunk)
    return _kernel_pass(h, p, adv, m, mu, gamma, use_alpha=use_alpha,
                        lam_range=lam_range, with_centroids=with_centroids)


@functools.partial(jax.jit, static_argnames=("lam_min", "lam_max", "ablations"))
def _fused_chunk_final(stats: FinalStats, chunk: FeatureChunk, disc: Discriminator, noise, *,
                       lam_min, lam_max, ablations):
    h, p, adv, m = _kernel_inputs(chunk)
    sums = _kernel_pass(h, p, adv, m, disc.mu, disc.gamma,
                        lam_range=_lambda_range(lam_min, lam_max, ablations),
                        with_centroids=False)
    return _final_from_sums(sums, adv, m, lam_min, lam_max, ablations, noise, stats)


def _streaming_fused(chunks, num_refine, lam_min, lam_max, ablations, noise):
    """delta_coefficients_streaming with pass_impl="kernel"."""
    from delta_jax.kernels.delta_pass import add_sums

    get_chunks = chunks if callable(chunks) else (lambda: chunks)

    def pass_fn(mu, gamma, use_alpha=True, with_centroids=True):
        total = None
        for chunk in get_chunks():
            sums = _fused_chunk_pass(FeatureChunk(*chunk), mu, gamma, use_alpha=use_alpha,
                                     with_centroids=with_centroids)
            total = sums._replace(lam=None) if total is None else add_sums(total, sums)
        if total is None:
            raise ValueError("delta_coefficients_streaming: no chunks")
        return total

    disc = fit_discriminator_fused(pass_fn, None, num_refine, ablations)
    final, lams = init_final(), []
    for i, chunk in enumerate(get_chunks()):
        chunk = FeatureChunk(*chunk)
        final, lam = _fused_chunk_final(final, chunk, disc, noise(i, chunk), lam_min=lam_min,
                                        lam_max=lam_max, ablations=ablations)
        lams.append(lam)
    c = normaliser(final, ablations)
    return [c * lam for lam in lams], diagnostics(disc, final, ablations)


__all__: Sequence[str] = (
    "ASSIGNMENTS", "Ablations", "FULL_METHOD", "WEIGHTS", "check_ablations", "lambda_noise",
    "Discriminator", "FeatureChunk", "FinalStats", "PassStats", "accumulate_centroids",
    "PASS_IMPLS", "accumulate_final", "accumulate_margins", "add_final_lambdas",
    "delta_coefficients", "delta_coefficients_streaming",
    "diagnostics", "finalize_pass", "fit_discriminator", "fit_discriminator_fused",
    "hidden_topk_proxy",
    "hidden_topk_proxy_from_head", "init_final", "init_pass", "normaliser",
)
