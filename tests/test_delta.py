"""DelTA coefficients vs an independent float64 NumPy transcription of DELTA_SPEC section 2
(tests/delta_reference.py: written from the spec text, never calls delta_jax)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from delta_jax.rl import delta as D
from tests.delta_reference import make_batch, proxy64, reference_delta


def _assert_weights(got, want, mask, rtol=1e-5):
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-7)
    assert np.all(got[mask == 0] == 0.0)


def _assert_diagnostics(diag, want, info):
    """Every diagnostic vs the reference's weights `want` and its info."""
    np.testing.assert_allclose([diag["gamma_pos"], diag["gamma_neg"]], info["gamma"], rtol=1e-4)
    np.testing.assert_allclose(diag["normaliser"], info["c"], rtol=1e-5)
    np.testing.assert_allclose(diag["disc_accuracy"], info["accuracy"], rtol=1e-6)
    np.testing.assert_allclose([diag["tokens_pos"], diag["tokens_neg"], diag["tokens_zero"]],
                               info["tokens"])
    norms = [np.linalg.norm(m) for m in info["mu"]]
    np.testing.assert_allclose([diag["centroid_norm_pos"], diag["centroid_norm_neg"]], norms,
                               rtol=1e-5, atol=1e-6)
    cos = info["mu"][0] @ info["mu"][1] / max(norms[0] * norms[1], 1e-30)
    np.testing.assert_allclose(diag["centroid_cosine"], cos, rtol=1e-5, atol=1e-6)
    for i, name in enumerate(("pos", "neg", "zero")):
        side_w = np.array([want[k] for k in info["sides"][i]])
        np.testing.assert_allclose(diag[f"weight_mean_{name}"], side_w.mean(), rtol=1e-5,
                                   atol=1e-7)
        np.testing.assert_allclose(diag[f"weight_std_{name}"], side_w.std(), rtol=1e-4,
                                   atol=1e-6)
        np.testing.assert_allclose(diag[f"weight_min_{name}"], side_w.min(), rtol=1e-5,
                                   atol=1e-7)
        np.testing.assert_allclose(diag[f"weight_max_{name}"], side_w.max(), rtol=1e-5,
                                   atol=1e-7)


# ----------------------------------------------------------------------------- vs reference


@pytest.mark.parametrize("num_refine", [0, 1, 2, 3])
def test_matches_numpy_reference(num_refine):
    for seed in (0, 1):
        hidden, prob, adv, mask = make_batch(seed + 10 * num_refine)
        got, diag = D.delta_coefficients(jnp.asarray(hidden), jnp.asarray(prob), jnp.asarray(adv),
                                         jnp.asarray(mask), num_refine=num_refine)
        want, info = reference_delta(proxy64(hidden, prob), adv, mask, num_refine)
        _assert_weights(got, want, mask)
        _assert_diagnostics(diag, want, info)


def test_token_level_advantages_and_bf16_hidden():
    hidden, prob, adv, mask = make_batch(3)
    rng = np.random.default_rng(3)
    # Per-token advantages with mixed signs inside a sequence: sides are taken per token.
    adv_tok = adv[:, None] * rng.uniform(0.5, 1.5, size=mask.shape)
    adv_tok[0, :3] *= -1.0
    adv_tok[1, 1] = 0.0
    hidden_bf16 = jnp.asarray(hidden, jnp.bfloat16)
    got, _ = D.delta_coefficients(hidden_bf16, jnp.asarray(prob), jnp.asarray(adv_tok, jnp.float32),
                                  jnp.asarray(mask))
    # The reference sees exactly the bf16 values, upcast to float64.
    hidden_seen = np.asarray(hidden_bf16.astype(jnp.float32), np.float64)
    want, _ = reference_delta(proxy64(hidden_seen, prob), adv_tok.astype(np.float32), mask, 1)
    _assert_weights(got, want, mask)


def test_hidden_topk_proxy_matches_numpy_and_feeds_coefficients():
    rng = np.random.default_rng(4)
    B, T, H, V, K = 4, 5, 6, 11, 3
    head = rng.normal(size=(H, V)).astype(np.float32)
    logits = rng.normal(size=(B, T, V))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    labels = rng.integers(0, V, size=(B, T))
    topk_ids = np.argsort(-probs, axis=-1)[..., :K]
    topk_probs = np.take_along_axis(probs, topk_ids, -1)
    want = np.zeros((B, T, H))
    for b in range(B):
        for t in range(T):
            p_tilde = topk_probs[b, t] / topk_probs[b, t].sum()
            want[b, t] = head[:, labels[b, t]] - sum(
                p_tilde[j] * head[:, topk_ids[b, t, j]] for j in range(K))
    got = D.hidden_topk_proxy_from_head(jnp.asarray(head), jnp.asarray(labels),
                                        jnp.asarray(topk_ids), jnp.asarray(topk_probs, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    got_rows = D.hidden_topk_proxy(jnp.asarray(head.T[labels]), jnp.asarray(head.T[topk_ids]),
                                   jnp.asarray(topk_probs, jnp.float32))
    np.testing.assert_allclose(got_rows, want, rtol=1e-5, atol=1e-5)

    adv = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
    mask = np.ones((B, T), np.float32)
    mask[2, 3:] = 0
    for num_refine in (0, 1, 2, 3):
        weights, _ = D.delta_coefficients(None, None, jnp.asarray(adv), jnp.asarray(mask),
                                          num_refine=num_refine, features=got)
        ref, _ = reference_delta(np.asarray(got, np.float64), adv, mask, num_refine)
        _assert_weights(weights, ref, mask)


def test_coefficients_carry_no_gradient():
    hidden, prob, adv, mask = make_batch(5)
    # The coefficients are constants of the policy update (spec 2).
    grad = jax.grad(lambda h: jnp.sum(D.delta_coefficients(h, prob, adv, mask)[0] ** 2))(
        jnp.asarray(hidden))
    assert np.all(np.asarray(grad) == 0)


# ----------------------------------------------------------------------------- properties


def test_range_mean_padding_and_permutation_invariance():
    hidden, prob, adv, mask = make_batch(6)
    lam_min, lam_max = 0.7, 1.4
    w, diag = D.delta_coefficients(hidden, prob, adv, mask, num_refine=1, lam_min=lam_min,
                                   lam_max=lam_max)
    w = np.asarray(w)
    c = float(diag["normaliser"])
    valid = mask > 0
    assert np.all(w[valid] >= c * lam_min * (1 - 1e-6))
    assert np.all(w[valid] <= c * lam_max * (1 + 1e-6))
    np.testing.assert_allclose(w[valid].mean(), 1.0, rtol=1e-6)
    assert w[valid].std() > 1e-3  # the weights do discriminate

    # Extra padding columns (with garbage, including NaN) change nothing.
    B, T, H = hidden.shape
    pad = 4
    hidden_p = np.concatenate([hidden, np.full((B, pad, H), np.nan, np.float32)], axis=1)
    prob_p = np.concatenate([prob, np.full((B, pad), np.nan, np.float32)], axis=1)
    mask_p = np.concatenate([mask, np.zeros((B, pad), np.float32)], axis=1)
    w_p, _ = D.delta_coefficients(hidden_p, prob_p, adv, mask_p, lam_min=lam_min, lam_max=lam_max)
    np.testing.assert_allclose(np.asarray(w_p)[:, :T], w, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(w_p)[:, T:] == 0)

    # Permuting sequences permutes the weights.
    perm = np.random.default_rng(0).permutation(B)
    w_perm, _ = D.delta_coefficients(hidden[perm], prob[perm], adv[perm], mask[perm],
                                     lam_min=lam_min, lam_max=lam_max)
    np.testing.assert_allclose(np.asarray(w_perm), w[perm], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("num_refine", [0, 2, 3])
def test_streaming_equals_one_shot(num_refine):
    hidden, prob, adv, mask = make_batch(7)
    one_shot, diag = D.delta_coefficients(hidden, prob, adv, mask, num_refine=num_refine)
    # Chunks split over sequences (rows 0-2, 3-7) and, for the second block, over time too.
    blocks = [(slice(0, 3), slice(None)), (slice(3, 8), slice(0, 4)), (slice(3, 8), slice(4, None))]
    chunks = [D.FeatureChunk(jnp.asarray(hidden[r, t]), jnp.asarray(adv[r]),
                             jnp.asarray(mask[r, t]), jnp.asarray(1.0 - prob[r, t]))
              for r, t in blocks]
    # A re-iterable list, or a callable giving a fresh iterator each pass.
    source = chunks if num_refine == 0 else (lambda: iter(chunks))
    got, sdiag = D.delta_coefficients_streaming(source, num_refine=num_refine)
    stitched = np.zeros_like(mask)
    for (r, t), w in zip(blocks, got):
        stitched[r, t] = np.asarray(w)
    np.testing.assert_allclose(stitched, one_shot, rtol=1e-5, atol=1e-7)
    for key in diag:
        np.testing.assert_allclose(sdiag[key], diag[key], rtol=1e-4, atol=1e-6, err_msg=key)
    want, _ = reference_delta(proxy64(hidden, prob), adv, mask, num_refine)
    _assert_weights(stitched, want, mask)


# ----------------------------------------------------------------------------- edge cases


def _finite_in_range(w, mask, diag, lam_min=0.8, lam_max=1.2):
    w = np.asarray(w)
    assert np.all(np.isfinite(w))
    for value in diag.values():
        assert np.all(np.isfinite(np.asarray(value)))
    c = float(diag["normaliser"])
    valid = mask > 0
    assert np.all(w[valid] >= c * lam_min * (1 - 1e-6))
    assert np.all(w[valid] <= c * lam_max * (1 + 1e-6))
    np.testing.assert_allclose(w[valid].mean(), 1.0, rtol=1e-6)
    assert np.all(w[~valid] == 0)


def test_all_zero_advantages_give_unit_weights():
    hidden, prob, _, mask = make_batch(8)
    w, diag = D.delta_coefficients(hidden, prob, np.zeros(mask.shape[0], np.float32), mask)
    np.testing.assert_allclose(np.asarray(w), mask, rtol=1e-6)
    _finite_in_range(w, mask, diag)
    assert float(diag["tokens_zero"]) == mask.sum()


def test_one_sided_batches():
    hidden, prob, adv, mask = make_batch(9)
    for one_side in (np.abs(adv), -np.abs(adv)):
        w, diag = D.delta_coefficients(hidden, prob, one_side, mask)
        _finite_in_range(w, mask, diag)
        want, _ = reference_delta(proxy64(hidden, prob), one_side, mask, 1)
        _assert_weights(w, want, mask)


def test_single_token_side_and_constant_margins():
    hidden, prob, _, mask = make_batch(10, zero_group=False)
    # Side N has exactly one token; side P has constant features (constant margins).
    adv = np.array([1, 1, 1, 0, 0, 0, 0, -1], np.float32)
    mask = mask.copy()
    mask[7] = 0
    mask[7, 0] = 1
    hidden = hidden.copy()
    hidden[:3] = 2.0
    prob = prob.copy()
    prob[:3] = 0.5
    w, diag = D.delta_coefficients(hidden, prob, adv, mask)
    _finite_in_range(w, mask, diag)
    np.testing.assert_allclose(diag["gamma_neg"], 1e-4, rtol=1e-3)
    np.testing.assert_allclose(diag["gamma_pos"], 1e-4, rtol=1e-3)
    want, _ = reference_delta(proxy64(hidden, prob), adv, mask, 1)
    _assert_weights(w, want, mask)


def test_no_valid_tokens():
    hidden, prob, adv, mask = make_batch(11)
    w, diag = D.delta_coefficients(hidden, prob, adv, np.zeros_like(mask))
    assert np.all(np.asarray(w) == 0)
    for value in diag.values():
        assert np.isfinite(float(value))


def test_bad_inputs_raise_clear_errors():
    hidden, prob, adv, mask = make_batch(12)
    with pytest.raises(ValueError, match="mask"):
        D.delta_coefficients(hidden, prob, adv, mask[:, :-1])
    with pytest.raises(ValueError, match="advantages"):
        D.delta_coefficients(hidden, prob, adv[:-1], mask)
    with pytest.raises(ValueError, match="features"):
        D.delta_coefficients(hidden, prob, adv, mask, features=hidden)
    with pytest.raises(ValueError, match="lam_min"):
        D.delta_coefficients(hidden, prob, adv, mask, lam_min=1.3, lam_max=1.2)
    with pytest.raises(ValueError, match="stats_mode"):
        D.delta_coefficients(hidden, prob, adv, mask, stats_mode="local")


# ----------------------------------------------------------------------------- fused-pass form


def _assert_same_result(got, want, rtol=1e-5):
    """Weights and every diagnostic equal to rtol relative (atol 1e-6 for values near 0)."""
    (w_got, d_got), (w_want, d_want) = got, want
    np.testing.assert_allclose(np.asarray(w_got), np.asarray(w_want), rtol=rtol, atol=1e-7)
    assert set(d_got) == set(d_want)
    for key in d_want:
        np.testing.assert_allclose(d_got[key], d_want[key], rtol=rtol, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("num_refine", [0, 1, 2, 3])
def test_kernel_pass_impl_equals_jnp(num_refine):
    """pass_impl="kernel" (one fused kernels.delta_pass per round) == the jnp path, NaN padding, a
    zero-advantage group and an all-zero-advantage batch included; also vs the NumPy reference."""
    hidden, prob, adv, mask = make_batch(20 + num_refine)
    hidden[mask == 0] = np.nan
    prob[mask == 0] = np.nan
    for a in (adv, np.zeros_like(adv)):
        want = D.delta_coefficients(hidden, prob, a, mask, num_refine=num_refine)
        got = D.delta_coefficients(hidden, prob, a, mask, num_refine=num_refine,
                                   pass_impl="kernel")
        _assert_same_result(got, want)
        ref, _ = reference_delta(proxy64(np.where(mask[..., None] > 0, hidden, 0.0),
                                          np.where(mask > 0, prob, 0.0)), a, mask, num_refine)
        _assert_weights(got[0], ref, mask)
    np.testing.assert_allclose(np.asarray(got[0]), mask, rtol=1e-6)  # all-zero advantages


def test_kernel_pass_impl_token_advantages_and_features():
    """The fused passes with per-token advantages (one of them flipped in sign) and with
    precomputed features (p = 0) give the jnp path's result."""
    hidden, prob, adv, mask = make_batch(30, B=4, T=5, H=8, group=2, zero_group=False)
    adv_tok = (adv[:, None] * np.linspace(0.5, 1.5, 5)[None]).astype(np.float32)
    adv_tok[0, 0] = -adv_tok[0, 0]
    got = D.delta_coefficients(hidden, prob, adv_tok, mask, num_refine=1, pass_impl="kernel")
    _assert_same_result(got, D.delta_coefficients(hidden, prob, adv_tok, mask, num_refine=1))
    v = np.asarray(proxy64(hidden, prob), np.float32)
    got = D.delta_coefficients(None, None, adv, mask, features=v, pass_impl="kernel")
    _assert_same_result(got, D.delta_coefficients(None, None, adv, mask, features=v))


def test_kernel_pass_impl_streaming_equals_one_shot():
    hidden, prob, adv, mask = make_batch(31)
    want = D.delta_coefficients(hidden, prob, adv, mask, num_refine=2)
    chunks = [D.FeatureChunk(jnp.asarray(hidden[r]), jnp.asarray(adv[r]), jnp.asarray(mask[r]),
                             jnp.asarray(1.0 - prob[r])) for r in (slice(0, 3), slice(3, 8))]
    got, diag = D.delta_coefficients_streaming(chunks, num_refine=2, pass_impl="kernel")
    _assert_same_result((jnp.concatenate(got), diag), want, rtol=1e-4)


def test_bad_pass_impl_names_the_field():
    hidden, prob, adv, mask = make_batch(32)
    with pytest.raises(ValueError, match="delta.pass_impl"):
        D.delta_coefficients(hidden, prob, adv, mask, pass_impl="triton")
    with pytest.raises(ValueError, match="delta.pass_impl"):
        D.delta_coefficients_streaming([], pass_impl="pallas")


@pytest.mark.parametrize("pass_impl", ["jnp", "kernel"])
def test_streaming_reads_the_source_exactly_k_plus_3_times(pass_impl):
    """A recomputing source (one trunk pass per iteration) is iterated K + 3 times, no more."""
    hidden, prob, adv, mask = make_batch(33)
    calls = []

    def source():
        calls.append(1)
        return iter([D.FeatureChunk(jnp.asarray(hidden), jnp.asarray(adv), jnp.asarray(mask),
                                    jnp.asarray(1.0 - prob))])
    D.delta_coefficients_streaming(source, num_refine=2, pass_impl=pass_impl)
    assert len(calls) == 2 + 3
    with pytest.raises(ValueError, match="no chunks"):
        D.delta_coefficients_streaming([], pass_impl=pass_impl)


# ----------------------------------------------------------------------------- ablations (#19)
#
# Each ablation row of the paper (DELTA_SPEC section 4) vs tests/delta_reference.py's float64
# transcription of its definition. `_flag_matters` makes every test fail if the flag were ignored:
# the reference's weights with the flag differ from the full method's.

SINGLE_ABLATIONS = {
    "fixed_gamma": dict(fixed_gamma=0.25),
    "hard": dict(assignment="hard"),
    "no_normalize": dict(normalize=False),
    "alpha_weight": dict(weight="alpha"),
}
COMPOSED_ABLATIONS = {
    "hard+no_normalize": dict(assignment="hard", normalize=False),
    "fixed_gamma+alpha_weight": dict(fixed_gamma=3.0, weight="alpha"),
    "hard+alpha_weight+no_normalize": dict(assignment="hard", weight="alpha", normalize=False),
}
ABLATIONS = {**SINGLE_ABLATIONS, **COMPOSED_ABLATIONS}
KERNEL_ABLATIONS = [k for k, v in ABLATIONS.items() if v.get("assignment") != "hard"]


def _flag_matters(want, v, adv, mask, num_refine):
    base, _ = reference_delta(v, adv, mask, num_refine)
    assert np.abs(want - base)[mask > 0].max() > 1e-3, "the flag would go unnoticed"


def _check_ablation(got, hidden, prob, adv, mask, num_refine, options, random_u=None,
                    diagnostics=True):
    v = proxy64(np.where(mask[..., None] > 0, hidden, 0.0), np.where(mask > 0, prob, 0.0))
    want, info = reference_delta(v, adv, mask, num_refine, **options, random_u=random_u)
    _flag_matters(want, v, adv, mask, num_refine)
    weights, diag = got
    _assert_weights(weights, want, mask)
    if diagnostics:
        _assert_diagnostics(diag, want, info)
    return want, info


@pytest.mark.parametrize("num_refine", [0, 1, 2, 3])
@pytest.mark.parametrize("name", list(SINGLE_ABLATIONS))
def test_single_ablation_matches_reference(name, num_refine):
    options = SINGLE_ABLATIONS[name]
    hidden, prob, adv, mask = make_batch(40 + num_refine)
    got = D.delta_coefficients(hidden, prob, adv, mask, num_refine=num_refine,
                               ablations=D.Ablations(**options))
    _check_ablation(got, hidden, prob, adv, mask, num_refine, options)


@pytest.mark.parametrize("name", list(COMPOSED_ABLATIONS))
def test_composed_ablations_match_reference(name):
    options, num_refine = COMPOSED_ABLATIONS[name], 2
    hidden, prob, adv, mask = make_batch(50)
    got = D.delta_coefficients(hidden, prob, adv, mask, num_refine=num_refine,
                               ablations=D.Ablations(**options))
    _check_ablation(got, hidden, prob, adv, mask, num_refine, options)


def test_default_ablations_are_the_full_method_bit_for_bit():
    """The default options are the full method: with no ablations given, both pass_impl values
    match the float64 reference of the full method (weights and diagnostics, the tolerances of
    test_matches_numpy_reference); passing Ablations() and a key explicitly changes no bit."""
    hidden, prob, adv, mask = make_batch(41)
    want, info = reference_delta(proxy64(hidden, prob), adv, mask, 1)
    for pass_impl in ("jnp", "kernel"):
        plain = D.delta_coefficients(hidden, prob, adv, mask, pass_impl=pass_impl)
        _assert_weights(plain[0], want, mask)
        _assert_diagnostics(plain[1], want, info)
        explicit = D.delta_coefficients(hidden, prob, adv, mask, pass_impl=pass_impl,
                                        ablations=D.Ablations(),
                                        key=jax.random.key(0))
        np.testing.assert_array_equal(np.asarray(explicit[0]), np.asarray(plain[0]))
        for key in plain[1]:
            np.testing.assert_array_equal(explicit[1][key], plain[1][key], err_msg=key)


def _stream_chunks(hidden, prob, adv, mask):
    """Chunks split over sequences (rows 0-2, 3-7) and, for the second block, over time."""
    blocks = [(slice(0, 3), slice(None)), (slice(3, 8), slice(0, 4)), (slice(3, 8), slice(4, None))]
    chunks = [D.FeatureChunk(jnp.asarray(hidden[r, t]), jnp.asarray(adv[r]),
                             jnp.asarray(mask[r, t]), jnp.asarray(1.0 - prob[r, t]))
              for r, t in blocks]
    return blocks, chunks


def _stitch(blocks, parts, shape):
    out = np.zeros(shape, np.float64)
    for (r, t), w in zip(blocks, parts):
        out[r, t] = np.asarray(w)
    return out


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_ablation_streaming_matches_reference(name):
    options = ABLATIONS[name]
    hidden, prob, adv, mask = make_batch(60)
    blocks, chunks = _stream_chunks(hidden, prob, adv, mask)
    parts, diag = D.delta_coefficients_streaming(chunks, num_refine=2,
                                                 ablations=D.Ablations(**options))
    got = _stitch(blocks, parts, mask.shape)
    _check_ablation((got, diag), hidden, prob, adv, mask, 2, options)


@pytest.mark.parametrize("name", KERNEL_ABLATIONS)
def test_ablation_kernel_pass_impl_matches_reference(name):
    """pass_impl="kernel" (its jnp reference on CPU), one-shot and streaming, NaN padding."""
    options = ABLATIONS[name]
    hidden, prob, adv, mask = make_batch(61)
    hidden[mask == 0] = np.nan
    prob[mask == 0] = np.nan
    ablations = D.Ablations(**options)
    got = D.delta_coefficients(hidden, prob, adv, mask, num_refine=2, pass_impl="kernel",
                               ablations=ablations)
    _check_ablation(got, hidden, prob, adv, mask, 2, options)
    _assert_same_result(got, D.delta_coefficients(hidden, prob, adv, mask, num_refine=2,
                                                  ablations=ablations))
    blocks, chunks = _stream_chunks(hidden, prob, adv, mask)
    parts, diag = D.delta_coefficients_streaming(chunks, num_refine=2, pass_impl="kernel",
                                                 ablations=ablations)
    _check_ablation((_stitch(blocks, parts, mask.shape), diag), hidden, prob, adv, mask, 2,
                    options)


@pytest.mark.parametrize("pass_impl", ["jnp", "kernel"])
def test_fixed_gamma_skips_the_temperature_pass(pass_impl):
    """With delta.fixed_gamma the temperatures are known: a streaming source is read K + 2
    times (no margins pass), and the diagnostics report the fixed value."""
    hidden, prob, adv, mask = make_batch(62)
    calls = []

    def source():
        calls.append(1)
        return iter([D.FeatureChunk(jnp.asarray(hidden), jnp.asarray(adv), jnp.asarray(mask),
                                    jnp.asarray(1.0 - prob))])
    _, diag = D.delta_coefficients_streaming(source, num_refine=2, pass_impl=pass_impl,
                                             ablations=D.Ablations(fixed_gamma=0.7))
    assert len(calls) == 2 + 2
    np.testing.assert_allclose([diag["gamma_pos"], diag["gamma_neg"]], [0.7, 0.7], rtol=1e-7)


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_ablation_edge_cases_stay_finite(name):
    """All-zero, one-sided and single-token batches: finite weights and diagnostics for every
    flag (weight="alpha" on an all-Z batch gives weight 0 everywhere: lambda = 0 on Z)."""
    ablations = D.Ablations(**ABLATIONS[name])
    hidden, prob, adv, mask = make_batch(63)
    # Single-token sides (as in test_single_token_side_and_constant_margins): one token each on
    # P and N, the rest of the batch zero-advantage.
    one_adv = np.array([1, 0, 0, 0, 0, 0, 0, -1], np.float32)
    one_mask = mask.copy()
    one_mask[[0, 7]] = 0
    one_mask[[0, 7], 0] = 1
    assert [(one_mask * (one_adv[:, None] * sign > 0)).sum() for sign in (1, -1)] == [1, 1]
    for a, m in ((np.zeros_like(adv), mask), (np.abs(adv), mask), (-np.abs(adv), mask),
                 (one_adv, one_mask)):
        w, diag = D.delta_coefficients(hidden, prob, a, m, ablations=ablations)
        assert np.all(np.isfinite(np.asarray(w)))
        assert all(np.isfinite(float(x)) for x in diag.values())
        want, _ = reference_delta(proxy64(hidden, prob), a, m, 1, **ABLATIONS[name])
        _assert_weights(w, want, m)
    w, diag = D.delta_coefficients(hidden, prob, adv, np.zeros_like(mask), ablations=ablations)
    assert np.all(np.asarray(w) == 0)
    assert all(np.isfinite(float(x)) for x in diag.values())


# random lambda: the control draws lambda ~ U[lam_min, lam_max] per P/N token.

def _uniform(key, shape):
    """The documented draws of delta.random_lambda, written out here (not delta.lambda_noise)."""
    return np.asarray(jax.random.uniform(key, shape, jnp.float32), np.float64)


@pytest.mark.parametrize("pass_impl,normalize", [("jnp", True), ("kernel", False)])
def test_random_lambda_matches_reference_and_is_deterministic(pass_impl, normalize):
    hidden, prob, adv, mask = make_batch(70)
    options = dict(random_lambda=True, normalize=normalize)
    ablations = D.Ablations(**options)
    key = jax.random.key(3)

    def run(k):
        return D.delta_coefficients(hidden, prob, adv, mask, num_refine=1, lam_min=0.7,
                                    lam_max=1.5, pass_impl=pass_impl,
                                    ablations=ablations, key=k)
    got = run(key)
    v = proxy64(hidden, prob)
    u = _uniform(key, mask.shape)
    want, info = reference_delta(v, adv, mask, 1, 0.7, 1.5, normalize=normalize, random_u=u)
    base, _ = reference_delta(v, adv, mask, 1, 0.7, 1.5, normalize=normalize)
    assert np.abs(want - base)[mask > 0].max() > 1e-2
    _assert_weights(got[0], want, mask)
    _assert_diagnostics(got[1], want, info)
    w, c = np.asarray(got[0]), float(got[1]["normaliser"])
    pn, zero = (mask > 0) & (adv[:, None] != 0), (mask > 0) & (adv[:, None] == 0)
    assert zero.any() and pn.any()
    assert np.all(w[pn] >= c * 0.7 * (1 - 1e-6)) and np.all(w[pn] <= c * 1.5 * (1 + 1e-6))
    np.testing.assert_allclose(w[zero], c * 0.7, rtol=1e-6)
    assert np.all(w[mask == 0] == 0)
    np.testing.assert_array_equal(np.asarray(run(jax.random.key(3))[0]), w)  # same key
    assert np.abs(np.asarray(run(jax.random.key(4))[0]) - w)[pn].max() > 1e-3  # other key


def test_random_lambda_mean_and_spread_over_many_tokens():
    """lambda ~ U[0.8, 1.2] i.i.d.: over ~2000 P/N tokens the mean is within 0.02 of 1.0 (the
    standard error is 0.115 / sqrt(2000) = 0.0026: 7.7 standard errors, and deterministic given the
    key anyway) and the standard deviation within 0.015 of 0.4 / sqrt(12)."""
    rng = np.random.default_rng(71)
    B, T, H = 64, 48, 4
    hidden = rng.normal(size=(B, T, H)).astype(np.float32)
    prob = rng.uniform(0.1, 0.9, size=(B, T)).astype(np.float32)
    adv = rng.choice([-1.0, 0.0, 1.0], size=B, p=[0.45, 0.1, 0.45]).astype(np.float32)
    mask = (np.arange(T)[None] < rng.integers(T // 2, T + 1, size=B)[:, None]).astype(np.float32)
    pn = (mask > 0) & (adv[:, None] != 0)
    assert pn.sum() > 1500
    for seed in (0, 1):
        w, _ = D.delta_coefficients(hidden, prob, adv, mask,
                                    ablations=D.Ablations(random_lambda=True, normalize=False),
                                    key=jax.random.key(seed))
        lam = np.asarray(w)[pn]
        assert lam.min() >= np.float32(0.8) and lam.max() <= np.float32(1.2)
        assert abs(lam.mean() - 1.0) < 0.02
        assert abs(lam.std() - 0.4 / np.sqrt(12)) < 0.015
        np.testing.assert_array_equal(np.asarray(w)[(mask > 0) & ~pn], np.float32(0.8))


@pytest.mark.parametrize("pass_impl", ["jnp", "kernel"])
def test_random_lambda_streaming(pass_impl):
    """Streaming draws chunk i's lambdas from fold_in(key, i) (documented; not the one-shot
    draws): equal to the reference with those draws, deterministic, and a new key differs."""
    hidden, prob, adv, mask = make_batch(72)
    blocks, chunks = _stream_chunks(hidden, prob, adv, mask)
    ablations = D.Ablations(random_lambda=True)

    def run(k):
        parts, diag = D.delta_coefficients_streaming(chunks, num_refine=2, pass_impl=pass_impl,
                                                     ablations=ablations, key=k)
        return _stitch(blocks, parts, mask.shape), diag
    key = jax.random.key(5)
    got = run(key)
    u = _stitch(blocks, [_uniform(jax.random.fold_in(key, i), c.mask.shape)
                         for i, c in enumerate(chunks)], mask.shape)
    _check_ablation(got, hidden, prob, adv, mask, 2, {}, random_u=u)
    np.testing.assert_array_equal(run(key)[0], got[0])
    assert np.abs(run(jax.random.key(6))[0] - got[0])[mask > 0].max() > 1e-3


def test_ablation_errors_name_the_field():
    hidden, prob, adv, mask = make_batch(73)
    _, chunks = _stream_chunks(hidden, prob, adv, mask)
    random = D.Ablations(random_lambda=True)
    with pytest.raises(ValueError, match="delta.random_lambda"):
        D.delta_coefficients(hidden, prob, adv, mask, ablations=random)
    with pytest.raises(ValueError, match="delta.random_lambda"):
        D.delta_coefficients_streaming(chunks, ablations=random)
    with pytest.raises(ValueError, match="delta.random_lambda.*delta.weight"):
        D.delta_coefficients(hidden, prob, adv, mask, key=jax.random.key(0),
                             ablations=D.Ablations(random_lambda=True, weight="alpha"))
    hard = D.Ablations(assignment="hard")
    with pytest.raises(ValueError, match="delta.assignment='hard'.*kernel"):
        D.delta_coefficients(hidden, prob, adv, mask, pass_impl="kernel", ablations=hard)
    with pytest.raises(ValueError, match="delta.assignment='hard'.*kernel"):
        D.delta_coefficients_streaming(chunks, pass_impl="kernel",
                                       ablations=hard)
    with pytest.raises(ValueError, match="delta.assignment"):
        D.delta_coefficients(hidden, prob, adv, mask, ablations=D.Ablations(assignment="fuzzy"))
    with pytest.raises(ValueError, match="delta.weight"):
        D.delta_coefficients(hidden, prob, adv, mask, ablations=D.Ablations(weight="beta"))
    with pytest.raises(ValueError, match="delta.fixed_gamma"):
        D.delta_coefficients(hidden, prob, adv, mask, ablations=D.Ablations(fixed_gamma=-1.0))
