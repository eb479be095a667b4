"""delta_jax.train.plots: metric series, before/after eval, weight histograms (vs NumPy), PNGs."""
import json
import pathlib

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
                   "after_step": 6, "after": 0.5, "pass": {4: (0.5, 0.75)}, "maj": {}}
    rows[8]["eval/average/maj@4"], rows[-1]["eval/average/maj@4"] = 0.125, 0.625
    assert plots.eval_before_after(rows, rl_steps=6)["maj"] == {4: (0.125, 0.625)}
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


def test_report_gives_the_paired_interval_from_the_eval_files(tmp_path):
    from delta_jax import evaluation
    write_rows(tmp_path, fake_rows(rl_steps=6, with_delta=False))
    (tmp_path / "eval").mkdir()
    # The counts behind fake_rows' avg@4 0.25 -> 0.5 and pass@4 0.5 -> 0.75.
    counts = {0: [0, 0, 0, 0, 1, 2, 2, 3], 6: [0, 0, 1, 4, 2, 3, 2, 4]}
    for step, c in counts.items():
        bench = evaluation.BenchmarkResult("t", [f"q{i}" for i in range(8)], np.asarray(c), 4,
                                           (1, 4))
        (tmp_path / "eval" / f"step_{step}.json").write_text(
            evaluation.EvalResult({"t": bench}, 4, (1, 4)).to_json())
    text = plots.write_report(str(tmp_path), rl_steps=6)
    d = (np.asarray(counts[6]) - np.asarray(counts[0])) / 4     # avg@4 per question
    half = 2.364624 * d.std(ddof=1) / np.sqrt(8)                # t(0.975, 7)
    lo, hi = 100 * (d.mean() - half), 100 * (d.mean() + half)
    assert f"+25.0 points (95% CI {lo:+.1f} to {hi:+.1f})" in text
    assert "pass@4 50.0% -> 75.0% (+25.0, 95% CI [" in text and "paired by problem" in text
    assert "maj@k" not in text  # the evaluations did not vote
    # with eval.maj_k: its line, its interval from the per-question maj@4 of the files
    maj = {0: [0, 0, 0, 0, 0, 1, 1, 1], 6: [0, 0, 0, 1, 1, 1, 1, 1]}
    rows = fake_rows(rl_steps=6, with_delta=False)
    rows[8]["eval/average/maj@4"], rows[-1]["eval/average/maj@4"] = 0.375, 0.625
    write_rows(tmp_path, rows)
    for step, c in counts.items():
        bench = evaluation.BenchmarkResult("t", [f"q{i}" for i in range(8)], np.asarray(c), 4,
                                           (1, 4), maj={4: np.asarray(maj[step], float)})
        (tmp_path / "eval" / f"step_{step}.json").write_text(
            evaluation.EvalResult({"t": bench}, 4, (1, 4), maj_ks=(4,)).to_json())
    d = np.asarray(maj[6]) - np.asarray(maj[0])
    half = 2.364624 * d.std(ddof=1) / np.sqrt(8)
    line = next(l for l in plots.write_report(str(tmp_path), rl_steps=6).splitlines()
                if l.startswith("maj@k before -> after RL: "))
    assert line == (f"maj@k before -> after RL: maj@4 37.5% -> 62.5% (+25.0, 95% CI "
                    f"[{100 * (d.mean() - half):+.1f}, {100 * (d.mean() + half):+.1f}])")
    (tmp_path / "eval" / "step_6.json").unlink()                # no files: no interval
    text = plots.write_report(str(tmp_path), rl_steps=6)
    assert "+25.0 points\n" in text and "95% CI" not in text


CLASSES = ("boilerplate", "step", "first_error", "after_error")


def credit_rows(rl_steps=6):
    """fake_rows plus the ground-truth credit metrics of the synthetic task on the RL rows, with
    gaps: step 2 has no first_error token (count 0, weight absent), step 3 no AUC on A < 0."""
    rows = fake_rows(rl_steps=rl_steps)
    for row in rows:
        if "rollout/accuracy" not in row:
            continue
        s = row["step"]
        for side in ("pos", "neg"):
            for i, cls in enumerate(CLASSES):
                n = 0 if (cls == "first_error" and s == 2) else 10 + i
                row[f"credit/tokens_{cls}_{side}"] = float(n)
                if n:
                    row[f"credit/weight_{cls}_{side}"] = 0.9 + 0.05 * i + 0.01 * s
        if s != 3:
            row["credit/auc_first_error_neg"] = 0.6 + 0.01 * s
            row["credit/auc_first_error_neg_responses"] = 4.0
        else:
            row["credit/auc_first_error_neg_responses"] = 0.0
        row["credit/auc_step_pos"] = 0.55
        row["credit/auc_step_pos_responses"] = 3.0
    return rows


def test_credit_plot_and_report_lines(tmp_path):
    write_rows(tmp_path, credit_rows())
    text = plots.write_report(str(tmp_path), rl_steps=6)
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["credit.png", "delta_weights.png", "training.png"]
    data = (tmp_path / "plots" / "credit.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    # Token-count-weighted means over the steps: first_error on A < 0 has 12 tokens at steps
    # 1, 3, 4, 5, 6 (weight 1.0 + 0.01 s), boilerplate 10 tokens at every step (0.9 + 0.01 s).
    fe = np.mean([1.0 + 0.01 * s for s in (1, 3, 4, 5, 6)])
    bp = np.mean([0.9 + 0.01 * s for s in range(1, 7)])
    want = (f"credit: in wrong-leaning responses DelTA weights first-error tokens more than "
            f"boilerplate ({fe:.3f} vs {bp:.3f}, ratio {fe / bp:.3f})")
    assert want in text
    assert "credit, mean DelTA token weight per class (A < 0): boilerplate " in text
    assert f"first_error {fe:.3f} (60 tokens)" in text
    auc = np.mean([0.6 + 0.01 * s for s in (1, 2, 4, 5, 6)])
    assert (f"credit, AUC of the weight: first_error vs other tokens, A < 0 {auc:.3f}; "
            "step vs boilerplate, A > 0 0.550") in text


def test_credit_plot_with_missing_keys(tmp_path):
    """Partial credit series (only counts; only one AUC; a class absent) draw without error and
    the report says what it cannot compare."""
    rows = fake_rows(rl_steps=4, with_delta=False)
    for row in rows:
        if "rollout/accuracy" in row:
            row["credit/tokens_step_pos"] = 5.0
            row["credit/weight_step_pos"] = 1.1
            row["credit/auc_step_pos"] = "nan"  # the JSON writer's non-finite value
    write_rows(tmp_path, rows)
    text = plots.write_report(str(tmp_path), rl_steps=4)
    assert (tmp_path / "plots" / "credit.png").read_bytes().startswith(PNG_MAGIC)
    assert "no first-error vs boilerplate comparison" in text
    assert "(A > 0): step 1.100 (20 tokens)" in text
    path = plots.plot_credit([{"step": 1, "credit/auc_step_pos": 0.5}], str(tmp_path / "a.png"))
    assert pathlib.Path(path).read_bytes().startswith(PNG_MAGIC)
    assert plots.credit_classes(credit_rows()) == list(CLASSES)
    (tmp_path / "config.json").write_text(json.dumps({"method": "dapo"}))
    text = plots.write_report(str(tmp_path), rl_steps=4)
    assert "credit, mean token weight per class (A > 0): step 1.100" in text
    lines = plots.credit_report_lines(credit_rows(), method="grpo")
    assert lines[-1].startswith("credit: in wrong-leaning responses the grpo loss weights")


def test_report_without_credit_metrics_has_no_credit_lines(tmp_path):
    write_rows(tmp_path, fake_rows(rl_steps=6))
    text = plots.write_report(str(tmp_path), rl_steps=6)
    assert "credit," not in text and "credit:" not in text
    assert not (tmp_path / "plots" / "credit.png").exists()
