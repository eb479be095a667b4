"""Policy-gradient objectives for RL from verifiable rewards, as (sum, denominator) pairs.

The per-token loss is the PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy
Optimization Algorithms", https://arxiv.org/abs/1707.06347) with
* clip-higher: separate eps_low / eps_high (DAPO, Yu et al. 2025, https://arxiv.org/abs/2503.14476),
* dual clip for negative advantages: loss <= -A * c (Ye et al. 2020, "Mastering Complex Control
  in MOBA Games with Deep RL", https://arxiv.org/abs/1912.09729),
* a clamp of the log-ratio before exp (numerical safety, as in verl),
* optionally a sequence-level ratio (GSPO, Zheng et al. 2025, "Group Sequence Policy
  Optimization", https://arxiv.org/abs/2507.18071): every token of response i uses
  s_i = exp(mean_t log(pi / pi_old)) in place of its own ratio, clipped like it, in GSPO-token's
  form log s_{i,t} = sg(log s_i) + log pi(y_t) - sg(log pi(y_t)); with per-sequence advantages
  its value and gradient are GSPO's sequence objective (seq-mean-token-mean aggregation),
  and per-token advantages or weights act per token as in GSPO-token,
* or, in place of the clipped surrogate, SAPO's soft gate (Gao et al. 2025, "Soft Adaptive Policy
  Optimization", https://arxiv.org/abs/2511.20347): l = -(4 / tau) sigmoid(tau (r - 1)) A with
  tau = tau_pos for A > 0 and tau_neg otherwise; its gradient is 4 s (1 - s) r A grad log pi
  (s the sigmoid), A grad log pi on policy (r = 1), fading smoothly as r leaves 1 instead of
  stopping at a clip boundary (surrogate="sapo"),
* optionally FIPO's future-KL influence weights on the clipped surrogate (Ma et al. 2026, "FIPO:
  Eliciting Deep Reasoning with Future-KL Influenced Policy Optimization",
  https://arxiv.org/abs/2603.19835; the DelTA paper's strongest 14B baseline): token t's loss
  is multiplied by f_t = clip(exp(FutureKL_t), 1 (or 1 - c), 1 + c), FutureKL_t =
  sum_{k >= t} gamma^(k - t) log(pi / pi_old)(y_k) over the response's tokens (gamma =
  2^(-1 / decay_rate); tokens past the dual-clip ratio left out of the sum), a constant of the
  gradient; a token of negative advantage whose ratio is over the safety threshold is never
  amplified (f_t <= 1); and a response with more than one token where the dual clip binds is
  left out of the loss (all its terms and the denominator; FIPO's code leaves it out of the
  surrogate's average, which is the same where, as in its recipe, there is no KL or entropy
  term). It acts from the second update of a rollout on (pi = pi_old before),
* optional per-token weights (e.g. DelTA coefficients, rl/delta.py) multiplying the per-token
  surrogate loss before aggregation; for positive weights this equals replacing A by A * w (spec
  2.8), because every branch of the clipped surrogate is linear in A (SAPO's too, for a given
  sign of A),
* optional KL penalty to a reference policy (k1 / k2 / k3 estimators, Schulman 2020, "Approximating
  KL Divergence", http://joschu.net/blog/kl-approx.html; GRPO, https://arxiv.org/abs/2402.03300,
  uses k3) and an entropy bonus.

Aggregation (verl's loss_agg_mode names), each returned as (loss_sum, denominator); the exact
global loss is sum(loss_sum) / sum(denominator) over micro-batches and devices:
* "token-mean": sum over valid tokens / number of valid tokens (DAPO; the paper's setting).
* "seq-mean-token-mean": per-sequence token mean, summed over sequences / number of sequences
  (GRPO's original form).
* "seq-mean-token-sum": per-sequence token sum, summed / number of sequences.
* "seq-mean-token-sum-norm": Dr. GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783): token
  sum divided by a constant (cfg.drgrpo_norm, e.g. the maximum response length) per sequence,
  summed / number of sequences.
"Number of sequences" counts rows with at least one valid token. For the seq-mean modes a caller
must split micro-batches along sequences (never one sequence across micro-batches) and divide the
total loss_sum by the total denominator; then the result equals the full-batch value exactly.

Metrics are returned as SUMS (dict of fp32 scalars) so they accumulate by plain addition over
micro-batches and devices; `finalize_metrics` turns accumulated sums into means using the count
keys "tokens" / "sequences" / "agg_denominator" named in METRIC_DENOMINATORS.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = (None, "k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
SURROGATES = ("clip", "sapo")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of `policy_loss`; the defaults are DAPO's / the DelTA paper's.

    eps_low, eps_high: ratio clip range [1 - eps_low, 1 + eps_high] (DAPO clip-higher 0.2 / 0.28).
    dual_clip: c > 1, bounds the loss of negative-advantage tokens by -A * c; None (or 0) disables.
    log_ratio_clamp: log(pi / pi_old) is clipped to [-x, x] before exp; None disables.
    agg: one of AGG_MODES. drgrpo_norm: the constant of "seq-mean-token-sum-norm" (required there).
    kl_type: None, "k1", "k2" or "k3"; kl_coef: its weight (needs ref_logp).
    entropy_coef: weight of the entropy bonus (subtracted from the loss; needs entropy).
    ratio_level: "token" (PPO's per-token ratio) or "sequence" (GSPO's length-normalised
      sequence ratio, see the module doc; its paper clips it at eps 3e-4 / 4e-4).
    surrogate: "clip" (the clipped surrogate: eps_low, eps_high, dual_clip) or "sapo" (SAPO's
      soft gate, which has no clip: sapo_tau_pos / sapo_tau_neg, its paper's 1.0 / 1.05, are the
      gate's temperatures for positive / other advantages; a larger tau fades off-policy tokens
      faster).
    fipo: multiply the clipped surrogate by FIPO's future-KL influence weights (module doc):
      fipo_decay_rate (gamma = 2^(-1 / decay_rate): the number of tokens over which a later
      token's log-ratio counts half), fipo_clip (c > 0) with fipo_clip_high_only (weights in
      [1, 1 + c], else [1 - c, 1 + c]), fipo_safety_threshold (a ratio above which a
      negative-advantage token's weight is capped at 1; None or 0: off). Tokens whose ratio is
      over dual_clip are left out of the future sums, and a response with more than one token
      where the dual clip binds (A < 0, ratio over dual_clip) out of the loss.
    """
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = 10.0
    log_ratio_clamp: float | None = 20.0
    agg: str = "token-mean"
    drgrpo_norm: float | None = None
    kl_type: str | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    ratio_level: str = "token"
    surrogate: str = "clip"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    fipo: bool = False
    fipo_decay_rate: float = 32.0
    fipo_clip: float = 0.2
    fipo_clip_high_only: bool = True
    fipo_safety_threshold: float | None = 4.0

    def __post_init__(self):
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise ValueError(f"PolicyLossConfig: need 0 <= eps_low < 1 and eps_high >= 0, got "
                             f"eps_low={self.eps_low}, eps_high={self.eps_high}")
        if self.dual_clip not in (None, 0, 0.0) and not self.dual_clip > 1.0 + self.eps_high:
            raise ValueError(f"PolicyLossConfig: dual_clip must be None/0 or > 1 + eps_high, "
                             f"got {self.dual_clip}")
        if self.log_ratio_clamp is not None and not self.log_ratio_clamp > 0:
            raise ValueError(f"PolicyLossConfig: log_ratio_clamp must be > 0 or None, "
                             f"got {self.log_ratio_clamp}")
        if self.agg not in AGG_MODES:
            raise ValueError(f"PolicyLossConfig: agg must be one of {AGG_MODES}, got {self.agg!r}")
        if self.agg == "seq-mean-token-sum-norm" and not (self.drgrpo_norm or 0) > 0:
            raise ValueError("PolicyLossConfig: agg='seq-mean-token-sum-norm' needs "
                             "drgrpo_norm > 0 (Dr. GRPO's constant, e.g. the maximum response "
                             "length)")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"PolicyLossConfig: kl_type must be one of {KL_TYPES}, "
                             f"got {self.kl_type!r}")
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"PolicyLossConfig: ratio_level must be one of {RATIO_LEVELS}, "
                             f"got {self.ratio_level!r}")
        if self.surrogate not in SURROGATES:
            raise ValueError(f"PolicyLossConfig: surrogate must be one of {SURROGATES}, "
                             f"got {self.surrogate!r}")
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"PolicyLossConfig: sapo_tau_pos and sapo_tau_neg must be > 0, got "
                             f"{self.sapo_tau_pos}, {self.sapo_tau_neg}")
        if self.fipo and self.surrogate != "clip":
            raise ValueError("PolicyLossConfig: fipo weights the clipped surrogate; got "
                             f"surrogate={self.surrogate!r}")
        if not (self.fipo_decay_rate > 0 and self.fipo_clip > 0
                and (self.fipo_safety_threshold or 0) >= 0):
            raise ValueError(f"PolicyLossConfig: need fipo_decay_rate > 0, fipo_clip > 0 and "
                             f"fipo_safety_threshold >= 0 (or None), got {self.fipo_decay_rate}, "
                             f"{self.fipo_clip}, {self.fipo_safety_threshold}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("PolicyLossConfig: kl_coef and entropy_coef must be >= 0")


# ----------------------------------------------------------------------------- per-token pieces


def clipped_surrogate(log_ratio: Array, advantages: Array, eps_low: float, eps_high: float,
                      dual_clip: float | None) -> tuple[Array, dict[str, Array]]:
    """Per-token PPO / DAPO loss (to minimise) and clip indicators, all [B, T].

    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) with r = exp(log_ratio); with dual clip,
    for A < 0: l = min(l, -A c). Indicators (float 0/1): "low" (A < 0 and the clipped branch is
    active, r < 1 - eps_low), "high" (A > 0, r > 1 + eps_high), "dual" (the dual bound is active).
    """
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    flags = {"low": clip_active & (advantages < 0), "high": clip_active & (advantages > 0)}
    if dual_clip:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss > bound)
        loss = jnp.where(dual_active, bound, loss)
        flags["dual"] = dual_active
    else:
        flags["dual"] = jnp.zeros_like(clip_active)
    return loss, {k: v.astype(loss.dtype) for k, v in flags.items()}


def soft_gate_surrogate(log_ratio: Array, advantages: Array, tau_pos: float, tau_neg: float
                        ) -> tuple[Array, Array]:
    """Per-token SAPO loss (to minimise) and gradient gate, both [B, T].

    l = -(4 / tau) sigmoid(tau (r - 1)) A with r = exp(log_ratio), tau = tau_pos where A > 0,
    tau_neg elsewhere. gate = 4 s (1 - s), s = sigmoid(tau (r - 1)): what the token's policy
    gradient keeps (dl/dlog pi = -gate r A; gate = 1 at r = 1, falling towards 0 off policy).
    """
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg).astype(ratio.dtype)
    s = jax.nn.sigmoid(tau * (ratio - 1.0))
    return -(4.0 / tau) * s * advantages, jax.lax.stop_gradient(4.0 * s * (1.0 - s))


def future_sums(x: Array, gamma: float) -> Array:
    """y_t = sum_{k >= t} gamma^(k - t) x_k along the last axis, [..., T] (a reversed first-order
    linear recurrence y_t = x_t + gamma y_{t+1}, as an associative scan: log T steps, no
    gamma^T underflow however long the response)."""
    def combine(earlier, later):  # segments of the reversed sequence: (gamma^len, partial sum)
        (a1, b1), (a2, b2) = earlier, later
        return a1 * a2, a2 * b1 + b2

    rev = jnp.flip(x, axis=-1)
    _, out = jax.lax.associative_scan(combine, (jnp.full_like(rev, gamma), rev), axis=-1)
    return jnp.flip(out, axis=-1)


def fipo_weights(token_log_ratio: Array, advantages: Array, valid: Array, cfg: "PolicyLossConfig"
                 ) -> tuple[Array, Array]:
    """FIPO's influence weights and the Future-KL they come from, both [B, T], no gradient (module
    doc): FutureKL_t = sum_{k >= t} gamma^(k - t) d_k over the row's valid tokens, d the token
    log-ratio, 0 where the ratio is over cfg.dual_clip; f = clip(exp(FutureKL), 1 or 1 - c,
    1 + c), capped at 1 for A < 0 tokens whose ratio is over cfg.fipo_safety_threshold; 0 on
    padding."""
    d = jax.lax.stop_gradient(token_log_ratio)
    ratio = jnp.exp(d)
    keep = valid if not cfg.dual_clip else valid & (ratio <= cfg.dual_clip)
    future_kl = jnp.where(valid, future_sums(jnp.where(keep, d, 0.0),
                                             2.0 ** (-1.0 / cfg.fipo_decay_rate)), 0.0)
    low = 1.0 if cfg.fipo_clip_high_only else 1.0 - cfg.fipo_clip
    weight = jnp.clip(jnp.exp(future_kl), low, 1.0 + cfg.fipo_clip)
    if cfg.fipo_safety_threshold:
        risky = (advantages < 0) & (ratio > cfg.fipo_safety_threshold)
        weight = jnp.where(risky, jnp.minimum(weight, 1.0), weight)
    return jnp.where(valid, weight, 0.0), future_kl


def sequence_log_ratio(token_log_ratio: Array, logp: Array, valid: Array) -> Array:
    """GSPO-token's log s_{i,t} = sg(log s_i) + log pi(y_t) - sg(log pi(y_t)), [B, T]: the value
    of every valid token of row i is log s_i, the mean of the row's token log-ratios over its
    valid tokens, and its gradient is that of log pi(y_t) (0 on padding; a row without valid
    tokens gets 0)."""
    sg = jax.lax.stop_gradient
    count = valid.sum(axis=-1, keepdims=True)
    seq = jnp.where(valid, token_log_ratio, 0.0).sum(axis=-1, keepdims=True) / jnp.maximum(
        count, 1)
    logp = jnp.where(valid, logp, 0.0)
    return sg(seq) + logp - sg(logp)


def kl_penalty(logp: Array, ref_logp: Array, kl_type: str, log_ratio_clamp: float | None = 20.0
               ) -> Array:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's estimators), [B, T].

    k1 = log pi - log pi_ref; k2 = (log pi - log pi_ref)^2 / 2;
    k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 (unbiased, >= 0; GRPO's choice).
    """
    diff = logp - ref_logp
    if kl_type == "k1":
        return diff
    if kl_type == "k2":
        return 0.5 * jnp.square(diff)
    if kl_type == "k3":
        neg = -diff if log_ratio_clamp is None else jnp.clip(-diff, -log_ratio_clamp,
                                                               log_ratio_clamp)
        return jnp.exp(neg) - neg - 1.0
    raise ValueError(f"kl_penalty: unknown kl_type {kl_type!r}; choose k1, k2 or k3")


def aggregate(per_token: Array, mask: Array, agg: str, drgrpo_norm: float | None = None
              ) -> tuple[Array, Array]:
    """(sum, denominator) of a per-token quantity [B, T] under an aggregation mode (see module doc).

    token-mean: (sum m l, sum m). seq-mean-token-mean: (sum_b mean_t l, #seqs).
    seq-mean-token-sum: (sum_b sum_t l, #seqs).
    seq-mean-token-sum-norm: (sum_b sum_t l / norm, #seqs).
    """
    mask = mask.astype(per_token.dtype)
    token_sums = (per_token * mask).sum(axis=-1)  # [B]
    tokens_per_seq = mask.sum(axis=-1)
    num_seqs = (tokens_per_seq > 0).sum().astype(mask.dtype)
    if agg == "token-mean":
        return token_sums.sum(), tokens_per_seq.sum()
    if agg == "seq-mean-token-mean":
        return (token_sums / jnp.maximum(tokens_per_seq, 1.0)).sum(), num_seqs
    if agg == "seq-mean-token-sum":
        return token_sums.sum(), num_seqs
    if agg == "seq-mean-token-sum-norm":
        if not (drgrpo_norm or 0) > 0:
            raise ValueError("aggregate: 'seq-mean-token-sum-norm' needs drgrpo_norm > 0")
        return token_sums.sum() / drgrpo_norm, num_seqs
    raise ValueError(f"aggregate: agg must be one of {AGG_MODES}, got {agg!r}")


# ----------------------------------------------------------------------------- the loss


def _upcast(x: Array) -> Array:
    """At least fp32 (fp64 stays fp64, for float64 gradient checks)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _check(name: str, x: Array | None, shape: tuple[int, ...]) -> None:
    if x is not None and x.shape != shape:
        raise ValueError(f"policy_loss: {name} must have shape {shape}, got {x.shape}")


def policy_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                token_weights: Array | None = None, cfg: PolicyLossConfig = PolicyLossConfig(),
                ref_logp: Array | None = None, entropy: Array | None = None
                ) -> tuple[Array, Array, dict[str, Array]]:
    """Policy-gradient loss of one micro-batch as (loss_sum, denominator, metric sums).

    Args:
      logp: [B, T] log pi(y_t) under the current policy (differentiated).
      old_logp: [B, T] log pi_old(y_t) from the rollout policy.
      advantages: [B] per sequence or [B, T] per token.
      mask: [B, T], 1 for valid response tokens.
      token_weights: optional [B, T] non-negative weights (e.g. DelTA), multiply the surrogate's
        per-token loss (not the KL or entropy terms); treated as constants.
      cfg: PolicyLossConfig (the clipped surrogate or SAPO's soft gate: cfg.surrogate; FIPO's
        weights on the former: cfg.fipo).
      ref_logp: [B, T] reference-policy log-probs, required when cfg.kl_type is set.
      entropy: [B, T] per-token policy entropy, required when cfg.entropy_coef > 0 (differentiated),
        reported in the metrics when given.

    Returns:
      loss_sum, denominator: fp32 scalars; the loss is loss_sum / denominator, and over
        micro-batches / devices sum(loss_sum) / sum(denominator) (see the module doc for the
        seq-mean modes). Per token: w * surrogate + kl_coef * kl - entropy_coef * entropy.
      metrics: fp32 scalar sums, see METRIC_DENOMINATORS and `finalize_metrics`.
    """
    shape = logp.shape
    if logp.ndim != 2:
        raise ValueError(f"policy_loss: logp must be [B, T], got {logp.shape}")
    _check("old_logp", old_logp, shape)
    _check("mask", mask, shape)
    _check("token_weights", token_weights, shape)
    _check("ref_logp", ref_logp, shape)
    _check("entropy", entropy, shape)
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"policy_loss: advantages must be [B] = {shape[:1]} or [B, T] = {shape}, "
                         f"got {advantages.shape}")
    if cfg.kl_type is not None and ref_logp is None:
        raise ValueError(f"policy_loss: kl_type={cfg.kl_type!r} needs ref_logp")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("policy_loss: entropy_coef > 0 needs entropy")

    sg = jax.lax.stop_gradient
    logp = _upcast(logp)
    mask = _upcast(mask)
    adv = sg(_upcast(advantages))
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, shape)
    # Padding may hold anything (even inf): select it away rather than multiply by the mask.
    valid = mask > 0
    token_log_ratio = logp - sg(_upcast(old_logp))
    if cfg.log_ratio_clamp is not None:
        token_log_ratio = jnp.clip(token_log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    log_ratio = (token_log_ratio if cfg.ratio_level == "token"
                 else sequence_log_ratio(token_log_ratio, logp, valid))
    if cfg.surrogate == "sapo":
        surrogate, gate = soft_gate_surrogate(log_ratio, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        no_clip = jnp.zeros_like(surrogate)  # nothing is clipped
        flags = {"low": no_clip, "high": no_clip, "dual": no_clip}
    else:
        surrogate, flags = clipped_surrogate(log_ratio, adv, cfg.eps_low, cfg.eps_high,
                                             cfg.dual_clip)
    loss_mask = mask  # the tokens the loss averages over
    if cfg.fipo:
        fipo_w, future_kl = fipo_weights(token_log_ratio, adv, valid, cfg)
        surrogate = surrogate * fipo_w
        # FIPO leaves a response with more than one dual-clipped token out of the loss
        fipo_dropped = jnp.where(valid, flags["dual"], 0.0).sum(axis=-1) > 1  # [B]
        loss_mask = jnp.where(fipo_dropped[:, None], 0.0, mask)
    pg = surrogate if token_weights is None else surrogate * sg(_upcast(token_weights))
    pg = jnp.where(loss_mask > 0, pg, 0.0)
    per_token = pg
    pg_sum, denom = aggregate(pg, loss_mask, cfg.agg, cfg.drgrpo_norm)

    def token_sum(x):
        return jnp.where(valid, x, 0.0).sum()

    # The ratio the surrogate used (per token, or its sequence's); KL(pi_old || pi) per token.
    ratio = jnp.where(valid, jnp.exp(sg(log_ratio)), 0.0)
    neg_log_ratio = -sg(token_log_ratio)
    metrics = {
        "tokens": mask.sum(),
        "sequences": (mask.sum(-1) > 0).sum().astype(mask.dtype),
        "agg_denominator": denom,
        "pg_loss": sg(pg_sum),
        "clip_frac_low": token_sum(flags["low"]),
        "clip_frac_high": token_sum(flags["high"]),
        "clip_frac_dual": token_sum(flags["dual"]),
        "ratio_mean": ratio.sum(),
        "ratio_sq": jnp.square(ratio).sum(),
        # KL(pi_old || pi) from samples of pi_old: k1 and k3 (as verl's ppo_kl, low variance).
        "approx_kl_k1": token_sum(neg_log_ratio),
        "approx_kl": token_sum(jnp.exp(-neg_log_ratio) - 1.0 + neg_log_ratio),
    }
    if cfg.surrogate == "sapo":  # the mean share of the policy gradient the gate keeps
        metrics["sapo_gate"] = token_sum(gate)
    if cfg.fipo:  # the mean influence weight and Future-KL over the valid tokens
        metrics["fipo_weight"] = token_sum(fipo_w)
        metrics["fipo_future_kl"] = token_sum(future_kl)
        metrics["fipo_dropped"] = fipo_dropped.sum().astype(mask.dtype)  # over the sequences
    if cfg.kl_type is not None:
        kl = kl_penalty(logp, sg(_upcast(ref_logp)), cfg.kl_type, cfg.log_ratio_clamp)
        kl = jnp.where(valid, kl, 0.0)
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl"] = sg(token_sum(kl))
    if entropy is not None:
        ent = jnp.where(valid, _upcast(entropy), 0.0)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * ent
        metrics["entropy"] = sg(ent.sum())
    loss_sum, _ = aggregate(per_token, loss_mask, cfg.agg, cfg.drgrpo_norm)
    return loss_sum, denom, metrics


# Which accumulated count divides each metric sum (ratio_sq is folded into ratio_std).
METRIC_DENOMINATORS = {
    "pg_loss": "agg_denominator",
    "clip_frac_low": "tokens",
    "clip_frac_high": "tokens",
    "clip_frac_dual": "tokens",
    "ratio_mean": "tokens",
    "approx_kl_k1": "tokens",
    "approx_kl": "tokens",
    "kl": "tokens",
    "entropy": "tokens",
    "sapo_gate": "tokens",
    "fipo_weight": "tokens",
    "fipo_future_kl": "tokens",
    "fipo_dropped": "sequences",
}


def finalize_metrics(sums: dict[str, Array]) -> dict[str, Array]:
    """Means from metric sums accumulated (by addition) over micro-batches and devices.

    Each key of METRIC_DENOMINATORS present in `sums` becomes sum / max(count, 1); "ratio_std" is
    the population std of the ratio over tokens; the counts are passed through; unknown keys too.
    """
    out = {}
    for key, value in sums.items():
        if key == "ratio_sq":
            continue
        den = METRIC_DENOMINATORS.get(key)
        out[key] = value if den is None else value / jnp.maximum(sums[den], 1.0)
    if "ratio_sq" in sums and "ratio_mean" in sums:
        n = jnp.maximum(sums["tokens"], 1.0)
        mean = sums["ratio_mean"] / n
        out["ratio_std"] = jnp.sqrt(jnp.maximum(sums["ratio_sq"] / n - jnp.square(mean), 0.0))
    return out
