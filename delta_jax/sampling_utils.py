"""Token filtering and sampling math for the rollout engine: pure, jittable functions.

Definitions (the ones every caller and test relies on):

* Tempered distribution: softmax(z / T) over the whole vocabulary, computed in fp32.
* Candidate order: tokens sorted by (-z / T, token id), i.e. larger logit first and, among equal
  logits, the smaller token id first. This makes top-k and top-p deterministic under ties.
* top-k (k > 0): keep the first k tokens of the candidate order (exactly k, even under ties).
  k = -1 (or k >= V) disables it.
* top-p (0 < p <= 1): applied after top-k, on the tempered distribution renormalised over the top-k
  set. Keep the smallest prefix of the candidate order whose probability mass is >= p, i.e. token at
  sorted position i is kept iff the mass of the tokens strictly before it is < p. The first token is
  always kept. p = 1 disables it.
* Sampling distribution: the tempered distribution restricted to the kept set and renormalised.
* Greedy (T = 0): the first token of the candidate order (argmax, smallest id under ties). Its
  log-probs are reported under softmax(z) (the T = 1 convention), since the point mass it samples
  from has log-prob 0 everywhere and would carry no information.

Sorting happens only when needed: `jax.lax.top_k` when 0 < k < V (it orders equal values by lower
index first), a full stable sort only when top-p < 1 without top-k, nothing otherwise.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters (python scalars).

    temperature: >= 0; 0 means greedy. top_p: in (0, 1]. top_k: -1 (off) or >= 1.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self):
        validate_sampling_params(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def effective_top_k(self, vocab_size: int) -> int:
        """top_k as a static int for the jitted code: -1 when it filters nothing (k >= V)."""
        return -1 if (self.top_k == -1 or self.top_k >= vocab_size) else int(self.top_k)

    @property
    def use_top_p(self) -> bool:
        return self.top_p < 1.0


def validate_sampling_params(temperature, top_p, top_k) -> None:
    """Raise ValueError naming the argument when a sampling parameter is invalid."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an int (-1 = off, or >= 1), got {top_k!r}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k!r}")


def tempered_logits(logits: jax.Array, temperature) -> jax.Array:
    """z / T in fp32. logits [..., V]; temperature a scalar (array or python float) > 0."""
    return logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)


def sorted_candidates(scaled: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Candidates in (-value, token id) order.

    scaled: fp32 [B, V]. top_k: static int; 0 < top_k < V keeps k candidates, -1 sorts all V.
    Returns (values [B, K], token ids int32 [B, K]).
    """
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        values, ids = jax.lax.top_k(scaled, top_k)  # equal values: lower index first
        return values, ids.astype(jnp.int32)
    ids = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)
    # A stable ascending sort of -value keeps equal values in token-id order.
    neg_values, ids = jax.lax.sort((-scaled, ids), dimension=-1, is_stable=True, num_keys=1)
    return -neg_values, ids


def top_p_keep_mask(sorted_values: jax.Array, top_p) -> jax.Array:
    """Smallest prefix of the sorted candidates with mass >= top_p (always >= 1 token).

    sorted_values: fp32 [B, K] in descending order (the distribution is their softmax).
    top_p: scalar in (0, 1]. Returns bool [B, K].
    """
    probs = jax.nn.softmax(sorted_values, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < jnp.asarray(top_p, jnp.float32)
    return keep.at[..., 0].set(True)


def filtered_candidates(
    logits: jax.Array, temperature, top_p, *, top_k: int, use_top_p: bool
) -> tuple[jax.Array, jax.Array | None]:
    """The sampling distribution's support as masked candidate logits.

    logits [B, V]; temperature > 0 and top_p scalars (may be traced); top_k, use_top_p static.
    Returns (values fp32 [B, K], ids int32 [B, K] or None). Dropped candidates have value -inf.
    ids is None when nothing is filtered: then values are the tempered logits over all V tokens.
    """
    scaled = tempered_logits(logits, temperature)
    if top_k == -1 and not use_top_p:
        return scaled, None
    values, ids = sorted_candidates(scaled, top_k)
    if use_top_p:
        keep = top_p_keep_mask(values, top_p)
        values = jnp.where(keep, values, -jnp.inf)
    return values, ids


# categorical()'s most slabs a row: the largest power of two dividing the row's length, up to
# this (151,936 Qwen3 tokens: 128 slabs of 1,187).
_MAX_SLABS = 1024


def _pick(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, the index i with cum[i - 1] <= u * total < cum[i] (cum: the running sum of
    weights [B, n] >= 0, some positive): i drawn with probability weights[i] / total. An index of
    weight 0 is never returned (its interval is empty; rounding that puts u * total at or past
    the total falls back to the last index of positive weight). u [B] in [0, 1)."""
    cum = jnp.cumsum(weights, axis=-1)
    target = u * cum[:, -1]
    index = jnp.sum(cum <= target[:, None], axis=-1)
    last = jnp.max(jnp.where(weights > 0, jnp.arange(weights.shape[-1]), -1), axis=-1)
    return jnp.clip(jnp.minimum(index, last), 0, weights.shape[-1] - 1).astype(jnp.int32)


def categorical(keys: jax.Array, values: jax.Array, *, max_slabs: int = _MAX_SLABS
                ) -> tuple[jax.Array, jax.Array]:
    """One draw per row from softmax(values) and its log-probability: keys [B] PRNG keys, values
    fp32 [B, K] (-inf excluded, at least one finite) -> (int32 [B], fp32 [B]).

    By inverse CDF over three levels, a uniform each: a slab of the row by its probability mass,
    then a block of the slab, then a candidate of the block (P(token) = its slab's mass x its
    block's share of the slab x its share of the block = its probability; each level's uniform
    resolves that level's masses). The slabs are S equal, contiguous parts of the row, S the
    largest power of two dividing K (at most max_slabs; 128 slabs of 1,187 for the Qwen3
    vocabulary), so a row split over devices in equal contiguous parts (the logits' vocabulary
    over a "tensor" mesh axis of 2, 4, ... devices) keeps whole slabs on each device: the slab
    masses are local sums and only the chosen slab's W = K / S values move. The slab's blocks are
    w of w candidates (w * w >= W, padded). Its cost is three uniforms a row and two reads of the
    values (their maximum, then their exponentials summed by slab), where
    jax.random.categorical's Gumbel arg-max hashes one Gumbel variate per candidate: 151,936 a
    row for the Qwen3 vocabulary (65 us of a 2.8 ms batch-64 decode step on an H200,
    2026-11-26). The log-probability's normaliser is the row's maximum plus the log of the slab
    masses' sum: no third read of the values (a logsumexp's sum over the row was one, 8.4 us of
    that step on the H200, 2026-11-27)."""
    B, K = values.shape
    S = min(K & -K, max_slabs)                              # a power of two dividing K
    W = K // S
    w = math.isqrt(W - 1) + 1                               # w * w >= W
    u = jax.vmap(lambda k: jax.random.uniform(k, (3,), jnp.float32))(keys)
    top = jnp.max(values, axis=-1, keepdims=True)
    e = jnp.exp(values - top).reshape(B, S, W)             # 0 where excluded
    masses = e.sum(axis=2)                                  # [B, S]; their sum >= 1 (the top)
    slab = _pick(masses, u[:, 0])
    e = jnp.take_along_axis(e, slab[:, None, None], axis=1)[:, 0]            # [B, W]
    e = jnp.pad(e, ((0, 0), (0, w * w - W))).reshape(B, w, w)
    block = _pick(e.sum(axis=2), u[:, 1])
    e = jnp.take_along_axis(e, block[:, None, None], axis=1)[:, 0]          # [B, w]
    choice = slab * W + block * w + _pick(e, u[:, 2])
    log_normaliser = top[:, 0] + jnp.log(masses.sum(axis=1))
    chosen = jnp.take_along_axis(values, choice[:, None], axis=1)[:, 0]
    return choice, chosen - log_normaliser


def sample_tokens(
    keys: jax.Array,
    logits: jax.Array,
    temperature,
    top_p,
    *,
    top_k: int,
    use_top_p: bool,
    greedy: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token per row.

    keys: [B] PRNG keys (one independent stream per row). logits: [B, V] (any float dtype).
    temperature, top_p: scalars (may be traced; temperature ignored when greedy).
    top_k (-1 = off), use_top_p, greedy: static.
    Returns (tokens int32 [B],
             logprobs fp32 [B]: log-prob under the sampling distribution (filtered, tempered,
                               renormalised),
             tempered_logprobs fp32 [B]: log-prob under softmax(z / T) without filtering).
    Greedy rows report both log-probs under softmax(z) (T = 1).
    """
    logits = logits.astype(jnp.float32)
    rows = jnp.arange(logits.shape[0])
    if greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # first maximum = smallest id
        logp = jax.nn.log_softmax(logits, axis=-1)[rows, tokens]
        return tokens, logp, logp
    # Only the drawn tokens' log-probs are needed (no [B, V] log-prob array): the draw's own
    # under the sampling distribution, and the tempered one's from a gather and its normaliser.
    values, ids = filtered_candidates(logits, temperature, top_p, top_k=top_k, use_top_p=use_top_p)
    choice, chosen_logp = categorical(keys, values)
    if ids is None:  # nothing filtered: the sampling distribution is the tempered one
        return choice, chosen_logp, chosen_logp
    scaled = tempered_logits(logits, temperature)
    tokens = ids[rows, choice]
    return tokens, chosen_logp, scaled[rows, tokens] - jax.nn.logsumexp(scaled, axis=-1)
