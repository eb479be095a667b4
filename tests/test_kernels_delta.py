"""Fused DelTA pass (kernels.delta_pass) against a literal float64 reading of DELTA_SPEC 2.0-2.7."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.kernels.delta_pass import DeltaPassSums, add_sums, delta_pass
from delta_jax.rl import delta as D


def discriminator(sums):
    """What the trainer makes of a pass's sums (rl.delta: the sums as PassStats, then
    finalize_pass): centroids mu [2, H] and temperatures gamma [2]."""
    return D.finalize_pass(D._as_pass_stats(sums))

LAM_RANGE = (0.8, 1.2)


def make_inputs(seed, lead=(150,), hidden=72, dtype=jnp.float32, poison_padding=True):
    """Random features with all three sides and ~20% padding (NaN-poisoned features)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(lead))
    h = rng.normal(size=(n, hidden)).astype(np.float32)
    p = rng.uniform(size=n).astype(np.float32)
    a = rng.choice(np.array([1.3, 0.4, -0.7, -1.1, 0.0], np.float32), size=n)
    mask = (rng.uniform(size=n) > 0.2).astype(np.float32)
    if poison_padding:
        h[mask == 0] = np.nan
        p[mask == 0] = np.nan
    mu_pos = (0.3 * rng.normal(size=hidden) + 0.1).astype(np.float32)
    mu_neg = (0.3 * rng.normal(size=hidden) - 0.1).astype(np.float32)
    gammas = (np.float32(rng.uniform(0.5, 2.0)), np.float32(rng.uniform(0.5, 2.0)))
    reshape = lambda x: jnp.asarray(x.reshape(*lead, *x.shape[1:]))
    return (reshape(h).astype(dtype), reshape(p), reshape(a), reshape(mask),
            jnp.asarray(mu_pos), jnp.asarray(mu_neg), *gammas)


def spec_float64(h, p, a, mask, mu_pos, mu_neg, gamma_pos, gamma_neg, use_alpha, lam_range):
    """DELTA_SPEC 2.0-2.7 read literally, in float64 numpy: squared distances, no affine form."""
    h = np.asarray(jnp.asarray(h, jnp.float32), np.float64).reshape(-1, np.shape(h)[-1])
    p, a, mask = (np.asarray(x, np.float64).reshape(-1) for x in (p, a, mask))
    mu_pos, mu_neg = np.asarray(mu_pos, np.float64), np.asarray(mu_neg, np.float64)
    valid = mask > 0
    pos, neg = valid & (a > 0), valid & (a < 0)
    v = (1.0 - np.where(valid, p, 0.0))[:, None] * np.where(valid[:, None], h, 0.0)
    d_pos = np.sum((v - mu_pos) ** 2, axis=1)
    d_neg = np.sum((v - mu_neg) ** 2, axis=1)
    margin = np.where(pos, d_neg - d_pos, np.where(neg, d_pos - d_neg, 0.0))
    gamma = np.where(pos, gamma_pos, gamma_neg)
    alpha = 0.5 * (1.0 + np.tanh(0.5 * margin / gamma)) if use_alpha else np.ones_like(margin)
    score = v @ (mu_pos - mu_neg) - 0.5 * (mu_pos @ mu_pos - mu_neg @ mu_neg)
    out = {}
    for name, fn in (
        ("centroid_sum", lambda s: np.sum((np.abs(a) * alpha)[s][:, None] * v[s], axis=0)),
        ("weight_sum", lambda s: np.sum((np.abs(a) * alpha)[s])),
        ("count", lambda s: float(np.sum(s))),
        ("margin_mean", lambda s: np.mean(margin[s])),
        ("margin_m2", lambda s: np.sum((margin[s] - np.mean(margin[s])) ** 2)),
    ):
        out[name] = np.stack([fn(pos), fn(neg)])
    out["correct"] = np.array([np.sum(pos & (score > 0)), np.sum(neg & (score < 0))], np.float64)
    out["num_valid"] = float(np.sum(valid))
    lam_min, lam_max = lam_range
    lam = np.where(pos | neg, lam_min + (lam_max - lam_min) * alpha, np.where(valid, lam_min, 0.0))
    out["lam"] = lam
    out["lam_sum"] = np.sum(lam)
    return out


def assert_close(actual, expected, rtol, scale=None, name=""):
    """||actual - expected|| <= rtol * ||scale|| (scale defaults to expected); NaN fails."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    ref = np.linalg.norm(np.asarray(expected if scale is None else scale, np.float64))
    err = np.linalg.norm(actual - expected)
    assert err <= rtol * max(ref, 1e-30), f"{name}: |err| {err:.3g} > {rtol} * {ref:.3g}"


def assert_sums_close(actual: DeltaPassSums, expected, rtol):
    for field in DeltaPassSums._fields:
        exp = getattr(expected, field) if isinstance(expected, DeltaPassSums) else expected[field]
        act = getattr(actual, field)
        if exp is None:
            assert act is None, field
            continue
        # A mean of signed margins can be near 0: measure it against the margins' RMS.
        scale = None
        if field == "margin_mean":
            get = (lambda f: getattr(expected, f)) if isinstance(expected, DeltaPassSums) else expected.get
            rms = np.sqrt(np.asarray(get("margin_m2"), np.float64) / np.maximum(get("count"), 1))
            scale = np.abs(np.asarray(exp, np.float64)) + rms
        assert_close(act, exp, rtol, scale=scale, name=field)


@pytest.mark.parametrize("use_alpha", [True, False])
def test_pass_matches_literal_spec(use_alpha):
    inputs = make_inputs(0, lead=(4, 24), hidden=40)
    got = delta_pass(*inputs, use_alpha=use_alpha, lam_range=LAM_RANGE)
    want = spec_float64(*inputs, use_alpha=use_alpha, lam_range=LAM_RANGE)
    assert got.lam.shape == (4, 24)
    assert_close(got.lam.reshape(-1), want["lam"], 1e-6, name="lam")
    want_sums = {k: v for k, v in want.items() if k != "lam"}
    got = got._replace(lam=None)
    want_sums["lam"] = None
    assert_sums_close(got, want_sums, 1e-5)


def test_initial_centroids_are_the_advantage_weighted_means():
    """Spec 2.2: mu+ = sum_P A v / sum_P A with use_alpha=False."""
    h, p, a, mask, mu_pos, mu_neg, gp, gn = make_inputs(1, hidden=16, poison_padding=False)
    sums = delta_pass(h, p, a, mask, mu_pos, mu_neg, gp, gn, use_alpha=False)
    mu_p, mu_n = discriminator(sums).mu
    v = np.asarray((1 - p)[:, None] * h, np.float64)
    a, valid = np.asarray(a, np.float64), np.asarray(mask) > 0
    for mu, side in ((mu_p, valid & (a > 0)), (mu_n, valid & (a < 0))):
        w = np.abs(a) * side
        assert_close(mu, (w[:, None] * v).sum(0) / w.sum(), 1e-5)


def test_temperatures_from_the_sums_are_the_population_std():
    inputs = make_inputs(2, hidden=24, poison_padding=False)
    sums = delta_pass(*inputs)
    h, p, a, mask, mu_pos, mu_neg = (np.asarray(x, np.float64) for x in inputs[:6])
    v = (1 - p)[:, None] * h
    s = v @ (mu_pos - mu_neg) - 0.5 * (mu_pos @ mu_pos - mu_neg @ mu_neg)
    gammas = discriminator(sums).gamma
    for gamma, side, sign in ((gammas[0], (mask > 0) & (a > 0), 1), (gammas[1], (mask > 0) & (a < 0), -1)):
        assert_close(gamma, np.std(2 * sign * s[side]), 1e-5)


def test_sums_of_chunks_add_up():
    inputs = make_inputs(3, lead=(96,), hidden=24)
    whole = delta_pass(*inputs)
    h, p, a, mask = inputs[:4]
    rest = inputs[4:]
    first = delta_pass(h[:40], p[:40], a[:40], mask[:40], *rest)
    second = delta_pass(h[40:], p[40:], a[40:], mask[40:], *rest)
    assert_sums_close(add_sums(first, second), whole._replace(lam=None), 1e-5)


def test_temperature_survives_a_large_mean_margin():
    """Margins ~ 2e3 +- 1: raw fp32 sums of squares would cancel; (count, mean, m2) must not."""
    h, p, a, mask, _, _, gp, gn = make_inputs(10, lead=(300,), hidden=8, poison_padding=False)
    mu_pos = jnp.zeros((8,)).at[0].set(-40.0)  # b = 800, |s| ~ 800 + O(1)
    mu_neg = jnp.zeros((8,))
    h = h.at[:, 0].multiply(0.02)  # the scores' spread stays O(1) while their mean is -800
    want = spec_float64(h, p, a, mask, mu_pos, mu_neg, gp, gn, True, LAM_RANGE)
    want_gamma = np.sqrt(want["margin_m2"] / want["count"])
    sums = jax.jit(delta_pass)(h, p, a, mask, mu_pos, mu_neg, gp, gn)
    assert_close(np.array(discriminator(sums).gamma), want_gamma, 1e-3, name="gamma")


def test_bf16_features():
    """bf16 h is upcast where it is read: within 1e-5 of the pass on the same values in fp32;
    against the original fp32 features the bf16 rounding of h costs up to ~1e-2 relative (stated
    tolerance 2e-2)."""
    inputs32 = make_inputs(5, lead=(2, 64), hidden=64)
    inputs16 = (inputs32[0].astype(jnp.bfloat16),) + inputs32[1:]
    got = jax.jit(lambda *x: delta_pass(*x, lam_range=LAM_RANGE))(*inputs16)
    assert got.lam.shape == (2, 64)
    upcast = (inputs16[0].astype(jnp.float32),) + inputs16[1:]
    assert_sums_close(got, delta_pass(*upcast, lam_range=LAM_RANGE), 1e-5)
    fp32 = delta_pass(*inputs32, lam_range=LAM_RANGE)
    assert_close(got.centroid_sum, fp32.centroid_sum, 2e-2, name="centroid_sum vs fp32")
    assert_close(got.lam, fp32.lam, 2e-2, name="lam vs fp32")


def test_margins_only_pass():
    """with_centroids=False (the margins-only pass): zero centroid sums, every other field as the
    full pass."""
    inputs = make_inputs(6, lead=(70,), hidden=40)
    margins_only = delta_pass(*inputs, with_centroids=False)
    assert float(jnp.max(jnp.abs(margins_only.centroid_sum))) == 0.0
    full = delta_pass(*inputs)
    assert_sums_close(margins_only, full._replace(centroid_sum=jnp.zeros_like(full.centroid_sum)),
                      1e-6)


def test_bad_shapes_name_the_tensor():
    h, p, a, mask, mu_pos, mu_neg, gp, gn = make_inputs(8, lead=(20,), hidden=8)
    with pytest.raises(ValueError, match="mask"):
        delta_pass(h, p, a, mask[:10], mu_pos, mu_neg, gp, gn)
    with pytest.raises(ValueError, match="mu_neg"):
        delta_pass(h, p, a, mask, mu_pos, mu_neg[:4], gp, gn)
    with pytest.raises(ValueError, match="floating"):
        delta_pass(h.astype(jnp.int32), p, a, mask, mu_pos, mu_neg, gp, gn)


def test_moments_merge_to_the_whole():
    """masked_moments of parts merged pairwise (merge_moments, left to right and as a tree, an
    empty part included) give the float64 moments of the whole."""
    from delta_jax.kernels.delta_pass import masked_moments, merge_moments

    rng = np.random.default_rng(11)
    x = (1e3 + rng.normal(size=(7, 40))).astype(np.float32)   # large mean, unit spread
    mask = (rng.uniform(size=(2, 7, 40)) > 0.3).astype(np.float32)
    mask[:, 3] = 0.0                                           # an empty part
    want = [(m.sum(), (x * m).sum() / m.sum(), ((x - (x * m).sum() / m.sum()) ** 2 * m).sum())
            for m in mask.astype(np.float64)]
    parts = masked_moments(jnp.asarray(x)[None], jnp.asarray(mask), axis=2)  # [2, 7] each
    part = lambda i: tuple(v[:, i] for v in parts)  # noqa: E731

    def fold(indices):
        acc = part(indices[0])
        for i in indices[1:]:
            acc = merge_moments(*acc, *part(i))
        return acc

    tree = merge_moments(*merge_moments(*fold([0, 1, 2]), *fold([3])), *fold([4, 5, 6]))
    for got in (fold(list(range(7))), tree):
        for side in range(2):
            for k, tol in ((0, 0.0), (1, 1e-6), (2, 1e-4)):
                np.testing.assert_allclose(float(got[k][side]), want[side][k], rtol=tol)


def test_bias_survives_large_centroid_norms():
    """Centroids of norm ~1e4 a unit apart, features around their midpoint: the score
    b + v . W is O(1) while |mu|^2 ~ 1e8. Forming b from |mu+|^2 - |mu-|^2 in fp32 loses O(10)
    to rounding; b = -(mu+ - mu-) . (mu+ + mu-) / 2 (the jnp path's form) does not."""
    rng = np.random.default_rng(12)
    n, hidden = 200, 64
    centre = rng.normal(size=hidden)
    centre *= 1e4 / np.linalg.norm(centre)
    half_gap = 0.5 * rng.normal(size=hidden) / np.sqrt(hidden)          # |mu+ - mu-| ~ 1
    mu_pos = jnp.asarray(centre + half_gap, jnp.float32)
    mu_neg = jnp.asarray(centre - half_gap, jnp.float32)
    h = jnp.asarray(centre + rng.normal(size=(n, hidden)), jnp.float32)  # p = 0: v = h
    p = jnp.zeros((n,), jnp.float32)
    a = jnp.asarray(rng.choice(np.array([1.0, -1.0, 0.5, -0.5], np.float32), size=n))
    mask = jnp.ones((n,), jnp.float32)
    inputs = (h, p, a, mask, mu_pos, mu_neg, np.float32(1.0), np.float32(1.0))
    want = spec_float64(*inputs, use_alpha=True, lam_range=LAM_RANGE)
    assert np.all(np.sqrt(want["margin_m2"] / want["count"]) > 0.3)  # margins of O(1)
    sums = jax.jit(lambda *x: delta_pass(*x, lam_range=LAM_RANGE))(*inputs)
    for field in ("margin_mean", "margin_m2", "weight_sum"):
        scale = None
        if field == "margin_mean":
            scale = np.abs(want[field]) + np.sqrt(want["margin_m2"] / want["count"])
        assert_close(getattr(sums, field), want[field], 1e-2, scale=scale, name=field)
    assert_close(sums.lam, want["lam"], 1e-2, name="lam")
