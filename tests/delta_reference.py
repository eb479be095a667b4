"""An independent float64 NumPy transcription of DelTA (DELTA_SPEC section 2) and a random
rollout batch, shared by tests/test_delta.py and tests/test_delta_sharded.py (not a test module).

The reference is written from the spec text (squared-distance margins, explicit loops) and never
calls delta_jax. Its keyword options are the paper's ablation rows (DELTA_SPEC section 4, config
delta.*), transcribed from their definitions:

  fixed_gamma > 0     gamma+ = gamma- = fixed_gamma in every use (refinement alphas, final alpha*)
  assignment="hard"   alpha = 1[Delta > 0] instead of sigmoid(Delta / gamma), in both places
  normalize=False     c = 1: w = lambda
  weight="alpha"      lambda = alpha* on P and N, 0 on Z
  random_u=u [B, T]   the random-lambda control given its Uniform[0, 1) draws u:
                      lambda = lam_min + (lam_max - lam_min) u on P and N, lam_min on Z
"""
import numpy as np


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def reference_delta(v, adv, mask, num_refine=1, lam_min=0.8, lam_max=1.2, *, fixed_gamma=0.0,
                    assignment="soft", normalize=True, weight="lambda", random_u=None):
    """Spec 2.1-2.7 in float64. v [B, T, H], adv [B] or [B, T], mask [B, T]; the keyword options
    are the ablations of the module docstring (defaults: the full method).

    Returns (weights [B, T], info dict with gamma, mu, accuracy, counts, c).
    """
    assert assignment in ("soft", "hard") and weight in ("lambda", "alpha")
    v = np.asarray(v, np.float64)
    mask = np.asarray(mask)
    adv = np.asarray(adv, np.float64)
    B, T, _ = v.shape
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], T, axis=1)
    pos = [(b, t) for b in range(B) for t in range(T) if mask[b, t] > 0 and adv[b, t] > 0]
    neg = [(b, t) for b in range(B) for t in range(T) if mask[b, t] > 0 and adv[b, t] < 0]
    zero = [(b, t) for b in range(B) for t in range(T) if mask[b, t] > 0 and adv[b, t] == 0]

    def centroid(tokens, alpha):
        num = np.zeros(v.shape[-1])
        den = 0.0
        for (b, t) in tokens:
            w = abs(adv[b, t]) * alpha.get((b, t), 1.0)
            num += w * v[b, t]
            den += w
        return num / max(den, 1e-8)

    def margins(mu_p, mu_n):
        out = {}
        for (b, t) in pos:
            out[(b, t)] = np.sum((v[b, t] - mu_n) ** 2) - np.sum((v[b, t] - mu_p) ** 2)
        for (b, t) in neg:
            out[(b, t)] = np.sum((v[b, t] - mu_p) ** 2) - np.sum((v[b, t] - mu_n) ** 2)
        return out

    def temperature(tokens, delta):
        if fixed_gamma > 0:
            return float(fixed_gamma)
        vals = np.array([delta[k] for k in tokens], np.float64)
        n = max(len(vals), 1)
        mean = vals.sum() / n
        var = np.sum((vals - mean) ** 2) / n
        return np.sqrt(max(var, 1e-8))

    def alphas(delta, g_p, g_n):
        out = {}
        for k in pos:
            out[k] = (1.0 if delta[k] > 0 else 0.0) if assignment == "hard" else _sigmoid(
                delta[k] / g_p)
        for k in neg:
            out[k] = (1.0 if delta[k] > 0 else 0.0) if assignment == "hard" else _sigmoid(
                delta[k] / g_n)
        return out

    mu_p, mu_n = centroid(pos, {}), centroid(neg, {})
    delta = margins(mu_p, mu_n)
    g_p, g_n = temperature(pos, delta), temperature(neg, delta)
    for _ in range(num_refine):
        alpha = alphas(delta, g_p, g_n)
        new_mu_p, new_mu_n = centroid(pos, alpha), centroid(neg, alpha)
        g_p, g_n = temperature(pos, delta), temperature(neg, delta)  # lagged: std of Delta(mu^k)
        mu_p, mu_n = new_mu_p, new_mu_n
        delta = margins(mu_p, mu_n)
    alpha = alphas(delta, g_p, g_n)
    lam = np.zeros((B, T))
    for k in pos + neg:
        if random_u is not None:
            lam[k] = lam_min + (lam_max - lam_min) * float(random_u[k])
        elif weight == "alpha":
            lam[k] = alpha[k]
        else:
            lam[k] = lam_min + (lam_max - lam_min) * alpha[k]
    for k in zero:
        lam[k] = 0.0 if weight == "alpha" else lam_min
    n_tok = len(pos) + len(neg) + len(zero)
    c = n_tok / max(lam.sum(), 1e-8) if normalize else 1.0
    weights = c * lam
    correct = sum(1 for k in pos + neg if delta[k] > 0)  # sign(A) s > 0  <=>  Delta > 0
    info = dict(gamma=(g_p, g_n), mu=(mu_p, mu_n), c=c, tokens=(len(pos), len(neg), len(zero)),
                accuracy=correct / max(len(pos) + len(neg), 1), sides=(pos, neg, zero))
    return weights, info


def make_batch(seed, B=8, T=9, H=6, group=4, zero_group=True):
    """Random rollout batch: binary rewards -> GRPO advantages (one zero-variance group when
    zero_group), ragged lengths with garbage in the padding."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, T, H)) + rng.normal(size=(1, 1, H))
    # Sequences of the two sides differ a little in feature space, as they would in practice.
    rewards = rng.integers(0, 2, size=B).astype(np.float64)
    rewards[:group] = [1, 0, 1, 0][:group] if group >= 4 else rewards[:group]
    if zero_group:
        rewards[-group:] = 1.0
    hidden += 0.5 * rewards[:, None, None] * rng.normal(size=(1, 1, H))
    grouped = rewards.reshape(-1, group)
    adv = ((grouped - grouped.mean(1, keepdims=True))
           / (grouped.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    prob = rng.uniform(0.01, 0.99, size=(B, T))
    lengths = rng.integers(2, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    hidden = np.where(mask[..., None] > 0, hidden, 1e4 * rng.normal(size=(B, T, H)))
    return (hidden.astype(np.float32), prob.astype(np.float32), adv.astype(np.float32), mask)


def proxy64(hidden, prob):
    return (1.0 - prob.astype(np.float64))[..., None] * hidden.astype(np.float64)
