"""delta_jax.stats against scipy and hand-computed answers."""
import itertools
import math

import numpy as np
import pytest
from scipy import stats

from delta_jax import stats as stats_lib


def test_t_interval_on_known_data():
    # x = 1..5: mean 3, sd sqrt(2.5), se sqrt(2.5 / 5) = 0.70711; t(0.975, 4) = 2.776445.
    mean, sd, lo, hi = stats_lib.t_interval([1, 2, 3, 4, 5])
    assert mean == 3.0 and sd == pytest.approx(math.sqrt(2.5))
    assert lo == pytest.approx(3 - 2.776445 * 0.7071068, abs=1e-5)  # 1.03676
    assert hi == pytest.approx(4.96324, abs=1e-5)
    # 90%: t(0.95, 4) = 2.131847
    _, _, lo90, _ = stats_lib.t_interval([1, 2, 3, 4, 5], confidence=0.90)
    assert lo90 == pytest.approx(3 - 2.131847 * 0.7071068, abs=1e-5)
    one = stats_lib.t_interval([0.4])
    assert one[0] == 0.4 and all(math.isnan(v) for v in one[1:])
    assert all(math.isnan(v) for v in stats_lib.t_interval([]))


def test_paired_t_equals_scipy_ttest_rel():
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 8):
        a, b = rng.normal(0.4, 0.05, n), rng.normal(0.38, 0.05, n)
        t, p = stats_lib.paired_t_test(a, b)
        want = stats.ttest_rel(a, b)
        assert t == pytest.approx(float(want.statistic), rel=1e-10)
        assert p == pytest.approx(float(want.pvalue), rel=1e-10)
    assert all(math.isnan(v) for v in stats_lib.paired_t_test([0.5], [0.4]))
    assert all(math.isnan(v) for v in stats_lib.paired_t_test([0.5, 0.6], [0.4, 0.5]))  # no variance


def test_sign_flip_p_by_hand():
    # d = (1, 2, 3): sums over the 8 sign patterns are 6, 4, 2, 0, 0, -2, -4, -6;
    # |sum| >= 6 for 2 of them.
    assert stats_lib.sign_flip_p([1, 2, 3]) == 0.25
    # d = (1, -1, 2): sums 4, 0, 2, -2, 2, -2, 0, -4; |sum| >= 2 for 6 of 8.
    assert stats_lib.sign_flip_p([1, -1, 2]) == 0.75
    # Five wins: only the observed pattern and its mirror are as extreme: 2 / 32.
    assert stats_lib.sign_flip_p([0.01, 0.02, 0.03, 0.04, 0.05]) == 2 / 32
    assert stats_lib.sign_flip_p([0.0, 0.0]) == 1.0
    assert math.isnan(stats_lib.sign_flip_p([]))
    with pytest.raises(ValueError):
        stats_lib.sign_flip_p(np.ones(21))


def test_sign_flip_p_matches_a_loop_on_random_differences():
    rng = np.random.default_rng(1)
    d = rng.normal(0.01, 0.02, 6)
    obs = abs(d.mean())
    count = sum(abs(np.mean(np.asarray(s) * d)) >= obs - 1e-15
                for s in itertools.product((1, -1), repeat=6))
    assert stats_lib.sign_flip_p(d) == count / 64


def test_paired_comparison_counts_and_interval():
    a = [0.50, 0.40, 0.45, 0.30]
    b = [0.45, 0.42, 0.45, 0.20]
    c = stats_lib.paired_comparison(a, b)
    d = np.subtract(a, b)
    assert (c["n"], c["wins"], c["losses"], c["ties"]) == (4, 2, 1, 1)
    assert c["diff_mean"] == pytest.approx(d.mean())
    half = stats.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert c["diff_lo"] == pytest.approx(d.mean() - half)
    assert c["diff_hi"] == pytest.approx(d.mean() + half)
    assert c["p_t"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
    assert c["p_sign_flip"] == stats_lib.sign_flip_p(d)
