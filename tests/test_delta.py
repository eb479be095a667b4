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


# ----------------------------------------------------------------------------- vs reference


@pytest.mark.parametrize("num_refine", [0, 1, 2, 3])
def test_matches_numpy_reference(num_refine):
    for seed in (0, 1):
        hidden, prob, adv, mask = make_batch(seed + 10 * num_refine)
        got, diag = D.delta_coefficients(jnp.asarray(hidden), jnp.asarray(prob), jnp.asarray(adv),
                                         jnp.asarray(mask), num_refine=num_refine)
        want, info = reference_delta(proxy64(hidden, prob), adv, mask, num_refine)
        _assert_weights(got, want, mask)
        np.testing.assert_allclose([diag["gamma_pos"], diag["gamma_neg"]], info["gamma"],
                                   rtol=1e-4)
        np.testing.assert_allclose(diag["normaliser"], info["c"], rtol=1e-5)
        np.testing.assert_allclose(diag["disc_accuracy"], info["accuracy"], rtol=1e-6)
        np.testing.assert_allclose([diag["tokens_pos"], diag["tokens_neg"], diag["tokens_zero"]],
                                   info["tokens"])
        np.testing.assert_allclose(diag["centroid_norm_pos"], np.linalg.norm(info["mu"][0]),
                                   rtol=1e-5)
        cos = info["mu"][0] @ info["mu"][1] / np.linalg.norm(info["mu"][0]) / np.linalg.norm(
            info["mu"][1])
        np.testing.assert_allclose(diag["centroid_cosine"], cos, rtol=1e-5, atol=1e-6)
        for i, name in enumerate(("pos", "neg", "zero")):
            side_w = np.array([want[k] for k in info["sides"][i]])
            np.testing.assert_allclose(diag[f"weight_mean_{name}"], side_w.mean(), rtol=1e-5)
            np.testing.assert_allclose(diag[f"weight_std_{name}"], side_w.std(), rtol=1e-4,
                                       atol=1e-6)
            np.testing.assert_allclose(diag[f"weight_min_{name}"], side_w.min(), rtol=1e-5)
            np.testing.assert_allclose(diag[f"weight_max_{name}"], side_w.max(), rtol=1e-5)


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
    weights, _ = D.delta_coefficients(None, None, jnp.asarray(adv), jnp.asarray(mask),
                                      features=got)
    ref, _ = reference_delta(np.asarray(got, np.float64), adv, mask, 1)
    _assert_weights(weights, ref, mask)


def test_last_layer_proxy_and_stop_gradient():
    hidden, prob, adv, mask = make_batch(5)
    np.testing.assert_allclose(D.last_layer_proxy(jnp.asarray(hidden), jnp.asarray(prob)),
                               proxy64(hidden, prob), rtol=1e-6)
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


@pytest.mark.parametrize("num_refine", [0, 2])
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


@pytest.mark.parametrize("num_refine", [0, 1, 2])
def test_kernel_pass_impl_equals_jnp(num_refine):
    """pass_impl="kernel" (the kernels' jnp reference on CPU) == the jnp path, NaN padding, a
    zero-advantage group and an all-zero-advantage batch included; also vs the NumPy reference."""
    hidden, prob, adv, mask = make_batch(20 + num_refine)
    hidden[mask == 0] = np.nan
    prob[mask == 0] = np.nan
    for a in (adv, np.zeros_like(adv)):
        want = D.delta_coefficients(hidden, prob, a, mask, num_refine=num_refine)
        got = D.delta_coefficients(hidden, prob, a, mask, num_refine=num_refine,
                                   pass_impl="kernel", kernel_impl="reference")
        _assert_same_result(got, want)
        ref, _ = reference_delta(proxy64(np.where(mask[..., None] > 0, hidden, 0.0),
                                          np.where(mask > 0, prob, 0.0)), a, mask, num_refine)
        _assert_weights(got[0], ref, mask)
    np.testing.assert_allclose(np.asarray(got[0]), mask, rtol=1e-6)  # all-zero advantages


def test_kernel_pass_impl_pallas_interpret_and_env(monkeypatch):
    """The Pallas kernel itself (interpret mode) through delta_coefficients, chosen by the
    environment variable; per-token advantages and precomputed features (p = 0) too."""
    from delta_jax.kernels import backend
    hidden, prob, adv, mask = make_batch(30, B=4, T=5, H=8, group=2, zero_group=False)
    adv_tok = (adv[:, None] * np.linspace(0.5, 1.5, 5)[None]).astype(np.float32)
    adv_tok[0, 0] = -adv_tok[0, 0]
    monkeypatch.setenv(backend.ENV_VAR, "interpret")
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
    got, diag = D.delta_coefficients_streaming(chunks, num_refine=2, pass_impl="kernel",
                                               kernel_impl="reference")
    _assert_same_result((jnp.concatenate(got), diag), want, rtol=1e-4)


def test_bad_pass_impl_names_the_field():
    hidden, prob, adv, mask = make_batch(32)
    with pytest.raises(ValueError, match="delta.pass_impl"):
        D.delta_coefficients(hidden, prob, adv, mask, pass_impl="triton")
    with pytest.raises(ValueError, match="DELTA_JAX_KERNELS|impl"):
        D.delta_coefficients(hidden, prob, adv, mask, pass_impl="kernel", kernel_impl="cuda")


@pytest.mark.parametrize("pass_impl", ["jnp", "kernel"])
def test_streaming_reads_the_source_exactly_k_plus_3_times(pass_impl):
    """A recomputing source (one trunk pass per iteration) is iterated K + 3 times, no more."""
    hidden, prob, adv, mask = make_batch(33)
    calls = []

    def source():
        calls.append(1)
        return iter([D.FeatureChunk(jnp.asarray(hidden), jnp.asarray(adv), jnp.asarray(mask),
                                    jnp.asarray(1.0 - prob))])
    D.delta_coefficients_streaming(source, num_refine=2, pass_impl=pass_impl,
                                   kernel_impl="reference")
    assert len(calls) == 2 + 3
    with pytest.raises(ValueError, match="no chunks"):
        D.delta_coefficients_streaming([], pass_impl=pass_impl, kernel_impl="reference")
