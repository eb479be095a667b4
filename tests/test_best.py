"""train/best.py: the best policy by an eval metric (train.best_metric), as the paper picks its
checkpoint; the training loop's use of it is in tests/test_loop.py."""
import json
import math

import pytest

from delta_jax.train import best as best_lib


def _export_marker(path):
    """A stand-in for loop.export_policy: a directory holding which export it was."""
    import os
    os.makedirs(path)
    with open(os.path.join(path, "model.txt"), "w") as f:
        f.write(path)


def _offers(policy, values, metric="eval/benchmarks/aime25/avg@8"):
    return [policy.offer(step, {metric: v, "eval/seconds": 1.0}, _export_marker)
            for step, v in values]


def test_the_best_value_so_far_is_exported_and_survives_a_restart(tmp_path):
    metric = "eval/benchmarks/aime25/avg@8"
    policy = best_lib.BestPolicy(str(tmp_path), metric, "max")
    assert policy.value is None
    assert _offers(policy, [(0, 0.2), (4, 0.5), (8, 0.3), (12, 0.5), (16, math.nan)]) == [
        True, True, False, False, False]  # a tie or a NaN does not replace it
    assert json.loads((tmp_path / "best" / "best.json").read_text()) == {
        "metric": metric, "value": 0.5, "step": 4, "mode": "max"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]  # no partial / old copy
    assert (tmp_path / "best" / "model.txt").read_text().endswith("best.partial")
    assert not policy.offer(20, {"eval/seconds": 1.0}, _export_marker)  # no such metric here
    # A resumed run compares with the best of before.
    again = best_lib.BestPolicy(str(tmp_path), metric, "max")
    assert again.value == 0.5
    assert _offers(again, [(24, 0.4), (28, 0.75)]) == [False, True]
    assert best_lib.read_best(str(tmp_path))["step"] == 28
    # Another metric or mode starts afresh (the old record is not its best).
    assert best_lib.BestPolicy(str(tmp_path), "eval/average/avg@8", "max").value is None
    assert best_lib.BestPolicy(str(tmp_path), metric, "min").value is None


def test_min_mode_and_a_stopped_exports_remains(tmp_path):
    metric = "eval/average/pass@1"
    (tmp_path / "best.partial").mkdir()  # an export stopped halfway
    (tmp_path / "best.partial" / "stale.bin").write_text("x")
    policy = best_lib.BestPolicy(str(tmp_path), metric, "min")
    assert _offers(policy, [(1, 0.4), (2, 0.6), (3, 0.1)], metric) == [True, False, True]
    assert best_lib.read_best(str(tmp_path))["value"] == 0.1
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == ["best.json", "model.txt"]
    with pytest.raises(ValueError, match="train.best_mode"):
        best_lib.BestPolicy(str(tmp_path), metric, "largest")


def test_an_unreadable_record_counts_as_none(tmp_path):
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text("{not json")
    assert best_lib.read_best(str(tmp_path)) is None
    assert best_lib.BestPolicy(str(tmp_path), "eval/average/avg@8").value is None
