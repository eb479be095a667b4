"""benchmarks/compare_methods.py: its summary and markdown writer on a hand-made results dict
(its statistics are delta_jax.stats, tested in test_stats.py), the variants against the config
schema, and the parallel scheduler with stand-in runs (no training process is started here)."""
import importlib.util
import math
import pathlib

import numpy as np
import pytest
from scipy import stats

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("compare_methods",
                                                  REPO / "benchmarks" / "compare_methods.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cm = _load()


def hand_results():
    """3 seeds; delta's seed 2 failed; credit values on the delta runs."""
    before = {0: 0.40, 1: 0.38, 2: 0.42}
    after = {"dapo": {0: 0.45, 1: 0.41, 2: 0.44}, "delta": {0: 0.48, 1: 0.40},
             "delta_k0": {0: 0.44, 1: 0.43, 2: 0.47}}
    res = {}
    for v, per_seed in after.items():
        for s, acc in per_seed.items():
            r = {"before": before[s], "after": acc, "seconds": 10.0, "workdir": f"/x/{v}"}
            if v.startswith("delta"):
                r["credit"] = {"credit/weight_first_error_neg": 1.10 + 0.02 * s,
                               "credit/weight_boilerplate_neg": 0.90,
                               "credit/weight_step_pos": 1.05,
                               "credit/weight_boilerplate_pos": 0.95,
                               "credit/auc_first_error_neg": 0.7, "credit/auc_step_pos": 0.6}
            res[(s, v)] = r
    res[(2, "delta")] = {"error": "exit 1"}
    return res


def test_summarize_on_hand_made_results():
    table = cm.summarize(hand_results(), ["dapo", "delta", "delta_k0"], [0, 1, 2])
    by = {r["variant"]: r for r in table}
    dapo, delta, k0 = by["dapo"], by["delta"], by["delta_k0"]
    assert dapo["vs_baseline"] is None and dapo["n"] == 3
    assert dapo["gain_mean"] == pytest.approx(np.mean([0.05, 0.03, 0.02]))
    g = [0.05, 0.03, 0.02]
    half = stats.t.ppf(0.975, 2) * np.std(g, ddof=1) / math.sqrt(3)
    assert (dapo["gain_lo"], dapo["gain_hi"]) == pytest.approx((np.mean(g) - half,
                                                                np.mean(g) + half))
    # delta: seed 2 failed -> 2 seeds, paired with dapo on seeds 0, 1 only.
    assert delta["seeds"] == [0, 1] and delta["failed"] == [2]
    c = delta["vs_baseline"]
    assert c["seeds"] == [0, 1] and c["n"] == 2
    assert c["per_seed_diff"] == pytest.approx([0.03, -0.01])
    assert (c["wins"], c["losses"]) == (1, 1)
    # mean of seeds 0, 1
    assert delta["credit"]["credit/weight_first_error_neg"] == pytest.approx(1.11)
    assert k0["vs_baseline"]["n"] == 3 and k0["overrides"] == {"delta.num_refine": 0}
    assert k0["improved"] == 3


def test_markdown_writer_on_hand_made_results(tmp_path):
    table = cm.summarize(hand_results(), ["dapo", "delta", "delta_k0"], [0, 1, 2])
    meta = {"date": "2026-11-23", "machine": "test VM", "command": "python x", "config":
            "experiments/tiny.py", "seeds": "0, 1, 2", "rl": "2 steps", "eval": "avg@4",
            "wall_time": "12 s", "rl_time": "10 s per run", "errors": ["seed 2 delta: exit 1"]}
    text = cm.to_markdown(table, meta)
    assert text.startswith("## Method comparison on the synthetic task")
    assert "- Seeds: 0, 1, 2" in text and "- Command: `python x`" in text
    assert "| delta_k0 | delta.num_refine=0 | 3 |" in text
    # dapo's gain +3.3 points, sd 1.5, its CI from the t quantile with 2 df:
    assert "| dapo | - | 3 | 43.3 +- 2.1 | +3.3 +- 1.5 | [-0.5, +7.1] | 3/3 |" in text
    assert "Paired against dapo" in text
    assert "| delta | 2 | +1.0 | " in text and " | 1 / 1 / 0 | +3.0, -1.0 |" in text
    assert "cannot give p below 0.2500 (2 / 2^3)" in text
    assert "Ground-truth token credit" in text
    assert "| delta | 1.110 | 0.900 | 1.050 | 0.950 | 0.700 | 0.600 | 1.233 |" in text
    assert "delta: seeds 2" in text and "- seed 2 delta: exit 1" in text
    assert "Reading (generated from the numbers above):" in text
    assert "delta_k0 +1.3 points, not distinguishable from dapo (the 95% CI contains 0)" in text

    md = tmp_path / "BENCH.md"
    md.write_text("# Benchmarks\n\nintro\n\n<!-- compare_methods:start -->\nold\n"
                  "<!-- compare_methods:end -->\n\n## Next section\nkept\n")
    cm.write_section(str(md), text)
    out = md.read_text()
    assert "old" not in out and text in out and out.endswith("## Next section\nkept\n")
    assert out.startswith("# Benchmarks\n\nintro\n")
    cm.write_section(str(md), "second\n")  # replaces again, the rest kept
    assert md.read_text().count("<!-- compare_methods:start -->") == 1
    assert "second\n<!-- compare_methods:end -->" in md.read_text()


def test_markdown_without_baseline_or_credit():
    res = {(0, "grpo"): {"before": 0.4, "after": 0.5}, (1, "grpo"): {"before": 0.4, "after": 0.45}}
    table = cm.summarize(res, ["grpo"], [0, 1])
    meta = {"date": "d", "machine": "m", "command": "c", "config": "x", "seeds": "0, 1",
            "rl": "r", "eval": "e", "wall_time": "w", "rl_time": "t"}
    text = cm.to_markdown(table, meta)
    assert "Paired against" not in text and "Ground-truth token credit" not in text
    assert "no paired comparison against dapo" in text


def test_variants_are_valid_configs():
    from delta_jax.train.config import validate_config
    spec = importlib.util.spec_from_file_location("tiny_exp", REPO / "experiments" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {"grpo", "dapo", "delta", "delta_k0", "delta_k2", "delta_k3", "delta_fixed_gamma",
            "delta_hard", "delta_no_norm", "delta_alpha", "delta_random",
            "delta_topk", "sapo", "fipo"} == set(cm.VARIANTS)
    for name, (method, overrides) in cm.VARIANTS.items():
        cfg = module.get_config()
        cfg.method = method
        for key, value in overrides.items():
            section, field = key.split(".")
            cfg[section][field] = value
        c = validate_config(cfg)
        for key, value in overrides.items():
            section, field = key.split(".")
            assert c[section][field] == value, name
    assert cm._parse_variants("all") == list(cm.VARIANTS)
    assert cm._parse_variants("dapo, delta_hard") == ["dapo", "delta_hard"]
    with pytest.raises(SystemExit):
        cm._parse_variants("delta,delta_k9")


def test_config_mismatches():
    saved = {"method": "delta", "delta": {"num_refine": 2, "normalize": True},
             "optim": {"lr": 0.0001}}
    assert cm.config_mismatches(saved, {"method": "delta", "delta.num_refine": 2,
                                        "optim.lr": "1e-4", "delta.normalize": "True"}) == []
    bad = cm.config_mismatches(saved, {"delta.num_refine": 0, "delta.weight": "alpha"})
    assert bad == ["delta.num_refine: want 0, has 2", "delta.weight: want 'alpha', has '<absent>'"]


def test_run_all_runs_every_variant_after_its_seeds_warm_start(monkeypatch, capsys, tmp_path):
    order = []

    def fake_warm_start(config, seed_dir, seed, extra, log):
        order.append(("sft", seed))
        if seed == 2:
            raise RuntimeError("boom")
        return f"/exp/{seed}", 1.0

    def fake_rl_run(config, seed_dir, seed, variant, export, extra, log):
        assert ("sft", seed) in order and export == f"/exp/{seed}"
        order.append((variant, seed))
        if (seed, variant) == (1, "delta"):
            raise RuntimeError("exit 1")
        return {"before": 0.4, "after": 0.5, "seconds": 2.0, "reused": False}

    monkeypatch.setattr(cm, "warm_start", fake_warm_start)
    monkeypatch.setattr(cm, "rl_run", fake_rl_run)
    results, sft_secs, errors = cm.run_all("cfg", str(tmp_path), [0, 1, 2], ["dapo", "delta"],
                                           {}, jobs=2)
    assert sft_secs == 2.0
    assert set(results) == {(s, v) for s in (0, 1, 2) for v in ("dapo", "delta")}
    assert results[(0, "delta")]["after"] == 0.5
    assert "error" in results[(1, "delta")] and "error" in results[(2, "dapo")]
    assert sorted(errors) == ["seed 1 delta: exit 1", "seed 2 sft: boom"]
    out = capsys.readouterr().out
    assert "(9/9)" in out and "seed 0 dapo: held-out 40.0% -> 50.0% (2 s)" in out
    assert "seed 2 sft: FAILED (boom)" in out


def test_credit_summary_is_credit_summarize_of_the_rows():
    from delta_jax.rl import credit
    rows = [{"step": 0, "eval/average/avg@4": 0.3}]
    assert cm.credit_summary(rows) == {}
    for s, (n, w) in enumerate([(10, 1.2), (30, 1.0)], start=1):
        rows.append({"step": s, "credit/tokens_first_error_neg": float(n),
                     "credit/weight_first_error_neg": w, "credit/tokens_boilerplate_neg": 20.0,
                     "credit/weight_boilerplate_neg": 0.9, "credit/auc_first_error_neg": 0.7,
                     "credit/auc_first_error_neg_responses": 2.0})
    got = cm.credit_summary(rows)
    assert got == credit.summarize(rows)
    assert got["credit/weight_first_error_neg"] == pytest.approx((10 * 1.2 + 30 * 1.0) / 40)
    assert got["credit/auc_first_error_neg"] == pytest.approx(0.7)
