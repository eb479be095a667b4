"""benchmarks/load_weights.py at the tiny preset: it times the three ways and reports what each
read from the files: nothing for the header check, the files' tensors once whole, and as much
again by shards over the process's eight devices (each device's block read once, a replicated
parameter once)."""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import load_weights  # noqa: E402


def test_load_weights_reports_each_way_and_its_bytes(tmp_path):
    out = tmp_path / "r.json"
    result = load_weights.main(["--preset", "tiny", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["devices"] == 8
    assert set(result["median_s"]) == {"header check", "whole", "by shards"}
    assert all(t > 0 for t in result["median_s"].values())
    read = result["read_gb"]
    assert read["header check"] == 0
    # The tiny preset's tensors in bf16 (the files also hold their headers)
    assert 0 < read["whole"] < result["files_gb"] and read["by shards"] == read["whole"]
