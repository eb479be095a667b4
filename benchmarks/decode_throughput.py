"""Decode throughput of the rollout engine (delta_jax.sampling.Sampler: continuous batching over
a paged KV cache) next to the memory-bandwidth limit, to static batching on a long-tailed length
workload, and to transformers' PyTorch generate on the same device.

    # The GPU measurement of issue 15 (one command; Qwen3-0.6B shape, bf16, prompt 512,
    # 1024 new tokens, T = 1; the Mosaic GPU paged-attention kernel and the jnp reference path;
    # fixed-length and long-tailed workloads at batch 64 and 256):
    python benchmarks/decode_throughput.py --preset qwen3-0.6b --dtype bfloat16 \
        --batch 64 256 --prompt-len 512 --new-tokens 1024 --decode-attention mosaic reference \
        --workload fixed longtail --output decode_throughput.json
    # A CPU smoke run:
    python benchmarks/decode_throughput.py --preset tiny --dtype float32 --batch 4 \
        --prompt-len 32 --new-tokens 32 --hf never --repeats 1 --copy-mib 64 \
        --workload fixed longtail --tail-samples 16

Workloads (--workload):
* fixed: B prompts of --prompt-len random tokens, one sample each, no stop token, so every
  sequence generates exactly --new-tokens tokens in B slots. Decode tokens/s = generated tokens /
  time in the decode program (the engine's stats["decode_seconds"]: every response token, the
  first included, comes from a decode step; prefill is timed apart, compile excluded by a first
  untimed run, best of --repeats). Per decode attention path (--decode-attention: "mosaic" = the
  Mosaic GPU paged-attention kernel (Hopper), "reference" = the jnp page loop, "auto").
  Bytes per decode step: parameters (every matmul weight once; of the embedding table and the LM
  head only the LM head) + K and V at the live length (prompt_len + s at step s, averaged). The
  bandwidth limit: B x copy bandwidth / those bytes; the copy bandwidth is measured in the same
  run (kernels.timing.copy_bandwidth: bytes read + written / time of a jitted copy of --copy-mib
  MiB, in chains of copies waited for once, so that a call's dispatch + sync latency does not
  count; one 1 GiB copy waited for alone read 20-40% low on an H200, and "% limit" over 100%).
  "% limit" = measured / limit. Logits, activations and sampling traffic are not counted.
* longtail: --tail-samples prompts (default 4 x B), one sample each, with a length schedule
  (per-prompt max_new_tokens; no stop token): geometric lengths of mean --new-tokens /
  --tail-mean-div, clipped to [1, --new-tokens], so a few samples run --new-tokens long and most
  stop early, as RL responses do. Run in B slots with continuous batching and with static
  batching (Sampler(continuous=False, shrink_batch=False): a batch decodes until its longest
  sample stops, every step over all B slots; the same programs otherwise); --tail-modes adds
  continuous batching without shrink_batch (every call over all B slots, as before 2026-11-27)
  and static batching with it (a draining batch runs only the rows its live samples need).
  Continuous batching prefills ahead (a refill's prefill call also takes the
  next waiting prompts) unless --no-prefill-ahead, stages --refill-queue waiting samples on the
  device with each decode call, started mid-call as slots free (default: the Sampler's, slots //
  4; recorded as longtail.refill_queue), and once none is staged a decode call returns to refill
  after --refill-after more samples have finished (default: the Sampler's, slots // 16; recorded
  as longtail.refill_after). Useful tokens/s = generated tokens / wall time
  of generate() (prefill included), best of --repeats after an untimed run; "x static" =
  continuous / static.
* transformers generate (fixed workload; greedy or the same sampling settings, same model shape
  and dtype, random weights, sdpa, --hf-cache dynamic or static) on the same device when torch
  has CUDA (or with --hf always, e.g. on CPU); skipped otherwise. It runs first, one child process
  per batch size, before JAX takes the device; a failure (e.g. out of memory) is recorded and the
  run goes on. Its decode time = a full generate minus a 1-new-token generate, best of --repeats.
Mosaic kernel parameters (an experiment, not a product setting): --mosaic-kernel K_SPLITS
PAGES_PER_BLOCK STAGES runs the Mosaic GPU decode kernel (delta_jax.kernels.paged_decode, what
--decode-attention mosaic, and auto on Hopper, run) with these instead of its defaults, so its
parameters can be compared in the whole decode (on an H200 the long-tailed workload's attention
read K/V at ~2.2 TB/s where every-row-live decode read ~3.35: k_splits > 1 may balance the
ragged rows better). --mosaic-rows R runs it with R rows a block (paged_decode_mosaic's
rows_per_block: a block attends R sequences in turn, its page copies one stream across them, so
the next row's first pages arrive while a row finishes, and batch 64 is 256 blocks, not 512).
--mosaic-pdl runs it with programmatic dependent launch (paged_decode_mosaic's
pdl: its blocks start while the kernel before it drains; marked for the launch by jax >= 0.11).
(--mosaic-kernel's K_SPLITS holds for every call; the product's own setting is --decode-splits,
Sampler(decode_splits=): 1, a fixed count, or 0 = auto, per call from its rows.)
Each row records them (mosaic_kernel); they apply to the attention kernel alone and to the fused
step (paged_write_decode_mosaic: the q / k norms, RoPE and page writes in the attention kernel,
what --decode-attention mosaic_fused runs where attention.fused_write_attend holds; "mosaic"
runs XLA's norms, RoPE and two scatters a layer, then the attention kernel: the A/B of the two
is `--decode-attention mosaic mosaic_fused`, and each row's "fused_write" says which ran).
Memory: for every engine configuration, XLA's memory analysis of the sampler's jitted programs
(prefill, decode, page copy; each compiled again from its first call's shapes) on the backend
that runs them is printed and stored with the results (compiled_memory).
A failure of one engine configuration (e.g. out of memory, or a kernel that does not compile) is
recorded in the table and the JSON, and the run goes on. Results are written as JSON after every
configuration (--output).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax import models, xla_env
from delta_jax.kernels import paged_decode, timing
from delta_jax.models import attention
from delta_jax.sampling import Sampler
from delta_jax.sampling import programs as sampling_programs

WORKLOADS = ("fixed", "longtail")
# The long tail's runs: name -> (Sampler continuous, shrink_batch). "static" is issue #15's
# baseline: a batch decodes until its longest sample stops, every step over every slot.
TAIL_MODES = {"continuous": (True, True), "static": (False, False),
              "continuous_unshrunk": (True, False), "static_shrunk": (False, True)}


# --mosaic-kernel's three values, in order: paged_decode_mosaic's (and config_problem's) names
MOSAIC_KERNEL_PARAMS = ("k_splits", "pages_per_block", "stages")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-0.6b", help="models.get_preset name")
    p.add_argument("--dtype", default="bfloat16", help="parameter and activation dtype")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256],
                   help="slots (Sampler max_batch_size)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--decode-attention", nargs="+", default=["auto"],
                   choices=attention.DECODE_IMPLS,
                   help="paged decode attention: mosaic (Hopper GPU kernel), mosaic_fused (with "
                        "the q / k norms, RoPE and page writes inside it), reference (jnp), auto")
    p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=["fixed", "longtail"])
    p.add_argument("--tail-samples", type=int, default=0, help="longtail prompts (0 = 4 x B)")
    p.add_argument("--tail-mean-div", type=float, default=8.0,
                   help="longtail mean length = new_tokens / this")
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--steps-per-call", type=int, default=32, help="decode steps per call")
    p.add_argument("--kv-budget-gb", type=float, default=0.0, help="0 = the worst case")
    p.add_argument("--refill-after", type=int, default=0,
                   help="Sampler(refill_after=): finished samples a continuous-batching decode "
                        "call waits for before returning to refill (0: the Sampler's default, "
                        "slots // 16)")
    p.add_argument("--refill-queue", type=int, default=-1,
                   help="Sampler(refill_queue=): waiting samples staged on the device with each "
                        "continuous-batching decode call, started as slots free (-1: the "
                        "Sampler's default, slots // 4; 0: none)")
    p.add_argument("--tail-modes", nargs="+", choices=list(TAIL_MODES),
                   default=["continuous", "static"],
                   help="longtail runs: continuous (the Sampler's defaults), static (Sampler("
                        "continuous=False, shrink_batch=False): every step runs every slot, the "
                        "baseline), continuous_unshrunk / static_shrunk (the same with "
                        "shrink_batch flipped: what running only the rows a draining batch needs "
                        "is worth); x static is each against static")
    p.add_argument("--no-prefill-ahead", action="store_true",
                   help="continuous batching prefills only the prompts it admits (one prefill "
                        "call per refill; Sampler(prefill_ahead=False))")
    p.add_argument("--restart-preempted", action="store_true",
                   help="Sampler(resume_preempted=False): a sample preempted when the page pool "
                        "(--kv-budget-gb) runs dry restarts from its first token instead of "
                        "resuming after a prefill of its prompt and tokens")
    p.add_argument("--batch-invariant", action="store_true",
                   help="Sampler(batch_invariant=True): the prefill and decode programs compiled "
                        "with XLA's GEMMs held to one summation order at every row count")
    p.add_argument("--repeats", type=int, default=2, help="timed runs (best is kept)")
    p.add_argument("--profile", default="",
                   help="trace one more generate() of each workload (and each longtail mode) "
                        "into this folder and print the device time by kernel and the device's "
                        "kernel time against the wall time (kernels.timing.trace_summary)")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy-bandwidth probe")
    p.add_argument("--hf", choices=["auto", "always", "never"], default="auto",
                   help="transformers baseline: auto = only when torch has CUDA")
    p.add_argument("--hf-cache", choices=["dynamic", "static"], default="dynamic",
                   help="transformers' KV cache (generate's cache_implementation)")
    p.add_argument("--decode-splits", type=int, default=1,
                   help="Sampler(decode_splits=): the Mosaic kernel's splits of a row's pages "
                        "(rollout.decode_splits; 0 = auto, per call from its rows)")
    p.add_argument("--mosaic-kernel", type=int, nargs=3, default=None,
                   metavar=("K_SPLITS", "PAGES_PER_BLOCK", "STAGES"),
                   help="the Mosaic GPU decode kernel's parameters (default: its own)")
    p.add_argument("--mosaic-rows", type=int, default=None, metavar="ROWS_PER_BLOCK",
                   help="rows a block of the Mosaic GPU decode kernel attends (default: its own)")
    p.add_argument("--mosaic-pdl", action="store_true",
                   help="the Mosaic GPU decode kernel with programmatic dependent launch")
    p.add_argument("--output", default="decode_throughput.json")
    p.add_argument("--hf-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.new_tokens < 2 or args.prompt_len < 2 or min(args.batch) < 1:
        p.error("--new-tokens and --prompt-len must be >= 2, --batch >= 1")
    if args.refill_after < 0:
        p.error("--refill-after must be >= 0 (0: the Sampler's default)")
    if args.refill_queue < -1:
        p.error("--refill-queue must be >= -1 (-1: the Sampler's default)")
    if not {"continuous", "static"} <= set(args.tail_modes):
        p.error("--tail-modes must include continuous and static (the comparison)")
    args.tail_modes = list(dict.fromkeys(args.tail_modes))
    if args.mosaic_kernel is not None or args.mosaic_rows is not None:
        cfg = model_config(args)
        problem = paged_decode.config_problem(
            cfg.dtype, cfg.head_dim, args.page_size, cfg.num_groups,
            **{k: v for k, v in mosaic_kwargs(args).items() if k != "pdl"})
        if problem:
            p.error(f"--mosaic-kernel / --mosaic-rows: {problem}")
    return args


def mosaic_kwargs(args) -> dict:
    """paged_decode_mosaic's keyword arguments from --mosaic-kernel, --mosaic-rows and
    --mosaic-pdl ({} without any)."""
    kwargs = {} if args.mosaic_kernel is None else dict(
        zip(MOSAIC_KERNEL_PARAMS, args.mosaic_kernel))
    if args.mosaic_rows is not None:
        kwargs["rows_per_block"] = args.mosaic_rows
    return {**kwargs, "pdl": True} if args.mosaic_pdl else kwargs


@contextlib.contextmanager
def mosaic_parameters(kwargs: dict):
    """Within the block the Mosaic GPU decode kernels (the attention alone and the fused step)
    run with `kwargs` (attention.paged_decode_attention and paged_write_attend look them up at
    each trace), over what the caller passes (its k_splits: rollout.decode_splits); nothing
    changes for {}."""
    names = ("paged_decode_mosaic", "paged_write_decode_mosaic")
    originals = [getattr(paged_decode, name) for name in names]
    if kwargs:
        for name, original in zip(names, originals):
            setattr(paged_decode, name,
                    lambda *a, original=original, **k: original(*a, **{**k, **kwargs}))
    try:
        yield
    finally:
        for name, original in zip(names, originals):
            setattr(paged_decode, name, original)


def param_bytes(cfg: models.ModelConfig) -> int:
    """Bytes of parameters read per decode step: every matmul weight once; of the embedding
    table and the LM head only the LM head (the token gather reads B rows)."""
    untied_embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (cfg.num_params() - untied_embedding) * jnp.dtype(cfg.param_dtype).itemsize


def cache_bytes(cfg: models.ModelConfig, batch: int, length: float) -> float:
    """Bytes of K and V for `batch` sequences of `length` cached tokens."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    return batch * length * per_token * jnp.dtype(cfg.dtype).itemsize


def time_transformers(cfg: models.ModelConfig, batch: int, args, device: str) -> dict:
    """transformers generate at the same shapes; decode = full generate - 1-token generate."""
    import torch
    import transformers

    hf_cfg = models.hf_config_dict(cfg)
    config = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype, torch.float32)
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                           attn_implementation="sdpa").eval()
    ids = torch.randint(1, cfg.vocab_size, (batch, args.prompt_len), device=device)
    kwargs = dict(do_sample=args.temperature > 0, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids))
    if args.hf_cache == "static":
        kwargs["cache_implementation"] = "static"
    if args.temperature > 0:
        kwargs.update(temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k if args.top_k > 0 else None)

    def run(new_tokens):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out.shape[1] - args.prompt_len

    run(2)  # warm-up
    prefill_s = min(run(1)[0] for _ in range(args.repeats))
    total_s, new = min(run(args.new_tokens) for _ in range(args.repeats))
    decode_s = max(total_s - prefill_s, 1e-9)
    del hf
    return {"hf_device": device, "hf_cache": args.hf_cache, "hf_prefill_s": prefill_s,
            "hf_total_s": total_s, "hf_decode_s": decode_s,
            "hf_decode_tokens_per_s": batch * (new - 1) / decode_s}


def hf_device(mode: str):
    """Where transformers runs: CUDA when torch has it, the CPU only when asked (--hf always);
    None: no baseline."""
    if mode == "never":
        return None
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if mode == "always" else None


def time_transformers_in_subprocess(batch: int, argv) -> dict:
    """time_transformers in a child process: torch then owns the GPU memory alone (JAX
    preallocates 75% of it on first use) and returns all of it on exit, and neither framework
    loads its CUDA libraries beside the other's; an out-of-memory or other failure is recorded,
    not fatal. JAX in the child stays on the CPU. {} when there is no baseline to run."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "hf.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--hf-worker", str(batch),
               "--output", out_path]
        proc = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            print(f"transformers generate at batch {batch} failed: {tail}")
            return {"hf_error": tail}
        with open(out_path) as f:
            return json.load(f)


def model_config(args) -> models.ModelConfig:
    dtype = jnp.dtype(args.dtype)
    cfg = models.get_preset(args.preset, dtype=dtype, param_dtype=dtype)
    return cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings,
                                                   args.prompt_len + args.new_tokens))


def make_sampler(model, batch: int, impl: str, args, continuous: bool = True,
                 shrink: bool = True) -> Sampler:
    budget = int(args.kv_budget_gb * 2**30) if args.kv_budget_gb > 0 else None
    return Sampler(model, max_batch_size=batch, page_size=args.page_size,
                   decode_steps_per_call=args.steps_per_call, decode_attention=impl,
                   kv_budget_bytes=budget, continuous=continuous, shrink_batch=shrink,
                   batch_invariant=args.batch_invariant, decode_splits=args.decode_splits,
                   prefill_ahead=not args.no_prefill_ahead,
                   resume_preempted=not args.restart_preempted,
                   refill_after=args.refill_after or None,
                   refill_queue=None if args.refill_queue < 0 else args.refill_queue)


def random_prompts(cfg, count: int, length: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return rng.integers(1, cfg.vocab_size, size=(count, length)).tolist()


def generate_kwargs(args, max_new_tokens) -> dict:
    """Sampler.generate's arguments for every benchmark run: one sample a prompt, no stop token."""
    return dict(n=1, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                max_new_tokens=max_new_tokens, stop_token_ids=(), seed=0)


def timed_generate(sampler: Sampler, prompts, max_new_tokens, args) -> dict:
    """An untimed generate (compiles), then the best of --repeats by wall time."""
    kwargs = generate_kwargs(args, max_new_tokens)
    calls = {}
    with recording_sampler_programs(calls):
        start = time.perf_counter()
        sampler.generate(prompts, **kwargs)
        first = time.perf_counter() - start
    memory = timing.print_recorded_memory(calls, prefix="sampler program (first call) ")
    best = None
    for _ in range(max(1, args.repeats)):
        stats = sampler.generate(prompts, **kwargs).stats
        if best is None or stats["seconds"] < best["seconds"]:
            best = stats
    return {"compile_and_first_run_s": first, **best, "compiled_memory": memory}


# delta_jax.sampling.programs' programs, each recorded under its own name; the batch-invariant
# twins (Sampler(batch_invariant=True) runs them instead) under their twin's
SAMPLER_PROGRAMS = {"prefill": "prefill", "decode": "decode", "copy_pages": "copy_pages",
                    "batch_invariant_prefill": "prefill", "batch_invariant_decode": "decode"}


@contextlib.contextmanager
def recording_sampler_programs(calls: dict):
    """Within the block, the sampler's jitted programs record their first call's shapes in
    `calls` (timing.recording_first_call)."""
    saved = {name: getattr(sampling_programs, name) for name in SAMPLER_PROGRAMS}
    for name, fn in saved.items():
        setattr(sampling_programs, name,
                timing.recording_first_call(fn, SAMPLER_PROGRAMS[name], calls))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(sampling_programs, name, fn)


def fixed_workload(model, batch: int, impl: str, args, bandwidth: float) -> dict:
    cfg = model.cfg
    sampler = make_sampler(model, batch, impl, args)
    prompts = random_prompts(cfg, batch, args.prompt_len)
    stats = timed_generate(sampler, prompts, args.new_tokens, args)
    expected = batch * args.new_tokens
    if stats["generated_tokens"] != expected:
        raise RuntimeError(f"generated {stats['generated_tokens']} tokens, expected {expected}")
    profile = profile_generate(sampler, prompts, args, f"fixed_b{batch}_{impl}") \
        if args.profile else None
    # A step's bytes: the whole run's (every sample new_tokens long) over its new_tokens steps.
    step_bytes = decode_read_bytes(cfg, [args.new_tokens] * batch, args.prompt_len,
                                   args.new_tokens) / args.new_tokens
    out = {
        "decode_tokens_per_s": stats["generated_tokens"] / stats["decode_seconds"],
        "bandwidth_limit_tokens_per_s": batch * bandwidth / step_bytes,
        "step_read_ideal_gb": step_bytes / 1e9,
        "cache_read_ideal_gb": (step_bytes - param_bytes(cfg)) / 1e9,
        "stats": stats,
    }
    out["fraction_of_limit"] = out["decode_tokens_per_s"] / out["bandwidth_limit_tokens_per_s"]
    if profile is not None:
        out["profile"] = profile
    return out


def profile_generate(sampler: Sampler, prompts, args, label: str, max_new_tokens=None) -> dict:
    """One more (already compiled) generate() under jax.profiler.trace into --profile/label; prints
    and returns the device time by kernel, per decode step (the whole generate, prefill included,
    divided by its decode steps), and the device's summed kernel time against the generate's
    wall time (the rest: host work, launches and idle gaps). max_new_tokens: generate's (default
    --new-tokens; a list per prompt for the long-tailed workload)."""
    new = args.new_tokens if max_new_tokens is None else max_new_tokens
    out, every, device_s = timing.traced_kernels(
        os.path.join(args.profile, label),
        lambda: sampler.generate(prompts, **generate_kwargs(args, new)))
    stats = out.stats
    rows = every[:25]
    steps = max(1, stats["decode_steps"])
    timing.print_table(f"device time by kernel, {label} ({steps} decode steps; us per step)", [
        ("kernel", lambda r: r["name"][:60], "60s"),
        ("program", lambda r: r["module"][:16], "16s"),
        ("us/step", lambda r: r["total_us"] / steps, "10.1f"),
        ("calls/step", lambda r: r["count"] / steps, "10.1f"), ("share", "share", "7.3f")], rows)
    print(f"{label}: device kernels "
          f"{'n/a (no device in the trace)' if device_s is None else f'{device_s:.3f} s'} of "
          f"{stats['seconds']:.3f} s wall ({stats['decode_calls']} decode calls, "
          f"{stats['prefill_calls']} prefill calls)", flush=True)
    return {"decode_steps": steps, "seconds": stats["seconds"], "device_kernel_s": device_s,
            "decode_calls": stats["decode_calls"], "prefill_calls": stats["prefill_calls"],
            "kernels": every[:80]}  # more than printed: hlo_fusions.py joins them with the HLO


def decode_read_bytes(cfg: models.ModelConfig, lengths, prompt_len: int, steps: int) -> float:
    """Bytes a run of samples of `lengths` response tokens must read in its `steps` decode
    steps: the parameters once a step (param_bytes) and, for each response token t (0-based) of
    each sample, K and V of prompt_len + t cached tokens, whatever the schedule. The fixed
    workload's per-step bytes and the long tail's read limit."""
    n = np.asarray(lengths, np.float64)
    cached = float(np.sum(n * prompt_len + n * (n - 1) / 2))
    return steps * param_bytes(cfg) + cache_bytes(cfg, 1, cached)


def prefill_flops(cfg: models.ModelConfig, prompts: int, prompt_len: int) -> float:
    """FLOPs of prefilling `prompts` prompts: the forward of every token but the last (its KV
    comes from the first decode step), no LM head; train_throughput.model_flops' dense and
    causal attention terms, which count forward + backward as 3 forwards."""
    from train_throughput import model_flops  # a sibling benchmark, on sys.path with this one
    flops = model_flops(cfg, prompts, prompt_len - 1, 0)
    return (flops["dense"] + flops["attention"]) / 3


def resume_prefill_flops(cfg: models.ModelConfig, stats: dict, prompt_len: int) -> float:
    """FLOPs of the prefills that resumed preempted samples (their prompt and the tokens they
    had), taken as rows of the mean resumed length; 0 without resumes."""
    if not stats["resumed"]:
        return 0.0
    mean_tokens = round(stats["resumed_tokens"] / stats["resumed"])
    return prefill_flops(cfg, stats["resumed"], prompt_len + mean_tokens)


def longtail_lengths(args, count: int) -> list:
    """Geometric lengths of mean new_tokens / tail_mean_div, clipped to [1, new_tokens]."""
    rng = np.random.default_rng(1)
    mean = max(1.0, args.new_tokens / args.tail_mean_div)
    lengths = np.minimum(rng.geometric(min(1.0, 1.0 / mean), size=count), args.new_tokens)
    lengths[0] = args.new_tokens  # the tail: at least one sample runs the whole length
    return [int(x) for x in lengths]


def longtail_workload(model, batch: int, impl: str, args, bandwidth: float) -> dict:
    """Each --tail-modes run's useful tokens/s; beside it, its decode calls' time against the
    bytes the run must read at the copy bandwidth (decode_read_bytes: the limit of a
    bandwidth-bound decode with these lengths and the run's decode steps), and its prefill
    calls' FLOP rate."""
    count = args.tail_samples or 4 * batch
    prompts = random_prompts(model.cfg, count, args.prompt_len, seed=2)
    lengths = longtail_lengths(args, count)
    out = {"samples": count, "mean_length": float(np.mean(lengths)),
           "max_length": int(max(lengths))}
    for mode in args.tail_modes:
        continuous, shrink = TAIL_MODES[mode]
        sampler = make_sampler(model, batch, impl, args, continuous, shrink)
        stats = timed_generate(sampler, prompts, lengths, args)
        if stats["generated_tokens"] != sum(lengths):
            raise RuntimeError(f"{mode}: generated {stats['generated_tokens']} tokens, "
                               f"expected {sum(lengths)}")
        ideal = decode_read_bytes(model.cfg, lengths, args.prompt_len, stats["decode_steps"])
        out[mode] = {"useful_tokens_per_s": stats["generated_tokens"] / stats["seconds"],
                     "continuous": sampler.continuous, "shrink_batch": sampler.shrink_batch,
                     "decode_read_ideal_gb": ideal / 1e9,
                     "decode_fraction_of_limit": ideal / bandwidth / stats["decode_seconds"],
                     "prefill_tflop_s": (prefill_flops(model.cfg, stats["prefilled_prompts"],
                                                       args.prompt_len)
                                         + resume_prefill_flops(model.cfg, stats,
                                                                args.prompt_len))
                     / stats["prefill_seconds"] / 1e12,
                     "stats": stats}
        if continuous:
            out["refill_after"] = sampler.refill_after
            out["refill_queue"] = sampler.refill_queue
        if args.profile:  # where the continuous run's time goes beside the static one's
            out[mode]["profile"] = profile_generate(sampler, prompts, args,
                                                    f"longtail_b{batch}_{impl}_{mode}", lengths)
    for mode in args.tail_modes:
        if mode != "static":
            out["speedup_vs_static" if mode == "continuous" else f"{mode}_vs_static"] = (
                out[mode]["useful_tokens_per_s"] / out["static"]["useful_tokens_per_s"])
    return out


def attempt(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def main(argv=None):
    xla_env.apply_default_flags()  # the product's XLA flags (as delta_jax.main), before JAX starts
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cfg = model_config(args)
    if args.hf_worker is not None:  # the child of time_transformers_in_subprocess
        device = hf_device(args.hf)
        result = {} if device is None else time_transformers(cfg, args.hf_worker, args, device)
        with open(args.output, "w") as f:
            json.dump(result, f)
        return

    # transformers first, before JAX takes the device (see time_transformers_in_subprocess).
    hf_results = {}
    if args.hf != "never" and "fixed" in args.workload:
        for batch in args.batch:
            print(f"transformers generate (--hf {args.hf}): batch {batch}", flush=True)
            hf_results[batch] = time_transformers_in_subprocess(batch, argv)
            if not hf_results[batch]:  # no torch, or --hf auto without CUDA: none for any batch
                break

    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    bandwidth = timing.copy_bandwidth(args.copy_mib)
    device = jax.devices()[0]
    results = []
    for batch in args.batch:
        for impl in args.decode_attention:
            row = {"preset": args.preset, "dtype": args.dtype, "batch": batch,
                   "decode_attention": impl,
                   "resolved_attention": attention.resolve_decode_impl(
                       impl, dtype=cfg.dtype, head_dim=cfg.head_dim, page_size=args.page_size,
                       group=cfg.num_groups),
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "page_size": args.page_size, "steps_per_call": args.steps_per_call,
                   "device": f"{device.platform}:{device.device_kind}",
                   "copy_bandwidth_gb_s": bandwidth / 1e9, "param_gb": param_bytes(cfg) / 1e9,
                   "mosaic_kernel": mosaic_kwargs(args) or "defaults"}
            row["fused_write"] = attention.fused_write_attend(
                row["resolved_attention"], cfg.dtype, cfg.dtype, cfg.head_dim, args.page_size,
                cfg.num_groups, True)
            if "fixed" in args.workload:
                print(f"fixed: batch {batch}, {impl}", flush=True)
                with mosaic_parameters(mosaic_kwargs(args)):
                    row["fixed"] = attempt(fixed_workload, model, batch, impl, args, bandwidth)
                row.update(hf_results.get(batch, {}))
                if "hf_decode_tokens_per_s" in row and "error" not in row["fixed"]:
                    row["fixed"]["speedup_vs_hf"] = (row["fixed"]["decode_tokens_per_s"]
                                                     / row["hf_decode_tokens_per_s"])
            if "longtail" in args.workload:
                print(f"longtail: batch {batch}, {impl}", flush=True)
                with mosaic_parameters(mosaic_kwargs(args)):
                    row["longtail"] = attempt(longtail_workload, model, batch, impl, args,
                                              bandwidth)
            results.append(row)
            write_results(args, results)  # after every configuration

    print_table(results)
    print(f"wrote {args.output}")


def print_table(results):
    header = ["batch", "attention", "decode tok/s", "limit tok/s", "% limit", "KV GB",
              "HF tok/s", "tail cont tok/s", "tail static", "x static", "tail util",
              "tail prefills"]
    print(" | ".join(f"{h:>15}" for h in header))
    for r in results:
        f, t = r.get("fixed", {}), r.get("longtail", {})
        cells = [r["batch"], r["resolved_attention"]]
        if f and "error" not in f:
            cells += [f"{f['decode_tokens_per_s']:.1f}", f"{f['bandwidth_limit_tokens_per_s']:.1f}",
                      f"{100 * f['fraction_of_limit']:.1f}", f"{f['stats']['kv_bytes'] / 1e9:.3g}"]
        else:
            cells += ["error" if f else "-"] + ["-"] * 3
        cells.append(f"{r['hf_decode_tokens_per_s']:.1f}" if "hf_decode_tokens_per_s" in r
                     else ("error" if "hf_error" in r else "skip"))
        if t and "error" not in t:
            cells += [f"{t['continuous']['useful_tokens_per_s']:.1f}",
                      f"{t['static']['useful_tokens_per_s']:.1f}",
                      f"{t['speedup_vs_static']:.2f}",
                      f"{t['continuous']['stats']['slot_utilization']:.2f}/"
                      f"{t['static']['stats']['slot_utilization']:.2f}",
                      f"{t['continuous']['stats']['prefill_calls']}/"
                      f"{t['static']['stats']['prefill_calls']}"]
        else:
            cells += ["error" if t else "-"] + ["-"] * 4
        print(" | ".join(f"{c:>15}" for c in cells))
        for mode in [m for m in t if m in TAIL_MODES]:
            m, st = t[mode], t[mode]["stats"]
            print(f"    tail {mode}: {m['useful_tokens_per_s']:.1f} tok/s, x static "
                  f"{m['useful_tokens_per_s'] / t['static']['useful_tokens_per_s']:.2f}, "
                  f"{st['decode_rows']:.1f} rows a step, {st['decode_steps']} steps, "
                  f"{st['preemptions']} preemptions ({st['resumed']} resumed); "
                  f"decode {st['decode_seconds']:.3f} s = "
                  f"{100 * m['decode_fraction_of_limit']:.1f}% of its read limit "
                  f"({m['decode_read_ideal_gb']:.3g} GB); prefill {st['prefill_seconds']:.3f} s "
                  f"at {m['prefill_tflop_s']:.3g} TFLOP/s; outside calls "
                  f"{st['seconds'] - st['decode_seconds'] - st['prefill_seconds']:.3f} s")
    print("decode tok/s = generated / time in decode calls (fixed lengths, no stop); limit = B x "
          "copy bandwidth / (params + K/V at the live length); tail = long-tailed length "
          "schedule, useful tok/s = generated / generate() wall time, continuous vs static "
          "batching; util = slot utilization; prefills = prefill calls, continuous / static; "
          "a tail run's read limit = (params x decode steps + K/V of each response token's "
          "cached length) / copy bandwidth")


def write_results(args, results):
    """timing.write_json's record (device, date, command, args) with the rows."""
    timing.write_json(args.output, {"jax": jax.__version__, "host": platform.node(),
                                    "results": results}, args=args)


if __name__ == "__main__":
    main()
