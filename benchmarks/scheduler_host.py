"""The rollout scheduler alone: delta_jax.sampling.Sampler's host work and call pattern with its
device programs replaced by instant stand-ins, so the numbers are the scheduler's own, on any
machine.

    python benchmarks/scheduler_host.py --slots 64 --samples 256 1024 --refill-after 2 4 8 16 \
        --refill-queue 0 -1

Why: on a GPU each decode call leaves the device idle while the host does the scheduler's work
between calls (admit, page reservation, results: ~3 ms a call at batch 64 on an H200,
2026-11-26, against a 2.9 ms decode step). A slot whose sample finishes mid-call takes the next
of the Sampler(refill_queue=) samples staged on the device; once none is left, the call ends
early, for refills, after Sampler(refill_after=) more samples have finished. The stand-ins
reproduce the calls, steps and prefills of a real run exactly (without the queue, the
long-tailed batch-64 workload: 108 decode calls and 4 prefill calls at refill_after 2, as on the
H200), so this script says how the queue and refill_after trade calls for steps, and what the
host costs per call, without a GPU.

Workload: decode_throughput.py's long-tailed one (--samples prompts of --prompt-len random
tokens, one sample each, geometric lengths of mean --new-tokens / --tail-mean-div clipped to
[1, --new-tokens], no stop token), continuous batching in --slots slots. Stand-ins: decode
advances every live slot a token a step, starts a staged sample in each slot whose sample
reached its limit, and returns when exit_after samples finished with none staged for them, or
none is live, or its num_steps ran out (what programs.decode does on a device); prefill and the
page copy return the cache as it is, and the pool is one page a layer. Tokens are not
meaningful.
Reported per (slots, samples, refill_after, refill_queue): decode calls, decode steps, the mean
rows a step ran and the steps run at each row count (Sampler shrink_batch), prefill calls, slot
utilization, and the host's seconds per generate() (best of --repeats; the stand-in decode's own
time left out) and per decode call.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

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
    p.add_argument("--refill-queue", type=int, nargs="+", default=[-1],
                   help="Sampler refill_queue values: samples staged on the device per call "
                        "(-1: its default, slots // 4; 0: none)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--tail-mean-div", type=float, default=8.0)
    p.add_argument("--steps-per-call", type=int, default=32)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed generate()s (best is kept)")
    p.add_argument("--out", default="scheduler_host.json")
    args = p.parse_args(argv)
    if min(args.slots) < 1 or min(args.samples) < 1 or min(args.refill_after) < 0 \
            or min(args.refill_queue) < -1:
        p.error("--slots and --samples must be >= 1, --refill-after >= 0, --refill-queue >= -1")
    return args


def stand_in_decode(graphdef, state, layers, cache, slots, queue, seed, stop_ids, temperature,
                    top_p, pad_id, exit_after, *, num_steps, batch_spec=None, **static):
    """programs.decode's call pattern without a model (one batch shard): every live slot
    advances a token a step until its limit (no stop token); a slot whose sample finishes takes
    the next staged queue entry; the call returns after the step at which exit_after slots have
    finished with no entry left for them, or none is live, or after num_steps."""
    active, generated, limit = (np.array(x) for x in (slots.active, slots.generated, slots.limit))
    staged = np.flatnonzero(np.asarray(queue.active)).tolist()
    queue_limit = np.asarray(queue.limit)
    num_slots = active.shape[0]
    owner = np.full((num_slots, num_steps), -2, np.int32)
    who = np.full(num_slots, -1, np.int32)
    finished = steps = 0
    while steps < num_steps and active.any() and finished < exit_after:
        owner[:, steps] = np.where(active, who, -2)
        generated += active
        steps += 1
        for k in np.flatnonzero(active & (generated >= limit)).tolist():
            if staged:
                who[k] = staged.pop(0)
                generated[k], limit[k] = 0, queue_limit[who[k]]
            else:
                active[k] = False
                finished += 1
    tokens = np.ones((num_slots, num_steps), np.int32)
    logprobs = np.zeros((num_slots, num_steps), np.float32)
    return cache, tokens, logprobs, logprobs, owner, np.int32(steps)


@contextlib.contextmanager
def stand_in_programs(decode_seconds: list = None, call_rows: list = None):
    """Within the block the Sampler's device programs are stand_in_decode and no-op layer
    slicing, prefill and page copy, and each generate()'s page pool is one page a layer (nothing
    reads it; zeroing the real pool is device work on a GPU, a large memset of host memory
    here). decode_seconds: a list the time spent in stand_in_decode (the device's work, not the
    host's) is appended to; call_rows: a list each decode call's (rows, steps) is appended to
    (rows: the slots it ran, fewer than all once Sampler shrink_batch shrinks it)."""
    names = ("decode", "decode_layers", "prefill", "copy_pages")
    saved = {name: getattr(sampling_programs, name) for name in names}
    init_cache = models.init_paged_cache

    def timed_decode(*a, **k):
        start = time.perf_counter()
        out = stand_in_decode(*a, **k)
        if decode_seconds is not None:
            decode_seconds.append(time.perf_counter() - start)
        if call_rows is not None:
            call_rows.append((len(out[1]), int(out[-1])))
        return out
    sampling_programs.decode = timed_decode
    sampling_programs.decode_layers = lambda graphdef, state: ()
    sampling_programs.prefill = lambda graphdef, state, layers, cache, *a, **k: cache
    sampling_programs.copy_pages = lambda cache, *a, **k: cache
    models.init_paged_cache = lambda cfg, num_pages, page_size, **k: init_cache(cfg, 1, page_size,
                                                                                **k)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(sampling_programs, name, fn)
        models.init_paged_cache = init_cache


def run_point(model, slots: int, samples: int, refill_after: int, refill_queue: int,
              args) -> dict:
    """Stats of the workload's generate() with the stand-ins (best host time of --repeats)."""
    wl = decode_throughput.parse_args(["--new-tokens", str(args.new_tokens),
                                       "--tail-mean-div", str(args.tail_mean_div)])
    prompts = decode_throughput.random_prompts(model.cfg, samples, args.prompt_len, seed=2)
    lengths = decode_throughput.longtail_lengths(wl, samples)
    sampler = Sampler(model, max_batch_size=slots, page_size=args.page_size,
                      decode_steps_per_call=args.steps_per_call,
                      refill_after=refill_after or None,
                      refill_queue=None if refill_queue < 0 else refill_queue)
    kwargs = dict(n=1, temperature=1.0, max_new_tokens=lengths, stop_token_ids=(), seed=0)
    best = None
    for _ in range(max(1, args.repeats) + 1):  # the first builds the pool's zeros
        stand_in, call_rows = [], []
        with stand_in_programs(stand_in, call_rows):
            stats = sampler.generate(prompts, **kwargs).stats
        stats["seconds"] -= sum(stand_in)  # the host's own time
        if best is None or stats["seconds"] < best["seconds"]:
            best = stats
    steps_by_rows = {}  # the same every run: the schedule does not depend on timing
    for rows, steps in call_rows:
        steps_by_rows[rows] = steps_by_rows.get(rows, 0) + steps
    if best["generated_tokens"] != sum(lengths):
        raise RuntimeError(f"generated {best['generated_tokens']}, expected {sum(lengths)}")
    return {"slots": slots, "samples": samples, "refill_after": sampler.refill_after,
            "refill_queue": sampler.refill_queue, "queue_refills": best["queue_refills"],
            "decode_calls": best["decode_calls"], "decode_steps": best["decode_steps"],
            "prefill_calls": best["prefill_calls"], "slot_utilization": best["slot_utilization"],
            "decode_rows": best["decode_rows"], "shrunk_calls": best["shrunk_calls"],
            "steps_by_rows": dict(sorted(steps_by_rows.items(), reverse=True)),
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
                for refill_queue in args.refill_queue:
                    rows.append(run_point(model, slots, samples, refill_after, refill_queue,
                                          args))
                    timing.write_json(args.out, {"results": rows}, args=args)
    timing.print_table(
        f"Rollout scheduler with stand-in device programs on {timing.device_description()}",
        [("slots", "slots", "6d"), ("samples", "samples", "8d"),
         ("refill_after", "refill_after", "13d"), ("queue", "refill_queue", "6d"),
         ("calls", "decode_calls", "6d"),
         ("steps", "decode_steps", "6d"), ("rows", "decode_rows", "6.1f"),
         ("prefills", "prefill_calls", "9d"),
         ("util", "slot_utilization", "6.3f"), ("host s", "host_seconds", "7.3f"),
         ("host ms/call", "host_ms_per_call", "13.2f")], rows)
    for r in rows:
        print(f"{r['slots']} slots, {r['samples']} samples: decode steps by rows "
              + ", ".join(f"{rows} rows {steps}" for rows, steps in r["steps_by_rows"].items()))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
