"""benchmarks/sampler_ab.py: its variants run interleaved on the same workload, generate the same
tokens, the queue variant starts samples mid-call in fewer decode calls, and fewer steps a call
make more calls."""
import json
import pathlib
import sys

import pytest

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


def test_batch_invariant_and_other_batch_variants(tmp_path):
    """--batch-invariant 0 1 builds every variant with each Sampler(batch_invariant=),
    --decode-splits 1 0 the continuous ones with each Sampler(decode_splits=) (auto left out of
    the batch-invariant ones, which refuse it; on the CPU auto is one split), and
    --other-batches a continuous variant at that max_batch_size; each is compared with the first
    variant of its own numerics (the CPU: no token differs; at 4 rows a call XLA:CPU rounds a
    log-prob or so differently, by float32 rounding only), and the batch-invariant ones record
    their programs' memory under the usual names."""
    rows = bench.main(["--batch", "8", "--prompt-len", "8", "--new-tokens", "16",
                       "--refill-queue", "-1", "--unshrunk", "--batch-invariant", "0", "1",
                       "--decode-splits", "1", "0", "--other-batches", "4", "--repeats", "1",
                       "--out", str(tmp_path / "ab.json")])
    assert [(r["variant"], r["batch_invariant"], r["max_batch_size"], r["decode_splits"])
            for r in rows] == [
        ("continuous, refill_queue default, decode_splits 1", False, 8, 1),
        ("continuous, refill_queue default, decode_splits auto", False, 8, 0),
        ("continuous, refill_queue default, shrink_batch off", False, 8, 1),
        ("continuous, max_batch_size 4", False, 4, 1),
        ("continuous, refill_queue default, decode_splits 1, batch_invariant", True, 8, 1),
        ("continuous, refill_queue default, shrink_batch off, batch_invariant", True, 8, 1),
        ("continuous, max_batch_size 4, batch_invariant", True, 4, 1)]
    assert [r["samples_differing"] for r in rows] == [0] * 7
    # 8 rows a call, as the first (8 slots: no smaller row bucket)
    assert [r["logprobs_differing"] for r in rows if r["max_batch_size"] == 8] == [0] * 5
    assert max(r["logprob_diff_max"] for r in rows) < 1e-5
    assert all(r["tokens_compared"] == r["generated_tokens"] > 0 for r in rows)
    assert all(r["compiled_memory"]["decode"]["peak_estimate_bytes"] > 0
               and r["compiled_memory"]["prefill"]["peak_estimate_bytes"] > 0 for r in rows)


def test_num_layers_and_vocab_size_replace_the_presets():
    """--num-layers / --vocab-size: the preset's widths with those in place of its own; 0 (the
    default) keeps the preset's; negative values are refused."""
    import jax.numpy as jnp
    _, cfg = bench.workload_and_model(bench.parse_args(
        ["--preset", "qwen3-0.6b", "--dtype", "bfloat16", "--num-layers", "2",
         "--vocab-size", "4096"]))
    assert (cfg.num_layers, cfg.vocab_size, cfg.hidden_size, cfg.head_dim, cfg.dtype) == (
        2, 4096, 1024, 128, jnp.bfloat16)
    _, tiny = bench.workload_and_model(bench.parse_args([]))
    assert (tiny.num_layers, tiny.vocab_size) == (2, 256)
    for bad in (["--num-layers", "-1"], ["--vocab-size", "-2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_logprob_differences():
    """Known answers: only tokens before a sample's first differing token are compared."""
    tokens, reference = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]
    logprobs = [[-0.5, -1.0, -2.0], [-0.25, -3.0, -1.0]]
    same = bench.logprob_differences(tokens, logprobs, reference, logprobs)
    assert same == {"tokens_compared": 4, "logprobs_differing": 0, "logprob_diff_max": 0.0}
    # sample 0 differs by 0.125 at token 2; sample 1's token 1 differs, so its log-prob (and
    # token 2's, which follows a different token) is not compared
    other = [[-0.5, -1.0, -2.125], [-0.25, -7.0, -9.0]]
    assert bench.logprob_differences(tokens, other, reference, logprobs) == {
        "tokens_compared": 4, "logprobs_differing": 1, "logprob_diff_max": 0.125}
