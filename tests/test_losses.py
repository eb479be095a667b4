"""Policy loss: hand-computed DAPO example, finite-difference gradients, exact accumulation,
GSPO's sequence-level ratio against its paper's sequence objective, SAPO's soft gate against its
formula and gradient, FIPO's future-KL weights against a loop over the later tokens."""
import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from delta_jax.rl.losses import (AGG_MODES, RATIO_LEVELS, PolicyLossConfig, aggregate,
                                 clipped_surrogate, finalize_metrics, fipo_weights, future_sums,
                                 kl_penalty, policy_loss)


def _dapo_example():
    # Ratios chosen to hit every branch; a 4th, padded column holds garbage.
    ratios = np.array([[1.0, 1.5, 0.5, 7.0], [0.7, 1.2, 20.0, 3.0]])
    old = np.array([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, -4.0, -1.0]])
    logp = old + np.log(ratios)
    logp[0, 3] = np.inf
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], np.float32)
    adv = np.array([1.0, -2.0])
    return (jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32),
            jnp.asarray(adv, jnp.float32), jnp.asarray(mask))


def test_dapo_hand_example():
    logp, old, adv, mask = _dapo_example()
    cfg = PolicyLossConfig()  # eps 0.2 / 0.28, dual clip 10, token-mean
    # Per token (A = +1): r=1 -> -1; r=1.5 -> max(-1.5, -1.28) = -1.28 (clip high); r=0.5 -> -0.5.
    # (A = -2): r=0.7 -> max(1.4, 1.6) = 1.6 (clip low); r=1.2 -> 2.4; r=20 -> max(40, 2.56) = 40,
    # dual clip -> min(40, 2 * 10) = 20.
    per_token = np.array([[-1.0, -1.28, -0.5], [1.6, 2.4, 20.0]])
    loss_sum, denom, m = policy_loss(logp, old, adv, mask, cfg=cfg)
    np.testing.assert_allclose(loss_sum, per_token.sum(), rtol=1e-5)  # 21.22
    assert float(denom) == 6.0
    fm = finalize_metrics(m)
    np.testing.assert_allclose(fm["pg_loss"], 21.22 / 6, rtol=1e-5)
    np.testing.assert_allclose([fm["clip_frac_low"], fm["clip_frac_high"], fm["clip_frac_dual"]],
                               [1 / 6, 1 / 6, 1 / 6], rtol=1e-6)
    r = np.array([1.0, 1.5, 0.5, 0.7, 1.2, 20.0])
    np.testing.assert_allclose(fm["ratio_mean"], r.mean(), rtol=1e-5)
    np.testing.assert_allclose(fm["ratio_std"], r.std(), rtol=1e-4)
    np.testing.assert_allclose(fm["approx_kl_k1"], np.mean(-np.log(r)), rtol=1e-4)
    np.testing.assert_allclose(fm["approx_kl"], np.mean(r - 1 - np.log(r)), rtol=1e-4)

    # Token weights multiply the per-token loss: -2 - 1.28 - 0.5 + 1.6 + 1.2 + 20 = 19.02.
    weights = jnp.array([[2.0, 1.0, 1.0, 5.0], [1.0, 0.5, 1.0, 5.0]])
    loss_sum, _, _ = policy_loss(logp, old, adv, mask, token_weights=weights, cfg=cfg)
    np.testing.assert_allclose(loss_sum, 19.02, rtol=1e-5)

    # Sequence means: (-2.78 / 3 + 24 / 3) over 2 sequences.
    s, d, _ = policy_loss(logp, old, adv, mask, cfg=PolicyLossConfig(agg="seq-mean-token-mean"))
    np.testing.assert_allclose(float(s) / float(d), (-2.78 / 3 + 24 / 3) / 2, rtol=1e-5)
    s, d, _ = policy_loss(logp, old, adv, mask, cfg=PolicyLossConfig(agg="seq-mean-token-sum"))
    np.testing.assert_allclose(float(s) / float(d), 21.22 / 2, rtol=1e-5)
    s, d, _ = policy_loss(logp, old, adv, mask,
                          cfg=PolicyLossConfig(agg="seq-mean-token-sum-norm", drgrpo_norm=8.0))
    np.testing.assert_allclose(float(s) / float(d), 21.22 / 8 / 2, rtol=1e-5)
    # Without dual clip the r=20 token costs 40; with a symmetric PPO clip r=1.5 costs -1.2.
    s, _, _ = policy_loss(logp, old, adv, mask, cfg=PolicyLossConfig(dual_clip=None))
    np.testing.assert_allclose(s, 21.22 + 20.0, rtol=1e-5)
    s, _, _ = policy_loss(logp, old, adv, mask, cfg=PolicyLossConfig(eps_high=0.2))
    np.testing.assert_allclose(s, 21.22 + 0.08, rtol=1e-5)


def test_weights_equal_scaled_advantages():
    """Spec 2.8: for w > 0, weighting the per-token loss == replacing A by A * w."""
    rng = np.random.default_rng(1)
    B, T = 4, 6
    old = jnp.asarray(rng.normal(size=(B, T)) - 2)
    logp = old + jnp.asarray(rng.normal(scale=0.4, size=(B, T)))
    adv = jnp.asarray(rng.normal(size=(B,)))
    w = jnp.asarray(rng.uniform(0.8, 1.2, size=(B, T)))
    mask = jnp.ones((B, T))
    cfg = PolicyLossConfig(dual_clip=3.0)
    f1 = lambda lp: policy_loss(lp, old, adv, mask, token_weights=w, cfg=cfg)[0]  # noqa: E731
    f2 = lambda lp: policy_loss(lp, old, adv[:, None] * w, mask, cfg=cfg)[0]  # noqa: E731
    np.testing.assert_allclose(f1(logp), f2(logp), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(f1)(logp), jax.grad(f2)(logp), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradient_matches_finite_differences(agg):
    rng = np.random.default_rng(2)
    B, T = 3, 5
    with jax.enable_x64(True):  # float64 context (jax 0.10: jax.enable_x64)
        old = jnp.asarray(rng.normal(size=(B, T)) - 1.5)
        # Ratios spread over the clipped, unclipped and dual-clipped regions, away from the kinks.
        log_r = rng.choice([-0.6, -0.1, 0.05, 0.15, 0.5, 2.6], size=(B, T)) + rng.uniform(
            -0.02, 0.02, size=(B, T))
        logp = old + jnp.asarray(log_r)
        ref = old + jnp.asarray(rng.normal(scale=0.3, size=(B, T)))
        ent0 = jnp.asarray(rng.uniform(0.5, 2.0, size=(B, T)))
        adv = jnp.asarray(rng.normal(size=(B, T)))
        w = jnp.asarray(rng.uniform(0.8, 1.2, size=(B, T)))
        mask = jnp.asarray((np.arange(T)[None] < np.array([5, 3, 4])[:, None]).astype(np.float64))
        cfg = PolicyLossConfig(dual_clip=10.0, agg=agg, drgrpo_norm=7.0, kl_type="k3",
                               kl_coef=0.1, entropy_coef=0.01)

        def loss(lp, ent):
            s, d, _ = policy_loss(lp, old, adv, mask, token_weights=w, cfg=cfg, ref_logp=ref,
                                  entropy=ent)
            return s / d

        loss = jax.jit(loss)
        g_lp, g_ent = jax.grad(loss, argnums=(0, 1))(logp, ent0)
        assert g_lp.dtype == jnp.float64
        eps = 1e-6
        fd_lp = np.zeros((B, T))
        fd_ent = np.zeros((B, T))
        for b in range(B):
            for t in range(T):
                e = jnp.zeros((B, T)).at[b, t].set(eps)
                fd_lp[b, t] = (loss(logp + e, ent0) - loss(logp - e, ent0)) / (2 * eps)
                fd_ent[b, t] = (loss(logp, ent0 + e) - loss(logp, ent0 - e)) / (2 * eps)
        np.testing.assert_allclose(g_lp, fd_lp, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(g_ent, fd_ent, rtol=1e-6, atol=1e-9)
        assert np.all(np.asarray(g_lp)[np.asarray(mask) == 0] == 0)
        assert np.abs(g_lp).max() > 1e-3


@pytest.mark.parametrize("objective", [dict(), dict(surrogate="sapo"), dict(fipo=True)])
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batch_accumulation_is_exact(agg, ratio_level, objective):
    rng = np.random.default_rng(3)
    B, T = 6, 7
    old = rng.normal(size=(B, T)) - 2
    logp = old + rng.normal(scale=0.5, size=(B, T))
    adv = rng.normal(size=(B,))
    w = rng.uniform(0.5, 1.5, size=(B, T))
    lengths = np.array([7, 2, 5, 0, 3, 6])  # one fully padded row
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    ent = rng.uniform(0, 2, size=(B, T))
    ref = old + rng.normal(scale=0.2, size=(B, T))
    cfg = PolicyLossConfig(agg=agg, drgrpo_norm=16.0, kl_type="k2", kl_coef=0.05,
                           entropy_coef=0.01, ratio_level=ratio_level, **objective)
    as_j = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def run(rows, t_max=T):
        s = (rows, slice(0, t_max))
        return policy_loss(as_j(logp[s]), as_j(old[s]), as_j(adv[rows]), as_j(mask[s]),
                           token_weights=as_j(w[s]), cfg=cfg, ref_logp=as_j(ref[s]),
                           entropy=as_j(ent[s]))

    full_sum, full_den, full_m = run(slice(0, B))
    # Micro-batches of 2 sequences, each trimmed to its own padded length.
    parts = [run(slice(0, 2)), run(slice(2, 4), 5), run(slice(4, 6))]
    acc_sum = sum(float(p[0]) for p in parts)
    acc_den = sum(float(p[1]) for p in parts)
    np.testing.assert_allclose(acc_sum / acc_den, float(full_sum) / float(full_den), rtol=1e-5)
    acc_m = jax.tree.map(lambda *xs: sum(xs), *[p[2] for p in parts])
    for key, value in finalize_metrics(acc_m).items():
        np.testing.assert_allclose(value, finalize_metrics(full_m)[key], rtol=1e-5, atol=1e-7,
                                   err_msg=key)
    expected_den = {"token-mean": mask.sum()}.get(agg, 5.0)  # 5 non-empty sequences
    assert float(full_den) == expected_den


def _sapo_numpy(ratio, adv, tau_pos, tau_neg):
    """SAPO's per-token loss and gradient gate, written out from its paper's definitions:
    f(r) = (4 / tau) sigmoid(tau (r - 1)), objective f(r) A (maximised), df/dr = 4 s (1 - s)."""
    tau = np.where(adv > 0, tau_pos, tau_neg)
    s = 1.0 / (1.0 + np.exp(-tau * (ratio - 1.0)))
    return -(4.0 / tau) * s * adv, 4.0 * s * (1.0 - s)


def test_sapo_soft_gate_value_gradient_and_metrics():
    """surrogate="sapo": the loss is SAPO's objective (token-mean), its gradient with respect to
    log pi is -w * gate * r * A / #tokens, nothing is clipped, and the logged gate is the mean of
    4 s (1 - s); per-token weights multiply it."""
    rng = np.random.default_rng(5)
    B, T = 4, 6
    old = rng.normal(size=(B, T)) - 2
    logp = old + rng.normal(scale=0.6, size=(B, T))
    adv = np.array([[1.5], [-0.7], [0.0], [-2.0]]) * np.ones((1, T))
    adv[0, 2] = -0.3  # per-token advantages of both signs in one row
    mask = (np.arange(T)[None] < np.array([6, 4, 5, 3])[:, None]).astype(np.float64)
    w = rng.uniform(0.5, 1.5, size=(B, T))
    cfg = PolicyLossConfig(surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    ratio = np.exp(logp - old)
    per_token, gate = _sapo_numpy(ratio, adv, 1.0, 1.05)
    valid = mask > 0
    n = mask.sum()
    f64 = lambda x: jnp.asarray(x, jnp.float64)  # noqa: E731
    with jax.enable_x64(True):
        def loss(lp):
            s, d, _ = policy_loss(lp, f64(old), f64(adv), f64(mask), token_weights=f64(w),
                                  cfg=cfg)
            return s / d
        value, grad = jax.value_and_grad(loss)(f64(logp))
        # as numpy float64: jnp comparisons of float64 arrays after the x64 context warn
        fm = jax.device_get(finalize_metrics(policy_loss(f64(logp), f64(old), f64(adv),
                                                         f64(mask), cfg=cfg)[2]))
        clipped = jax.device_get(finalize_metrics(policy_loss(f64(logp), f64(old), f64(adv),
                                                              f64(mask))[2]))
    np.testing.assert_allclose(value, (w * per_token)[valid].sum() / n, rtol=1e-10)
    want_grad = np.where(valid, -w * gate * ratio * adv / n, 0.0)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(fm["sapo_gate"], gate[valid].mean(), rtol=1e-10)
    assert fm["clip_frac_low"] == fm["clip_frac_high"] == fm["clip_frac_dual"] == 0
    assert 0 < fm["sapo_gate"] < 1 and "sapo_gate" not in clipped
    assert clipped["clip_frac_low"] + clipped["clip_frac_high"] > 0  # the same ratios clip


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    """At r = 1 (the first update of a rollout) the gate is 1: SAPO's gradient equals the clipped
    surrogate's, -A / #tokens per token, for either sign of A and any temperatures; off policy
    a token far from r = 1 keeps less of it (a larger tau fades it faster)."""
    logp = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]])
    adv = jnp.array([0.8, -1.3])
    mask = jnp.ones((2, 3))

    def grad(cfg, lp, old):
        return jax.grad(lambda x: policy_loss(x, old, adv, mask, cfg=cfg)[0])(lp)

    clip_grad = grad(PolicyLossConfig(), logp, logp)
    np.testing.assert_allclose(clip_grad, -np.asarray(adv)[:, None] * np.ones((2, 3)),
                               rtol=1e-6)
    for taus in ((1.0, 1.05), (0.3, 4.0)):
        cfg = PolicyLossConfig(surrogate="sapo", sapo_tau_pos=taus[0], sapo_tau_neg=taus[1])
        np.testing.assert_allclose(grad(cfg, logp, logp), clip_grad, rtol=1e-6)
    off = logp - jnp.log(2.0)  # r = 2 everywhere
    kept = [np.abs(np.asarray(grad(PolicyLossConfig(surrogate="sapo", sapo_tau_pos=t,
                                                    sapo_tau_neg=t), logp, off))).sum()
            for t in (0.5, 1.0, 4.0)]
    assert kept[0] > kept[1] > kept[2]


def _future_kl_numpy(log_ratio, mask, gamma, skip_over=None):
    """FutureKL_t = sum_{k >= t, k valid} gamma^(k - t) d_k by a loop over the later tokens
    (d = 0 where the ratio is over skip_over), 0 on padding."""
    B, T = log_ratio.shape
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            for k in range(t, T):
                keep = mask[b, k] and (skip_over is None or np.exp(log_ratio[b, k]) <= skip_over)
                out[b, t] += gamma ** (k - t) * log_ratio[b, k] * keep
    return out


def test_future_sums_match_a_loop_and_stay_finite_on_long_responses():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, 37))
    want = _future_kl_numpy(x, np.ones_like(x, bool), 0.9)
    with jax.enable_x64(True):
        np.testing.assert_allclose(future_sums(jnp.asarray(x), 0.9), want, rtol=1e-12)
    # 20,480 tokens at decay 32 (gamma^T ~ 1e-193 would underflow float32 in a closed form).
    long = np.full((1, 20480), 0.01, np.float32)
    got = np.asarray(future_sums(jnp.asarray(long), 2.0 ** (-1 / 32)))
    gamma = 2.0 ** (-1 / 32)
    tail = 0.01 * (1 - gamma ** np.arange(20480, 0, -1)) / (1 - gamma)  # geometric sums
    np.testing.assert_allclose(got[0], tail, rtol=1e-4)


def test_fipo_weights_value_clip_filter_and_safety():
    """FIPO's weights against the loop reference: clipped to [1, 1 + c] (or [1 - c, 1 + c]),
    tokens over the dual-clip ratio left out of the sums, negative-advantage tokens over the
    safety ratio never amplified, 0 on padding; the loss is the clipped surrogate times them,
    and they carry no gradient."""
    rng = np.random.default_rng(11)
    B, T = 4, 9
    old = rng.normal(size=(B, T)) - 2
    d = rng.normal(scale=0.15, size=(B, T))
    d[0, 3] = np.log(12.0)  # over dual_clip = 10: out of the sums (its own weight still set)
    d[1, 6] = np.log(5.0)   # over the safety ratio 4, in a negative-advantage row
    logp = old + d
    adv = np.array([0.9, -1.1, 0.4, -0.2])
    mask = (np.arange(T)[None] < np.array([9, 8, 5, 2])[:, None])
    gamma = 2.0 ** (-1 / 4.0)
    future_kl = _future_kl_numpy(d, mask, gamma, skip_over=10.0)
    for high_only in (True, False):
        cfg = PolicyLossConfig(fipo=True, fipo_decay_rate=4.0, fipo_clip=0.2,
                               fipo_clip_high_only=high_only, fipo_safety_threshold=4.0)
        want = np.clip(np.exp(future_kl), 1.0 if high_only else 0.8, 1.2)
        want[1, 6] = min(want[1, 6], 1.0)
        want = np.where(mask, want, 0.0)
        got_w, got_kl = fipo_weights(jnp.asarray(d), jnp.asarray(adv)[:, None] * jnp.ones((B, T)),
                                     jnp.asarray(mask), cfg)
        np.testing.assert_allclose(got_kl, future_kl, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_w, want, rtol=1e-6)
        assert np.any((want > 1.0) & (want < 1.2)) and np.any(want == 1.2)  # every branch
        assert high_only or np.any((want < 1.0) & mask)
        as_j = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

        def loss(lp, cfg=cfg):
            s, n, _ = policy_loss(lp, as_j(old), as_j(adv), as_j(mask), cfg=cfg)
            return s / n

        plain = dataclasses.replace(cfg, fipo=False)
        # The same per-token surrogate, scaled by the weights (constants of the gradient).
        per_token = jax.grad(lambda lp: policy_loss(lp, as_j(old), as_j(adv), as_j(mask),
                                                    cfg=plain)[0])(as_j(logp))
        np.testing.assert_allclose(jax.grad(loss)(as_j(logp)) * mask.sum(), per_token * want,
                                   rtol=1e-5, atol=1e-7)
    sums = policy_loss(as_j(logp), as_j(old), as_j(adv), as_j(mask), cfg=cfg)[2]
    fm = finalize_metrics(sums)
    np.testing.assert_allclose(fm["fipo_weight"], want[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(fm["fipo_future_kl"], future_kl[mask].mean(), rtol=1e-4)


def test_fipo_leaves_out_responses_with_more_than_one_dual_clipped_token():
    """As FIPO's code does: a response with more than one token where the dual clip binds (A < 0,
    ratio over dual_clip) leaves the loss, its tokens out of the sum and the denominator (no
    gradient); one such token, or ratios over dual_clip at a positive advantage, keep it; DAPO
    (fipo off) keeps every response; fipo_dropped logs the share of the responses dropped; the
    micro-batch split still accumulates exactly."""
    rng = np.random.default_rng(13)
    B, T = 4, 6
    old = rng.normal(size=(B, T)) - 2
    d = rng.normal(scale=0.1, size=(B, T))
    adv = np.array([-1.0, -0.5, 0.7, -0.3])
    d[0, 1] = d[0, 4] = np.log(12.0)  # two dual-clipped tokens: dropped
    d[1, 2] = np.log(12.0)            # one: kept
    d[2, 0] = d[2, 3] = np.log(12.0)  # A > 0, not dual clipped: kept
    mask = (np.arange(T)[None] < np.array([6, 5, 6, 3])[:, None]).astype(np.float32)
    as_j = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    cfg = PolicyLossConfig(fipo=True)  # dual_clip 10

    def run(rows, cfg=cfg):
        return policy_loss(as_j((old + d)[rows]), as_j(old[rows]), as_j(adv[rows]),
                           as_j(mask[rows]), cfg=cfg)

    loss_sum, denom, metrics = run(slice(0, B))
    # The reference from the pieces tested above: the clipped surrogate times the weights,
    # summed over the kept responses' tokens.
    surrogate, flags = clipped_surrogate(as_j(d), as_j(adv)[:, None], cfg.eps_low, cfg.eps_high,
                                         cfg.dual_clip)
    weights, _ = fipo_weights(as_j(d), as_j(adv)[:, None] * jnp.ones((B, T)), as_j(mask) > 0, cfg)
    np.testing.assert_array_equal((np.asarray(flags["dual"]) * mask).sum(-1), [2, 1, 0, 0])
    kept = np.array([0.0, 1.0, 1.0, 1.0])[:, None] * mask
    np.testing.assert_allclose(float(loss_sum), float((surrogate * weights * kept).sum()),
                               rtol=1e-6)
    assert float(denom) == kept.sum() == mask.sum() - 6
    np.testing.assert_allclose(finalize_metrics(metrics)["fipo_dropped"], 0.25)
    grad = jax.grad(lambda lp: policy_loss(lp, as_j(old), as_j(adv), as_j(mask), cfg=cfg)[0])(
        as_j(old + d))
    assert np.all(np.asarray(grad)[0] == 0) and np.abs(np.asarray(grad)[1:]).max() > 1e-3
    # With a KL and an entropy term the dropped response leaves those too.
    extra = dataclasses.replace(cfg, kl_type="k3", kl_coef=0.1, entropy_coef=0.01)
    ent = as_j(rng.uniform(0.1, 2.0, size=(B, T)))
    g_lp, g_ent = jax.grad(lambda lp, e: policy_loss(
        lp, as_j(old), as_j(adv), as_j(mask), cfg=extra, ref_logp=as_j(old - 0.2),
        entropy=e)[0], argnums=(0, 1))(as_j(old + d), ent)
    assert np.all(np.asarray(g_lp)[0] == 0) and np.all(np.asarray(g_ent)[0] == 0)
    assert np.all(np.asarray(g_ent)[1:][mask[1:] > 0] != 0)
    # DAPO keeps the response.
    assert float(run(slice(0, B), dataclasses.replace(cfg, fipo=False))[1]) == mask.sum()
    # Two micro-batches of two responses.
    parts = [run(slice(0, 2)), run(slice(2, 4))]
    np.testing.assert_allclose(sum(float(p[0]) for p in parts) / sum(float(p[1]) for p in parts),
                               float(loss_sum) / float(denom), rtol=1e-6)


def test_fipo_on_policy_is_the_clipped_surrogate():
    """At the first update of a rollout (pi = pi_old) every weight is 1: FIPO's loss and gradient
    are DAPO's."""
    logp = jnp.array([[-1.0, -2.0, -0.5, -0.1], [-0.3, -1.2, -4.0, -0.7]])
    adv, mask = jnp.array([0.8, -1.3]), jnp.array([[1, 1, 1, 1], [1, 1, 0, 0]], jnp.float32)

    def value_and_grad(cfg):
        return jax.value_and_grad(lambda lp: policy_loss(lp, logp, adv, mask, cfg=cfg)[0])(logp)

    (v_f, g_f), (v_d, g_d) = value_and_grad(PolicyLossConfig(fipo=True)), value_and_grad(
        PolicyLossConfig())
    np.testing.assert_allclose(v_f, v_d, rtol=1e-7)
    np.testing.assert_allclose(g_f, g_d, rtol=1e-7)


def test_kl_estimators():
    lp = jnp.array([-1.0, -2.0, -0.3])
    ref = jnp.array([-1.5, -1.0, -0.3])
    d = np.array([0.5, -1.0, 0.0])
    np.testing.assert_allclose(kl_penalty(lp, ref, "k1"), d, rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(lp, ref, "k2"), 0.5 * d ** 2, rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(lp, ref, "k3"), np.exp(-d) + d - 1, rtol=1e-6, atol=1e-7)
    # k3 is unbiased for KL(p || q): E_p[k3] = KL on a small discrete example.
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.5, 0.3])
    k3 = np.asarray(kl_penalty(jnp.log(p), jnp.log(q), "k3"))
    np.testing.assert_allclose((p * k3).sum(), (p * np.log(p / q)).sum(), rtol=1e-5)


def test_aggregate_and_config_errors():
    x = jnp.ones((2, 3))
    m = jnp.array([[1, 1, 0], [0, 0, 0]])
    assert [float(v) for v in aggregate(x, m, "seq-mean-token-mean")] == [1.0, 1.0]
    with pytest.raises(ValueError, match="agg"):
        PolicyLossConfig(agg="mean")
    with pytest.raises(ValueError, match="drgrpo_norm"):
        PolicyLossConfig(agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossConfig(dual_clip=1.1)
    with pytest.raises(ValueError, match="kl_type"):
        PolicyLossConfig(kl_type="k4")
    with pytest.raises(ValueError, match="ratio_level"):
        PolicyLossConfig(ratio_level="group")
    with pytest.raises(ValueError, match="surrogate"):
        PolicyLossConfig(surrogate="soft")
    with pytest.raises(ValueError, match="sapo_tau"):
        PolicyLossConfig(surrogate="sapo", sapo_tau_neg=0.0)
    with pytest.raises(ValueError, match="fipo weights the clipped surrogate"):
        PolicyLossConfig(fipo=True, surrogate="sapo")
    with pytest.raises(ValueError, match="fipo_decay_rate"):
        PolicyLossConfig(fipo=True, fipo_decay_rate=0.0)
    logp, old, adv, mask = _dapo_example()
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, cfg=PolicyLossConfig(kl_type="k3", kl_coef=0.1))
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(logp, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:1], mask)


# ----------------------------------------------------------------------------- GSPO


def _gspo_reference(logp, old, adv, mask, eps_low, eps_high):
    """GSPO's objective as its paper writes it (arXiv 2507.18071, eqs. 5-7), as a loss:
    s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|), loss = -(1/G) sum_i min(s_i A_i,
    clip(s_i, 1 - eps_low, 1 + eps_high) A_i) over the responses with a token."""
    m = mask > 0
    n = m.sum(-1)
    s = jnp.exp(jnp.where(m, logp - old, 0.0).sum(-1) / jnp.maximum(n, 1))
    per_seq = jnp.minimum(s * adv, jnp.clip(s, 1 - eps_low, 1 + eps_high) * adv)
    return -jnp.where(n > 0, per_seq, 0.0).sum() / (n > 0).sum()


def test_sequence_ratio_is_gspo_sequence_objective():
    """ratio_level="sequence" with seq-mean-token-mean and per-response advantages: value and
    gradient equal GSPO's sequence objective (float64), whose responses cover every case: ratio
    inside the clip range, clipped high (A > 0), clipped low (A < 0), clipped on the side that does
    not bind, a response of one token, one without any (all padding) and inf in the padding."""
    rng = np.random.default_rng(5)
    B, T = 7, 6
    lengths = np.array([6, 4, 5, 3, 1, 0, 6])
    # Mean log-ratio per response; the paper's clip range is 3e-4 / 4e-4.
    seq_shift = np.array([1e-4, 9e-4, -9e-4, 9e-4, -2e-4, 0.0, -9e-4])
    adv = np.array([1.0, 0.7, -1.3, -0.4, 2.0, 1.0, 0.5])
    with jax.enable_x64(True):
        old = rng.normal(size=(B, T)) - 2
        noise = rng.normal(scale=0.05, size=(B, T))
        mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
        # Token log-ratios spread around the response's mean (noise with its own mean removed).
        noise -= (noise * mask).sum(-1, keepdims=True) / np.maximum(mask.sum(-1, keepdims=True), 1)
        logp = old + (seq_shift[:, None] + noise) * mask
        logp[mask == 0] = np.inf
        logp, old, adv, mask = map(jnp.asarray, (logp, old, adv, mask))
        cfg = PolicyLossConfig(eps_low=3e-4, eps_high=4e-4, dual_clip=None,
                               agg="seq-mean-token-mean", ratio_level="sequence")

        def ours(lp):
            s, d, _ = policy_loss(lp, old, adv, mask, cfg=cfg)
            return s / d

        def reference(lp):
            return _gspo_reference(lp, old, adv, mask, 3e-4, 4e-4)

        finite = jnp.where(mask > 0, logp, old)  # the reference needs finite padding
        np.testing.assert_allclose(ours(logp), reference(finite), rtol=1e-12)
        g, g_ref = jax.grad(ours)(logp), jax.grad(reference)(finite)
        assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[np.asarray(mask) == 0] == 0)
        np.testing.assert_allclose(g, g_ref, rtol=1e-10, atol=1e-14)
        # Rows 1 (A > 0, s > 1 + eps_high) and 2 (A < 0, s < 1 - eps_low) are clipped: no gradient;
        # row 3 (A < 0, s > 1 + eps_high) is not; row 0 sits inside the range.
        grad_rows = np.abs(np.asarray(g)).sum(-1)
        assert grad_rows[1] == 0 and grad_rows[2] == 0 and grad_rows[5] == 0
        assert np.all(grad_rows[[0, 3, 4, 6]] > 1e-3)
        # The token-level ratio on the same inputs is another objective (its clipping differs).
        s, d, _ = policy_loss(logp, old, adv, mask,
                              cfg=dataclasses.replace(cfg, ratio_level="token"))
        assert abs(float(s / d) - float(ours(logp))) > 1e-6


def test_sequence_ratio_with_token_advantages_and_weights():
    """GSPO-token: inside the clip range the gradient of token t of response i is
    -A_{i,t} w_{i,t} s_i / |y_i| per response (seq-mean-token-mean over G responses), the
    sequence's ratio s_i multiplying each token's own score; every token of a response reports
    the same ratio, and the KL metrics stay per token."""
    rng = np.random.default_rng(6)
    B, T = 3, 5
    lengths = np.array([5, 2, 4])
    mask = jnp.asarray((np.arange(T)[None] < lengths[:, None]).astype(np.float32))
    old = jnp.asarray(rng.normal(size=(B, T)) - 2, jnp.float32)
    log_r = jnp.asarray(rng.normal(scale=0.1, size=(B, T)), jnp.float32)
    logp = old + log_r
    adv = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, size=(B, T)), jnp.float32)
    cfg = PolicyLossConfig(eps_low=0.9, eps_high=10.0, dual_clip=None, agg="seq-mean-token-mean",
                           ratio_level="sequence")
    g = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, token_weights=w, cfg=cfg)[0])(logp)
    m = np.asarray(mask)
    s = np.exp((np.asarray(log_r) * m).sum(-1) / lengths)
    expected = -np.asarray(adv) * np.asarray(w) * s[:, None] / lengths[:, None] * m
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)
    _, _, metrics = policy_loss(logp, old, adv, mask, token_weights=w, cfg=cfg)
    fm = finalize_metrics(metrics)
    np.testing.assert_allclose(fm["ratio_mean"], (s * lengths).sum() / lengths.sum(), rtol=1e-5)
    token = finalize_metrics(policy_loss(logp, old, adv, mask, token_weights=w,
                                         cfg=dataclasses.replace(cfg, ratio_level="token"))[2])
    for key in ("approx_kl", "approx_kl_k1"):
        np.testing.assert_allclose(fm[key], token[key], rtol=1e-6)
    # Responses whose token ratios are all equal: the two levels are the same loss.
    flat = old + jnp.asarray([[0.05], [-0.2], [0.4]], jnp.float32)
    for level_cfg in (cfg, PolicyLossConfig(ratio_level="sequence")):
        a = policy_loss(flat, old, adv, mask, token_weights=w, cfg=level_cfg)[0]
        b = policy_loss(flat, old, adv, mask, token_weights=w,
                        cfg=dataclasses.replace(level_cfg, ratio_level="token"))[0]
        np.testing.assert_allclose(a, b, rtol=1e-6)
