"""benchmarks/scheduler_host.py: its stand-in device programs reproduce the real Sampler's call
pattern (decode calls, steps, prefills) on the same workload, so its counts are the engine's."""
import json
import pathlib
import sys

from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_throughput  # noqa: E402
import scheduler_host as bench  # noqa: E402
from delta_jax import models  # noqa: E402
from delta_jax.sampling import Sampler  # noqa: E402


def test_stand_ins_reproduce_the_real_call_pattern():
    """A long-tailed workload (24 one-sample prompts, lengths of mean 8 up to 32) in 8 slots with
    4 steps a call, 2 samples staged on the device and refills after 2 more finishers: the real
    programs (tiny model, CPU) and the stand-ins make the same decode calls, steps and prefill
    calls, start the same number of staged samples mid-call and count the same tokens."""
    cfg = models.get_preset("tiny")
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    wl = decode_throughput.parse_args(["--new-tokens", "32", "--tail-mean-div", "4"])
    prompts = decode_throughput.random_prompts(cfg, 24, 8, seed=2)
    lengths = decode_throughput.longtail_lengths(wl, 24)
    assert max(lengths) > 3 * sum(lengths) / 24  # long-tailed
    kwargs = dict(n=1, temperature=1.0, max_new_tokens=lengths, stop_token_ids=(), seed=0)
    sampler = Sampler(model, max_batch_size=8, page_size=8, decode_steps_per_call=4,
                      refill_after=2)
    real = sampler.generate(prompts, **kwargs).stats
    with bench.stand_in_programs():
        stood_in = sampler.generate(prompts, **kwargs).stats
    keys = ("decode_calls", "decode_steps", "prefill_calls", "prefilled_prompts",
            "generated_tokens", "slot_utilization", "queue_refills", "decode_rows",
            "shrunk_calls")
    assert {k: stood_in[k] for k in keys} == {k: real[k] for k in keys}
    assert real["decode_calls"] > real["decode_steps"] / 4  # calls ended early for refills
    assert real["queue_refills"] > 0


def test_sweep_trades_calls_for_steps(tmp_path):
    """More finishers a refill waits for: fewer decode calls, no fewer steps; the default is
    slots // 16; rows are written."""
    out = tmp_path / "sh.json"
    rows = bench.main(["--slots", "32", "--samples", "96", "--refill-after", "1", "4", "0",
                       "--prompt-len", "16", "--new-tokens", "64", "--repeats", "1",
                       "--out", str(out)])
    one, four, default = rows
    assert four["decode_calls"] < one["decode_calls"]
    assert four["decode_steps"] >= one["decode_steps"]
    assert default["refill_after"] == 2
    assert all(r["decode_calls"] > 0 and r["host_seconds"] > 0 for r in rows)
    # 32 slots: as the batch drains, calls run 16 or 8 rows (Sampler shrink_batch)
    for r in rows:
        by_rows = r["steps_by_rows"]
        assert set(by_rows) <= {32, 16, 8} and min(by_rows) < 32, by_rows
        assert sum(by_rows.values()) == r["decode_steps"]
        assert r["decode_rows"] == sum(k * v for k, v in by_rows.items()) / r["decode_steps"]
    assert len(json.loads(out.read_text())["results"]) == 3
