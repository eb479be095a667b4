"""benchmarks/decode_throughput.py: its experiment knobs (--mosaic-kernel, --mosaic-rows,
--refill-after) reach the kernels and the Sampler, and one whole run at a tiny shape on the CPU (the real shapes run on
a GPU, scripts/gpu_bench.sh)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_throughput as bench  # noqa: E402
from delta_jax.kernels import paged_decode  # noqa: E402


def test_mosaic_kernel_parameters_reach_the_kernel_in_the_block_only(monkeypatch):
    """--mosaic-kernel 2 4 2: inside mosaic_parameters, the name paged_decode_attention looks up
    is the kernel with k_splits 2, 4 pages a step, 2 stages, over the k_splits its caller passes
    (the product's rollout.decode_splits); outside it the kernel is the module's own again, and
    without the option nothing is replaced."""
    args = bench.parse_args(["--preset", "qwen3-0.6b", "--dtype", "bfloat16", "--page-size", "32",
                             "--mosaic-kernel", "2", "4", "2"])
    calls = []
    for name in ("paged_decode_mosaic", "paged_write_decode_mosaic"):
        monkeypatch.setattr(paged_decode, name,
                            lambda *a, name=name, **k: calls.append((name, a, k)))
    original = paged_decode.paged_decode_mosaic
    fused = paged_decode.paged_write_decode_mosaic
    kwargs = bench.mosaic_kwargs(args)
    assert kwargs == {"k_splits": 2, "pages_per_block": 4, "stages": 2}
    with bench.mosaic_parameters(kwargs):
        paged_decode.paged_decode_mosaic("q", k_splits=1, rope=None)
        paged_decode.paged_write_decode_mosaic("qkv", k_splits=4)  # the fused step's kernel too
    assert calls == [("paged_decode_mosaic", ("q",), {**kwargs, "rope": None}),
                     ("paged_write_decode_mosaic", ("qkv",), kwargs)]
    assert paged_decode.paged_decode_mosaic is original
    assert paged_decode.paged_write_decode_mosaic is fused
    with bench.mosaic_parameters(bench.mosaic_kwargs(bench.parse_args(["--preset", "tiny"]))):
        assert paged_decode.paged_decode_mosaic is original
    # --mosaic-pdl adds pdl=True, alone or beside --mosaic-kernel
    assert bench.mosaic_kwargs(bench.parse_args(["--preset", "tiny", "--mosaic-pdl"])) == {
        "pdl": True}
    assert bench.mosaic_kwargs(bench.parse_args(
        ["--preset", "qwen3-0.6b", "--dtype", "bfloat16", "--mosaic-kernel", "2", "4", "2",
         "--mosaic-pdl"])) == {**kwargs, "pdl": True}
    # --mosaic-rows adds rows_per_block, alone or beside --mosaic-kernel; 0 is refused up front
    assert bench.mosaic_kwargs(bench.parse_args(
        ["--preset", "qwen3-0.6b", "--dtype", "bfloat16", "--mosaic-rows", "2"])) == {
        "rows_per_block": 2}
    assert bench.mosaic_kwargs(bench.parse_args(
        ["--preset", "qwen3-0.6b", "--dtype", "bfloat16", "--mosaic-kernel", "2", "4", "2",
         "--mosaic-rows", "3"])) == {**kwargs, "rows_per_block": 3}
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "qwen3-0.6b", "--dtype", "bfloat16", "--mosaic-rows", "0"])


def test_the_fused_step_is_an_arm_of_decode_attention():
    """The fused step's A/B is --decode-attention mosaic mosaic_fused (both parsed, in that
    order); a name attention does not know is refused."""
    args = bench.parse_args(["--preset", "tiny", "--decode-attention", "mosaic", "mosaic_fused"])
    assert args.decode_attention == ["mosaic", "mosaic_fused"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "tiny", "--decode-attention", "fused"])


def test_mosaic_kernel_parameters_the_kernel_refuses_are_refused_at_parse_time():
    """A step of 1 page of 32 tokens (not a multiple of 64 keys) and a float32 model: refused with
    the kernel's own reason before anything runs."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "qwen3-0.6b", "--dtype", "bfloat16",
                          "--mosaic-kernel", "1", "1", "2"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "qwen3-0.6b", "--dtype", "float32",
                          "--mosaic-kernel", "1", "2", "2"])


def test_refill_options_reach_the_sampler():
    """--refill-after 3 builds Samplers that return to refill after 3 finished samples,
    --refill-queue 0 stages none, --batch-invariant compiles for batch invariance and
    --decode-splits sets the Mosaic kernel's splits; the defaults leave the Sampler's (slots //
    16, slots // 4, not batch-invariant, one split); negative counts are refused."""
    from flax import nnx

    from delta_jax import models
    args = bench.parse_args(["--preset", "tiny", "--refill-after", "3", "--refill-queue", "0",
                             "--batch-invariant"])
    model = models.Transformer(bench.model_config(args), rngs=nnx.Rngs(0))
    sampler = bench.make_sampler(model, 64, "auto", args)
    assert (sampler.refill_after, sampler.refill_queue, sampler.batch_invariant) == (3, 0, True)
    default = bench.make_sampler(model, 64, "auto", bench.parse_args(["--preset", "tiny"]))
    assert (default.refill_after, default.refill_queue, default.batch_invariant) == (4, 16, False)
    assert sampler.decode_splits == default.decode_splits == 1
    assert bench.make_sampler(model, 64, "auto", bench.parse_args(
        ["--preset", "tiny", "--decode-splits", "0"])).decode_splits == 0
    for bad in (["--refill-after", "-1"], ["--refill-queue", "-2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_a_tiny_run_records_both_workloads_and_their_profiles(tmp_path, few_executables):
    """The whole benchmark on the CPU at a tiny shape (what a GPU call would find broken
    otherwise): the fixed workload's decode rate and the long tail's continuous and static
    runs, every sample generated to its scheduled length, each with a --profile trace read."""
    import json
    out = tmp_path / "dt.json"
    bench.main(["--preset", "tiny", "--batch", "16", "--prompt-len", "16", "--new-tokens", "16",
                "--workload", "fixed", "longtail", "--hf", "never", "--repeats", "1",
                "--tail-modes", "continuous", "static", "static_shrunk", "--steps-per-call", "4",
                "--copy-mib", "8", "--profile", str(tmp_path / "profile"), "--output", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["fixed"]["decode_tokens_per_s"] > 0
    assert row["fused_write"] is False  # tiny's 32-wide heads: no Mosaic kernel on any device
    assert row["fixed"]["stats"]["generated_tokens"] == 16 * 16
    # a fixed step's bytes: the parameters + K / V of 16 rows at the mean cached length of steps
    # 0..15 (16 + s tokens at step s)
    kv_token = 2 * 2 * 2 * 32 * 2  # tiny: K and V, 2 layers x 2 KV heads x 32 wide, bfloat16
    tiny = bench.model_config(bench.parse_args(["--preset", "tiny"]))
    assert (tiny.num_layers, tiny.num_kv_heads, tiny.head_dim) == (2, 2, 32)
    assert row["fixed"]["step_read_ideal_gb"] * 1e9 == pytest.approx(
        bench.param_bytes(tiny) + 16 * (16 + 7.5) * kv_token)
    tail = row["longtail"]
    for mode in ("continuous", "static"):
        stats = tail[mode]["stats"]
        assert stats["generated_tokens"] == round(tail["mean_length"] * tail["samples"])
        assert tail[mode]["profile"]["kernels"] and tail[mode]["profile"]["decode_steps"] >= 16
    assert tail["continuous"]["stats"]["decode_steps"] < tail["static"]["stats"]["decode_steps"]
    assert tail["speedup_vs_static"] > 0 and row["fixed"]["profile"]["kernels"]
    # The baseline runs every step over every slot; static_shrunk is it with shrink_batch (the
    # Sampler's default): its draining batches run 8 of the 16 slots, in as many steps.
    modes = {m: (tail[m]["continuous"], tail[m]["shrink_batch"]) for m in bench.TAIL_MODES
             if m in tail}
    assert modes == {"continuous": (True, True), "static": (False, False),
                     "static_shrunk": (False, True)}
    assert tail["static"]["stats"]["decode_rows"] == 16 and "static_shrunk_vs_static" in tail
    assert tail["static_shrunk"]["stats"]["decode_rows"] < 16
    assert tail["static_shrunk"]["stats"]["decode_steps"] == tail["static"]["stats"]["decode_steps"]
    for mode in ("continuous", "static", "static_shrunk"):  # the read limit and prefill rate
        m = tail[mode]
        assert m["decode_fraction_of_limit"] > 0 and m["prefill_tflop_s"] > 0
        assert m["decode_read_ideal_gb"] * 1e9 == pytest.approx(bench.decode_read_bytes(
            bench.model_config(bench.parse_args(["--preset", "tiny"])),
            bench.longtail_lengths(bench.parse_args(["--new-tokens", "16"]), tail["samples"]),
            16, m["stats"]["decode_steps"]))
    with pytest.raises(SystemExit):
        bench.parse_args(["--tail-modes", "continuous"])  # no baseline


def test_decode_read_bytes_and_prefill_flops_known_answers():
    """The long tail's read limit and the prefill's FLOPs, against sums written out here: a
    sample of n response tokens after a P-token prompt reads K / V of P, P + 1, ..., P + n - 1
    tokens; the prefill forward of P - 1 tokens a prompt is 2 FLOPs per non-embedding parameter
    and token plus causal attention's 2 x L x N x D x (P - 1)^2."""
    from delta_jax import models
    cfg = models.get_preset("tiny")
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V
    lengths, P, steps = [3, 1, 2], 10, 4
    cached = (10 + 11 + 12) + 10 + (10 + 11)
    assert bench.decode_read_bytes(cfg, lengths, P, steps) == (
        steps * bench.param_bytes(cfg) + cached * kv_token)
    tokens = 5 * (P - 1)
    expected = (2 * cfg.num_params(include_embeddings=False) * tokens
                + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (P - 1) ** 2 * 5)
    assert bench.prefill_flops(cfg, 5, P) == pytest.approx(expected)
