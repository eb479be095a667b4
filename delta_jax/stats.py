"""Small-sample statistics for comparing runs: Student-t intervals, the paired t-test, an exact
sign-flip permutation test, and a paired comparison built from them.

Used by the end-of-run report (delta_jax.train.plots: the change of each held-out metric over the
evaluated questions, before vs after RL) and by benchmarks/compare_methods.py (methods over seeds,
paired by seed). Arrays in, floats out; float64 throughout.
"""
from __future__ import annotations

import itertools
import math

import numpy as np


def t_interval(x, confidence: float = 0.95) -> tuple[float, float, float, float]:
    """(mean, sample sd, lower, upper): the Student-t confidence interval of the mean of x
    (n - 1 degrees of freedom). With fewer than 2 values sd and the bounds are nan."""
    from scipy import special  # the t distribution without scipy.stats' ~1 s import
    x = np.asarray(x, np.float64)
    n = len(x)
    if n == 0:
        return (math.nan,) * 4
    mean = float(x.mean())
    if n < 2:
        return mean, math.nan, math.nan, math.nan
    sd = float(x.std(ddof=1))
    half = float(special.stdtrit(n - 1, 0.5 + confidence / 2)) * sd / math.sqrt(n)
    return mean, sd, mean - half, mean + half


def paired_t_test(a, b) -> tuple[float, float]:
    """(t, two-sided p) of the paired t-test of a - b against 0 (scipy.stats.ttest_rel(a, b));
    nan with fewer than 2 pairs or when every difference is the same (no variance)."""
    from scipy import special
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    n = len(d)
    if n < 2:
        return math.nan, math.nan
    sd = d.std(ddof=1)
    if not sd > 0:
        return math.nan, math.nan
    t = float(d.mean() / (sd / math.sqrt(n)))
    return t, float(2 * special.stdtr(n - 1, -abs(t)))


def sign_flip_p(d) -> float:
    """Exact two-sided sign-flip permutation p-value of mean(d) = 0 for paired differences d:
    the fraction of all 2^n sign patterns s whose |mean(s * d)| is at least |mean(d)| (the
    observed pattern included, so p >= 2 / 2^n when d != 0). nan for no pairs; n <= 20."""
    d = np.asarray(d, np.float64)
    n = len(d)
    if n == 0:
        return math.nan
    if n > 20:
        raise ValueError(f"sign_flip_p enumerates 2^n patterns; n = {n} is too many")
    signs = np.asarray(list(itertools.product((1.0, -1.0), repeat=n)))  # [2^n, n]
    stat = np.abs(signs @ d)
    observed = abs(d.sum())
    return float(np.mean(stat >= observed - 1e-12 * max(1.0, observed)))


def paired_comparison(a, b, confidence: float = 0.95) -> dict:
    """a vs b on the same seeds (equal-length arrays, pair i = seed i): mean difference a - b
    with its t interval, paired t-test and exact sign-flip p-values, wins / losses / ties."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    mean, sd, lo, hi = t_interval(d, confidence)
    t, p_t = paired_t_test(a, b)
    return {"n": int(len(d)), "diff_mean": mean, "diff_sd": sd, "diff_lo": lo, "diff_hi": hi,
            "t": t, "p_t": p_t, "p_sign_flip": sign_flip_p(d), "wins": int((d > 0).sum()),
            "losses": int((d < 0).sum()), "ties": int((d == 0).sum()),
            "per_seed_diff": d.tolist()}
