"""delta_jax.train.plots: metric series, before/after eval, weight histograms (vs NumPy), PNGs."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.train import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_rows(rl_steps=6, with_delta=True, final_eval=True):
    """metrics.jsonl rows as the loop writes them: SFT rows, eval at 0, RL rows, eval at the end
    (SFT and RL steps overlap on purpose)."""
    rows = [{"step": s, "sft/loss": 2.0 / s} for s in range(1, 9)]
    rows.append({"step": 0, "eval/average/avg@4": 0.25, "eval/average/pass@4": 0.5})
    for s in range(1, rl_steps + 1):
        row = {"step": s, "rollout/reward_mean": 0.1 * s, "rollout/accuracy": 0.1 * s,
               "rollout/response_len_mean": 10.0 + s, "rollout/response_len_max": 20.0 + s}
        if with_delta:
            for i, side in enumerate(plots.SIDES):
                row[f"delta/weight_mean_{side}"] = 1.1 - 0.1 * i
                row[f"delta/weight_std_{side}"] = 0.05
        rows.append(row)
    if final_eval:
        rows.append({"step": rl_steps, "eval/average/avg@4": 0.5, "eval/average/pass@4": 0.75})
    return rows


def write_rows(workdir, rows):
    with open(workdir / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_series_keeps_last_value_of_a_repeated_step_and_skips_non_finite():
    rows = [{"step": 2, "a": 1.0}, {"step": 1, "a": 5.0}, {"step": 3, "b": 1.0},
            {"step": 2, "a": 7.0}, {"step": 4, "a": "nan"}]
    steps, values = plots.series(rows, "a")
    np.testing.assert_array_equal(steps, [1, 2])
    np.testing.assert_array_equal(values, [5.0, 7.0])


def test_eval_before_after_ignores_sft_rows_and_needs_the_final_eval():
    rows = fake_rows(rl_steps=6)
    out = plots.eval_before_after(rows, rl_steps=6)
    assert out == {"metric": "eval/average/avg@4", "before_step": 0, "before": 0.25,
                   "after_step": 6, "after": 0.5}
    assert plots.eval_before_after(rows, rl_steps=7) is None  # the run did not finish
    assert plots.eval_before_after(fake_rows(final_eval=False)) is None
    assert plots.eval_before_after([{"step": 1, "sft/loss": 1.0}]) is None


def test_moving_average_matches_a_loop():
    x = np.random.default_rng(0).normal(size=11)
    want = [np.mean(x[max(0, i - 4):i + 1]) for i in range(len(x))]
    np.testing.assert_allclose(plots.moving_average(x, 5), want)


def test_side_histograms_match_numpy_per_side():
    rng = np.random.default_rng(1)
    n, r = 12, 9
    weights = rng.uniform(0.6, 1.6, (n, r)).astype(np.float32)
    adv = np.array([1.5, -0.5, 0.0] * 4, np.float32)
    lengths = rng.integers(0, r + 1, n)
    mask = (np.arange(r)[None] < lengths[:, None]).astype(np.float32)
    weights[mask == 0] = 123.0  # padding values must not be counted
    edges = plots.histogram_edges(0.8, 1.2, bins=10)
    got = np.asarray(plots.side_histograms(jnp.asarray(weights), jnp.asarray(adv),
                                           jnp.asarray(mask), jnp.asarray(edges, jnp.float32)))
    assert got.shape == (3, 10)
    for i, sel in enumerate((adv > 0, adv < 0, adv == 0)):
        side = (mask > 0) & sel[:, None]
        want, _ = np.histogram(weights[side], bins=edges)
        np.testing.assert_array_equal(got[i], want)


def test_histogram_edges_cover_every_possible_delta_weight():
    rng = np.random.default_rng(2)
    lam_min, lam_max = 0.8, 1.2
    edges = plots.histogram_edges(lam_min, lam_max)
    for lam in (np.full(50, lam_min), np.full(50, lam_max),
                np.r_[np.full(49, lam_min), lam_max], rng.uniform(lam_min, lam_max, 50)):
        w = lam * len(lam) / lam.sum()  # spec 2.7: w = c * lambda, mean 1
        assert edges[0] <= w.min() and w.max() <= edges[-1]
    flat = plots.histogram_edges(1.0, 1.0)
    assert flat[0] < 1.0 < flat[-1]


def test_histograms_round_trip_and_a_resumed_step_keeps_its_last_record(tmp_path):
    w = jnp.ones((2, 3))
    adv, mask = jnp.array([1.0, -1.0]), jnp.array([[1, 1, 0], [1, 0, 0]], jnp.float32)
    plots.append_weight_histogram(str(tmp_path), 1, w, adv, mask, 0.8, 1.2)
    plots.append_weight_histogram(str(tmp_path), 2, w, adv, mask, 0.8, 1.2)
    plots.append_weight_histogram(str(tmp_path), 2, w * 1.1, adv, mask, 0.8, 1.2)  # resumed
    recs = plots.read_weight_histograms(str(tmp_path))
    assert [r["step"] for r in recs] == [1, 2]
    assert sum(recs[0]["counts"]["pos"]) == 2 and sum(recs[0]["counts"]["neg"]) == 1
    edges = np.asarray(recs[1]["edges"])
    bin_of = lambda x: int(np.searchsorted(edges, x, side="right") - 1)  # noqa: E731
    assert recs[1]["counts"]["pos"][bin_of(1.1)] == 2


@pytest.mark.parametrize("with_delta", [True, False])
def test_write_report_writes_pngs_and_prints_before_after(tmp_path, with_delta):
    write_rows(tmp_path, fake_rows(rl_steps=6, with_delta=with_delta))
    if with_delta:
        for step in range(1, 7):
            plots.append_weight_histogram(str(tmp_path), step, jnp.full((2, 2), 1.05),
                                          jnp.array([1.0, -1.0]), jnp.ones((2, 2)), 0.8, 1.2)
    text = plots.write_report(str(tmp_path), rl_steps=6)
    assert "before RL 25.0% (step 0) -> after RL 50.0% (step 6), +25.0 points" in text
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == (["delta_weights.png", "training.png"] if with_delta else ["training.png"])
    for name in names:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
