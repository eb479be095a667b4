"""The rollout scheduler alone: delta_jax.sampling.Sampler's host work and call pattern with its
device programs replaced by instant stand-ins, so the numbers are the scheduler's own, on any
machine.

    python benchmarks/scheduler_host.py --slots 64 --samples 256 1024 --refill-after 2 4 8 16

Why: on a GPU each decode call leaves the device idle while the host does the scheduler's work
between calls (admit, page reservation, results: ~3 ms a call at batch 64 on an H200,
2026-11-26, against a 2.9 ms decode step), and a call ends early, for refills, once
Sampler(refill_after=) samples have finished. The stand-ins reproduce the calls, steps and
prefills of a real run exactly (the long-tailed batch-64 workload: 108 decode calls and 4
prefill calls at refill_after 2, as on the H200), so this script says how refill_after trades
calls for steps, and what the host costs per call, without a GPU.

Workload: decode_throughput.py's long-tailed one (--samples prompts of --prompt-len random
tokens, one sample each, geometric lengths of mean --new-tokens / --tail-mean-div clipped to
[1, --new-tokens], no stop token), continuous batching in --slots slots. Stand-ins: decode runs
every live slot min(steps left to its limit, the call's steps) steps and returns when the call's
exit_after samples finished, or none is live, or its num_steps ran out (what programs.decode does
on a device); prefill and the page copy return the cache as it is, and the pool is one page a
layer. Tokens are not meaningful.
Reported per (slots, samples, refill_after): decode calls, decode steps, prefill calls, slot
utilization, and the host's seconds per generate() (best of --repeats) and per decode call.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import numpy as np
from flax import nnx

from delta_jax import models
from delta_jax.kernels import timing
from delta_jax.sampling import Sampler
from delta_jax.sampling import programs as sampling_programs

import decode_throughput  # noqa: E402  (the workload's prompts and length schedule)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, nargs="+", default=[64], help="Sampler max_batch_size")
    p.add_argument("--samples", type=int, nargs="+", default=[256],
                   help="long-tailed workload prompts (one sample each)")
    p.add_argument("--refill-after", type=int, nargs="+", default=[0],
                   help="Sampler refill_after values (0: its default, slots // 16)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--tail-mean-div", type=float, default=8.0)
    p.add_argument("--steps-per-call", type=int, default=32)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed generate()s (best is kept)")
    p.add_argument("--out", default="scheduler_host.json")
    args = p.parse_args(argv)
    if min(args.slots) < 1 or min(args.samples) < 1 or min(args.refill_after) < 0:
        p.error("--slots and --samples must be >= 1, --refill-after >= 0")
    return args


def stand_in_decode(graphdef, state, layers, cache, block_tables, token, length, generated,
                    active, prompt_index, sample_index, seed, stop_ids, temperature, top_p,
                    limit, pad_id, exit_after, *, num_steps, **static):
    """programs.decode's call pattern without a model: every live slot advances until its limit
    (no stop token), and the call returns after the step at which exit_after slots have finished
    or none is live any more, or after num_steps."""
    active, generated, limit = (np.asarray(x) for x in (active, generated, limit))
    slots = active.shape[0]
    left = np.sort((limit - generated)[active])
    steps = 0
    if left.size:  # the step at which the exit_after-th (or the last) live slot finishes
        steps = max(1, min(num_steps, int(left[min(int(exit_after), left.size) - 1])))
    out = np.where(active, np.minimum(generated + steps, limit), generated).astype(np.int32)
    tokens = np.ones((slots, num_steps), np.int32)
    logprobs = np.zeros((slots, num_steps), np.float32)
    return cache, tokens, logprobs, logprobs, out, np.zeros(slots, bool), np.int32(steps)


@contextlib.contextmanager
def stand_in_programs():
    """Within the block the Sampler's device programs are stand_in_decode and no-op layer
    slicing, prefill and page copy, and each generate()'s page pool is one page a layer (nothing
    reads it; zeroing the real pool is device work on a GPU, a large memset of host memory
    here)."""
    names = ("decode", "decode_layers", "prefill", "copy_pages")
    saved = {name: getattr(sampling_programs, name) for name in names}
    init_cache = models.init_paged_cache
    sampling_programs.decode = stand_in_decode
    sampling_programs.decode_layers = lambda graphdef, state: ()
    sampling_programs.prefill = lambda graphdef, state, cache, *a, **k: cache
    sampling_programs.copy_pages = lambda cache, *a, **k: cache
    models.init_paged_cache = lambda cfg, num_pages, page_size, **k: init_cache(cfg, 1, page_size,
                                                                                **k)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(sampling_programs, name, fn)
        models.init_paged_cache = init_cache


def run_point(model, slots: int, samples: int, refill_after: int, args) -> dict:
    """Stats of the workload's generate() with the stand-ins (best host time of --repeats)."""
    wl = decode_throughput.parse_args(["--new-tokens", str(args.new_tokens),
                                       "--tail-mean-div", str(args.tail_mean_div)])
    prompts = decode_throughput.random_prompts(model.cfg, samples, args.prompt_len, seed=2)
    lengths = decode_throughput.longtail_lengths(wl, samples)
    sampler = Sampler(model, max_batch_size=slots, page_size=args.page_size,
                      decode_steps_per_call=args.steps_per_call,
                      refill_after=refill_after or None)
    kwargs = dict(n=1, temperature=1.0, max_new_tokens=lengths, stop_token_ids=(), seed=0)
    best = None
    with stand_in_programs():
        for _ in range(max(1, args.repeats) + 1):  # the first builds the pool's zeros
            stats = sampler.generate(prompts, **kwargs).stats
            if best is None or stats["seconds"] < best["seconds"]:
                best = stats
    if best["generated_tokens"] != sum(lengths):
        raise RuntimeError(f"generated {best['generated_tokens']}, expected {sum(lengths)}")
    return {"slots": slots, "samples": samples, "refill_after": sampler.refill_after,
            "decode_calls": best["decode_calls"], "decode_steps": best["decode_steps"],
            "prefill_calls": best["prefill_calls"], "slot_utilization": best["slot_utilization"],
            "host_seconds": best["seconds"],
            "host_ms_per_call": 1e3 * best["seconds"] / max(1, best["decode_calls"])}


def main(argv=None):
    args = parse_args(argv)
    cfg = models.get_preset("tiny").replace(
        max_position_embeddings=args.prompt_len + args.new_tokens)
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    rows = []
    for slots in args.slots:
        for samples in args.samples:
            for refill_after in args.refill_after:
                rows.append(run_point(model, slots, samples, refill_after, args))
                timing.write_json(args.out, {"results": rows}, args=args)
    timing.print_table(
        f"Rollout scheduler with stand-in device programs on {timing.device_description()}",
        [("slots", "slots", "6d"), ("samples", "samples", "8d"),
         ("refill_after", "refill_after", "13d"), ("calls", "decode_calls", "6d"),
         ("steps", "decode_steps", "6d"), ("prefills", "prefill_calls", "9d"),
         ("util", "slot_utilization", "6.3f"), ("host s", "host_seconds", "7.3f"),
         ("host ms/call", "host_ms_per_call", "13.2f")], rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
