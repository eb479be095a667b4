"""benchmarks/sampler_ab.py: its variants run interleaved on the same workload, generate the same
tokens, the queue variant starts samples mid-call in fewer decode calls, and fewer steps a call
make more calls."""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import sampler_ab as bench  # noqa: E402


def test_variants_interleave_and_agree(tmp_path):
    out = tmp_path / "ab.json"
    rows = bench.main(["--batch", "8", "--prompt-len", "8", "--new-tokens", "32",
                       "--refill-queue", "0", "-1", "--steps-per-call", "32", "8", "--static",
                       "--unshrunk", "--repeats", "2", "--out", str(out)])
    unstaged, staged, unstaged_8, staged_8, unshrunk, static = rows
    assert [r["refill_queue"] for r in rows] == [0, 2, 0, 2, 2, 0]
    assert [r["steps_per_call"] for r in rows] == [32, 32, 8, 8, 32, 32]
    assert [r["shrink_batch"] for r in rows] == [True] * 4 + [False] * 2
    # 8 slots: no smaller row bucket (SHRINK_MIN_ROWS), so every call runs all of them
    assert [r["decode_rows"] for r in rows] == [8] * 6
    assert unshrunk["decode_steps"] == staged["decode_steps"]
    assert unstaged["queue_refills"] == 0 < staged["queue_refills"]
    assert staged["decode_calls"] < unstaged["decode_calls"]
    assert staged["decode_steps"] <= unstaged["decode_steps"] < static["decode_steps"]
    # 8 steps a call: at least steps / 8 calls, more than at 32 with or without the queue
    for short, long in ((unstaged_8, unstaged), (staged_8, staged)):
        assert short["decode_calls"] >= short["decode_steps"] / 8
        assert short["decode_calls"] > long["decode_calls"]
    assert len({r["generated_tokens"] for r in rows}) == 1
    assert [r["samples_differing"] for r in rows] == [0] * 6  # the CPU: scheduling changes nothing
    assert all(r["first_differences"] == [] for r in rows)
    assert all(len(r["seconds"]) == 2 and r["tokens_per_s_best"] > 0 for r in rows)
    assert all(r["compiled_memory"]["decode"]["peak_estimate_bytes"] > 0 for r in rows)
    record = json.loads(out.read_text())
    assert len(record["results"]) == 6
    # interleaved: each repeat runs every variant once, in turn
    assert record["run_order"] == [r["variant"] for r in rows] * 2


def test_each_decode_attention_is_a_variant(tmp_path):
    """--decode-attention with two values: the continuous variants once per value (the Sampler
    built with it), the unshrunk one with the first; on the CPU both resolve to the jnp page
    reader, so the tokens agree."""
    rows = bench.main(["--batch", "8", "--prompt-len", "8", "--new-tokens", "16",
                       "--refill-queue", "-1", "--decode-attention", "auto", "reference",
                       "--unshrunk", "--repeats", "1", "--out", str(tmp_path / "ab.json")])
    assert [r["variant"] for r in rows] == [
        "continuous, refill_queue default, auto", "continuous, refill_queue default, reference",
        "continuous, refill_queue default, shrink_batch off"]
    assert [r["decode_attention"] for r in rows] == ["auto", "reference", "auto"]
    assert [r["samples_differing"] for r in rows] == [0, 0, 0]


def test_first_differences():
    """The index of each differing sample's first differing token; equal samples are left out."""
    assert bench.first_differences([[1, 2, 3], [4, 5], [7, 8, 9]],
                                   [[1, 2, 3], [4, 6], [0, 8, 9]]) == [1, 0]
    assert bench.first_differences([[1]], [[1]]) == []
