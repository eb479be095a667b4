"""Interleaved A/B of rollout-engine settings on decode_throughput.py's long-tailed workload: each
repeat runs every variant once, in turn, so drift of a shared or noisy machine falls on all of
them alike (separate benchmark processes on the 2-core CI VM differed by 20% with nothing
changed).

    python benchmarks/sampler_ab.py --preset tiny --dtype float32 --batch 64 --prompt-len 64 \
        --new-tokens 256 --refill-queue 0 -1 --static --repeats 5

Variants: continuous batching with each --refill-queue value (Sampler(refill_queue=); -1 = the
Sampler's default, slots // 4; 0 = none staged) at each --steps-per-call value
(Sampler(decode_steps_per_call=), default 32) with each --decode-attention value
(Sampler(decode_attention=), e.g. "mosaic mosaic_fused") and each --decode-splits value
(Sampler(decode_splits=): the Mosaic kernel's splits of a row's pages, 0 = auto; default 1;
auto is left out of the batch_invariant variants, which refuse it), and static batching with
--static
(Sampler(continuous=False, shrink_batch=False), decode_throughput's baseline), and with
--unshrunk continuous batching without shrink_batch (every decode call over all slots), with
--other-batches continuous batching at other max_batch_size values (for their tokens), these
with the first --decode-attention value; every variant once per --batch-invariant value
(Sampler(batch_invariant=): 1 compiles the prefill and decode programs with XLA's GEMMs held to
one summation order at every row count and no excess precision,
sampling.programs.BATCH_INVARIANT_OPTIONS).
Model: --preset in --dtype, random weights, with --num-layers / --vocab-size in place of the
preset's where given (a narrow, shallow stand-in for a CPU run).
Workload: --samples prompts (default 4 x --batch) of --prompt-len random tokens, one sample each, geometric lengths of mean --new-tokens / --tail-mean-div clipped
to [1, --new-tokens] (decode_throughput.longtail_lengths), T = 1, no stop token. One untimed
generate() per variant first (compiles; the compiled memory analysis of the programs it runs
is printed and stored). Reported per variant: decode calls and steps, samples
started from the queue, useful tokens/s (generated / generate() wall time) best and median of
--repeats, the median time outside decode and prefill calls (the host's share while the
device idles), and how many samples' tokens differ from those of the first variant with the same
batch_invariant value (with the index of each one's first differing token: late, isolated first
differences point at rounding near-ties rather than a scheduling fault), and how many log-probs
of the tokens drawn alike differ, by at most how much (any at all: the two runs' numerics
differ, whether or not a near-tie turned it into another token). On the CPU the tiny
float32 model's tokens do not depend on scheduling (tests/test_sampling.py), so there every
token count is 0 (its log-probs may differ by float32 rounding at other row counts: 4.8e-7 at 4
rows a call against 8, tests/test_sampler_ab.py; bfloat16 models can draw other tokens at
other slot counts, README); a GPU
may round differently shaped programs (prefill batches of other sizes) differently, which this
reports rather than stops on (one H200, 2026-11-26, bf16 Qwen3-0.6B shape, 768 samples: 0 in all
three variants). A variant that generates another number of
tokens stops the run (the lengths are forced).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
from flax import nnx

from delta_jax import models, xla_env
from delta_jax.kernels import timing
from delta_jax.sampling import Sampler

import decode_throughput  # noqa: E402  (the workload's model, prompts and lengths)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-layers", type=int, default=0, help="the preset's layers (0: as is)")
    p.add_argument("--vocab-size", type=int, default=0, help="the preset's vocabulary (0: as is)")
    p.add_argument("--batch", type=int, default=64, help="slots (Sampler max_batch_size)")
    p.add_argument("--samples", type=int, default=0, help="prompts, one sample each (0: 4 x batch)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--tail-mean-div", type=float, default=8.0)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--decode-attention", nargs="+", default=["auto"],
                   help="rollout.decode_attention values, each a variant of continuous batching")
    p.add_argument("--refill-queue", type=int, nargs="+", default=[0, -1],
                   help="continuous-batching variants' Sampler(refill_queue=) (-1: default)")
    p.add_argument("--steps-per-call", type=int, nargs="+", default=[32],
                   help="Sampler(decode_steps_per_call=) of the continuous variants (each with "
                        "each --refill-queue); static batching takes the first")
    p.add_argument("--decode-splits", type=int, nargs="+", default=[1],
                   help="Sampler(decode_splits=) values of the continuous variants (0 = auto)")
    p.add_argument("--static", action="store_true", help="add static batching as a variant")
    p.add_argument("--unshrunk", action="store_true",
                   help="add continuous batching (refill_queue default, the first "
                        "--steps-per-call) without shrink_batch: every decode call over all slots")
    p.add_argument("--batch-invariant", type=int, nargs="+", default=[0], choices=(0, 1),
                   help="Sampler(batch_invariant=) values: every variant runs with each (1: the "
                        "prefill and decode programs compiled with "
                        "programs.BATCH_INVARIANT_OPTIONS)")
    p.add_argument("--other-batches", type=int, nargs="*", default=[],
                   help="add continuous batching (defaults) at these max_batch_size values, for "
                        "their tokens against the first variant's (scheduling independence)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="sampler_ab.json")
    args = p.parse_args(argv)
    if (args.batch < 1 or args.samples < 0 or args.repeats < 1 or min(args.refill_queue) < -1
            or min(args.steps_per_call) < 1 or min(args.other_batches, default=1) < 1
            or args.num_layers < 0 or args.vocab_size < 0 or min(args.decode_splits) < 0):
        p.error("--batch, --other-batches, --repeats and --steps-per-call must be >= 1, "
                "--samples, --num-layers, --vocab-size and --decode-splits >= 0, "
                "--refill-queue >= -1")
    return args


def first_differences(tokens, reference) -> list:
    """For each sample whose token ids differ from the reference's (lists of ids, same lengths),
    the index of the first response token that differs."""
    return [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            for a, b in zip(tokens, reference) if list(a) != list(b)]


def logprob_differences(tokens, logprobs, reference, reference_logprobs) -> dict:
    """The log-probs of the tokens both runs drew alike (each sample's response up to its first
    differing token) against the reference's: how many differ at all, and the largest absolute
    difference. Equal programs give 0 and 0.0; a nonzero count with no differing token still
    says the two runs' numerics differ (the rounding that near-ties turn into other tokens)."""
    count, largest, compared = 0, 0.0, 0
    for a, b, la, lb in zip(tokens, reference, logprobs, reference_logprobs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        diff = np.abs(np.asarray(la[:same], np.float64) - np.asarray(lb[:same], np.float64))
        compared += same
        count += int(np.count_nonzero(diff))
        largest = max(largest, float(diff.max(initial=0.0)))
    return {"tokens_compared": compared, "logprobs_differing": count,
            "logprob_diff_max": largest}


def workload_and_model(args):
    """decode_throughput's arguments for the workload, and the model config: --preset in --dtype
    with --num-layers / --vocab-size in place of the preset's where given."""
    wl = decode_throughput.parse_args([
        "--preset", args.preset, "--dtype", args.dtype, "--prompt-len", str(args.prompt_len),
        "--new-tokens", str(args.new_tokens), "--tail-mean-div", str(args.tail_mean_div)])
    cfg = decode_throughput.model_config(wl)
    return wl, cfg.replace(num_layers=args.num_layers or cfg.num_layers,
                           vocab_size=args.vocab_size or cfg.vocab_size)


def main(argv=None):
    xla_env.apply_default_flags()  # the product's XLA flags (as delta_jax.main), before JAX starts
    args = parse_args(argv)
    wl, cfg = workload_and_model(args)
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    count = args.samples or 4 * args.batch
    prompts = decode_throughput.random_prompts(cfg, count, args.prompt_len, seed=2)
    lengths = decode_throughput.longtail_lengths(wl, count)
    kwargs = decode_throughput.generate_kwargs(wl, lengths)
    variants = {}
    for invariant in args.batch_invariant:
        first_splits = next((x for x in args.decode_splits if x or not invariant), 1)
        common = dict(max_batch_size=args.batch, page_size=args.page_size,
                      decode_attention=args.decode_attention[0], batch_invariant=bool(invariant),
                      decode_splits=first_splits)
        tag = ", batch_invariant" if invariant else ""
        for splits in args.decode_splits:
            if invariant and not splits:  # auto varies with a call's rows: refused there
                continue
            for attention in args.decode_attention:
                for steps in args.steps_per_call:
                    for q in args.refill_queue:
                        name = f"continuous, refill_queue {'default' if q < 0 else q}"
                        if len(args.steps_per_call) > 1:
                            name += f", {steps} steps a call"
                        if len(args.decode_attention) > 1:
                            name += f", {attention}"
                        if len(args.decode_splits) > 1:
                            name += f", decode_splits {splits or 'auto'}"
                        variants[name + tag] = Sampler(
                            model, refill_queue=None if q < 0 else q, decode_steps_per_call=steps,
                            **dict(common, decode_attention=attention, decode_splits=splits))
        if args.unshrunk:
            variants["continuous, refill_queue default, shrink_batch off" + tag] = Sampler(
                model, shrink_batch=False, decode_steps_per_call=args.steps_per_call[0], **common)
        for other in args.other_batches:
            variants[f"continuous, max_batch_size {other}" + tag] = Sampler(
                model, decode_steps_per_call=args.steps_per_call[0],
                **dict(common, max_batch_size=other))
        if args.static:
            variants["static" + tag] = Sampler(model, continuous=False, shrink_batch=False,
                                               decode_steps_per_call=args.steps_per_call[0],
                                               **common)
    runs = {name: [] for name in variants}
    references, memory, differing, logprob_diffs = {}, {}, {}, {}
    for name, sampler in variants.items():  # compiles; the programs' compiled memory printed
        calls = {}
        with decode_throughput.recording_sampler_programs(calls):
            out = sampler.generate(prompts, **kwargs)
        memory[name] = timing.print_recorded_memory(calls, prefix=f"{name}: ")
        # one list of token ids (log-probs) per sample
        tokens = [ids for per_prompt in out.response_ids for ids in per_prompt]
        logprobs = [lp for per_prompt in out.logprobs for lp in per_prompt]
        # against the first variant compiled alike (other XLA options may round otherwise)
        first, ref_tokens, ref_logprobs = references.setdefault(
            sampler.batch_invariant, (name, tokens, logprobs))
        if [len(t) for t in tokens] != [len(t) for t in ref_tokens]:
            raise RuntimeError(f"{name}: response lengths differ from {first}'s (they are forced)")
        differing[name] = firsts = first_differences(tokens, ref_tokens)
        logprob_diffs[name] = diffs = logprob_differences(tokens, logprobs, ref_tokens,
                                                          ref_logprobs)
        if firsts:
            print(f"{name}: {len(firsts)} of {count} samples' tokens differ from {first}'s "
                  f"(first differing response token: min {min(firsts)}, median "
                  f"{statistics.median(firsts):g})", flush=True)
        if diffs["logprobs_differing"]:
            print(f"{name}: {diffs['logprobs_differing']} of the {diffs['tokens_compared']} "
                  f"log-probs of tokens drawn alike differ from {first}'s (largest by "
                  f"{diffs['logprob_diff_max']:.3g})", flush=True)
    order = []  # the timed runs as they ran: each repeat runs every variant once, in turn
    for repeat in range(args.repeats):
        for name, sampler in variants.items():
            runs[name].append(sampler.generate(prompts, **kwargs).stats)
            order.append(name)
        print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
    rows = []
    for name, stats in runs.items():
        seconds = [s["seconds"] for s in stats]
        outside = [s["seconds"] - s["decode_seconds"] - s["prefill_seconds"] for s in stats]
        tokens = stats[0]["generated_tokens"]
        rows.append({"variant": name, "decode_attention": variants[name].decode_attention,
                     "refill_queue": variants[name].refill_queue,
                     "steps_per_call": variants[name].decode_steps_per_call,
                     "shrink_batch": variants[name].shrink_batch,
                     "batch_invariant": variants[name].batch_invariant,
                     "decode_splits": variants[name].decode_splits,
                     "max_batch_size": variants[name].max_batch_size,
                     "decode_rows": stats[0]["decode_rows"],
                     "decode_calls": stats[0]["decode_calls"],
                     "decode_steps": stats[0]["decode_steps"],
                     "queue_refills": stats[0]["queue_refills"], "generated_tokens": tokens,
                     "tokens_per_s_best": tokens / min(seconds),
                     "tokens_per_s_median": tokens / statistics.median(seconds),
                     "outside_calls_s_median": statistics.median(outside), "seconds": seconds,
                     "samples_differing": len(differing[name]),
                     "first_differences": differing[name], **logprob_diffs[name],
                     "compiled_memory": memory[name]})
    timing.write_json(args.out, {"results": rows, "run_order": order}, args=args)
    timing.print_table(
        f"Long-tailed workload, {count} samples in {args.batch} slots, {args.preset} "
        f"{args.dtype}, interleaved x {args.repeats}, on {timing.device_description()}",
        [("variant", "variant", "60s"), ("calls", "decode_calls", "6d"),
         ("steps", "decode_steps", "6d"), ("rows", "decode_rows", "6.1f"),
         ("queued", "queue_refills", "7d"),
         ("tok/s best", "tokens_per_s_best", "11.0f"),
         ("tok/s median", "tokens_per_s_median", "13.0f"),
         ("outside s", "outside_calls_s_median", "10.3f"),
         ("differ", "samples_differing", "7d"),
         ("logp differ", "logprobs_differing", "12d")], rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
