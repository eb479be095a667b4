"""Decode throughput of delta_jax.sampling.Sampler next to its memory-bandwidth limit and to
transformers' PyTorch generate on the same device.

    # On an accelerator (the reference configuration; both attention paths):
    python benchmarks/decode_throughput.py --preset qwen3-0.6b --dtype bfloat16 \
        --batch 64 256 --prompt-len 512 --new-tokens 1024 --decode-attention live full \
        --output decode_throughput.json
    # A quick CPU smoke run:
    python benchmarks/decode_throughput.py --preset tiny --batch 4 --prompt-len 32 \
        --new-tokens 32 --dtype float32 --hf always --repeats 1 --copy-mib 64
    # The CPU recording (Qwen3-0.6B shape, reduced batch/lengths; ~3-4 min on an idle 2-core
    # machine). float32: XLA:CPU has no fast bf16 matmuls, so bf16 would time the emulation.
    # With 64 + 32 cache slots (< one 256-slot key block) "live" and "full" read the same bytes.
    python benchmarks/decode_throughput.py --preset qwen3-0.6b --dtype float32 --batch 4 16 \
        --prompt-len 64 --new-tokens 32 --hf always --repeats 2 --copy-mib 512 \
        --output decode_throughput_cpu.json

Per batch size and decode attention path it reports:
* decode tokens/s of the sampler: B * (new_tokens - 1) / decode-loop time (the tokens produced
  by decode forward passes; the first token comes from the prefill's logits). Prefill is timed
  separately, compile is excluded, and no stop token is set, so every sequence generates exactly
  --new-tokens tokens. Paths (--decode-attention): "live" = the default model, whose decode
  attention reads only the cache blocks below the live length (attention.attend_live_prefix);
  "full" = the same weights with attention="xla" for decode, which attends the whole bucketed
  cache (prompt slots + response slots) every step. Both decode from the same prefill.
* bytes read per decode step: parameters (every matmul weight once; the embedding table counted
  once, as the LM head, since the token gather reads B rows) + the K and V cache. The ideal cache
  read is at the live length (prompt_len + s at decode step s, averaged over the steps); each
  path's own read is reported next to it (live: rounded up to whole key blocks; full: every slot).
* the bandwidth limit: B / (ideal bytes per step / copy bandwidth). The copy bandwidth is
  measured in the same run (a jitted device-to-device copy: bytes read + bytes written / time).
  "% limit" = measured / limit. Logits, activations and sampling traffic are not counted.
* transformers generate (greedy or the same sampling settings, same model shape and dtype, random
  weights, sdpa, --hf-cache dynamic or static) on the same device when torch has CUDA (or with
  --hf always, e.g. on CPU); skipped otherwise. It runs first, one child process per batch size,
  before JAX takes the device, so each framework has the whole GPU memory in turn; a failure
  (e.g. out of memory) is reported in the table and the JSON, and the run goes on. Its decode
  time = a full generate minus a 1-new-token generate (the prefill), each the best of --repeats;
  both totals are reported too.
  "x HF" compares decode tokens/s with decode tokens/s.
Results are printed as a table and written as JSON (--output).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax import models
from delta_jax.models import attention
from delta_jax.sampling import Sampler, _decode, _prefill, bucket_size, left_pad
from delta_jax.sampling_utils import SamplingParams

PATHS = ("live", "full")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-0.6b", help="models.get_preset name")
    p.add_argument("--dtype", default="bfloat16", help="parameter and activation dtype")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--decode-attention", nargs="+", choices=PATHS, default=["live"],
                   help="live: read only the live cache prefix (the default model); full: "
                        "attend the whole cache every step (attention='xla'), for comparison")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch (best is kept)")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy-bandwidth probe")
    p.add_argument("--hf", choices=["auto", "always", "never"], default="auto",
                   help="transformers baseline: auto = only when torch has CUDA")
    p.add_argument("--hf-cache", choices=["dynamic", "static"], default="dynamic",
                   help="transformers' KV cache (generate's cache_implementation)")
    p.add_argument("--output", default="decode_throughput.json")
    p.add_argument("--hf-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.new_tokens < 2 or args.prompt_len < 1 or min(args.batch) < 1:
        p.error("--new-tokens must be >= 2, --prompt-len and --batch >= 1")
    return args


def copy_bandwidth(num_mib: int, repeats: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), best of `repeats`."""
    n = num_mib * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # one read + one write of every element
    copy(x).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best


def param_bytes(cfg: models.ModelConfig) -> int:
    """Bytes of parameters read per decode step: every matmul weight once; of the embedding
    table and the LM head only the LM head (the token gather reads B rows)."""
    untied_embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (cfg.num_params() - untied_embedding) * jnp.dtype(cfg.param_dtype).itemsize


def cache_bytes(cfg: models.ModelConfig, batch: int, length: float) -> float:
    """Bytes of K and V for `batch` sequences of `length` cached tokens."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    return batch * length * per_token * jnp.dtype(cfg.dtype).itemsize


def cache_slots_read(cfg: models.ModelConfig, path: str, prompt_len: int, prompt_slots: int,
                     new_tokens: int, cache_slots: int) -> dict:
    """Mean cache slots per row read by one decode step (steps s = 1 .. new_tokens - 1 write
    slot prompt_slots + s - 1): the ideal (live length, unpadded prompt) and this path's."""
    steps = np.arange(1, new_tokens)
    ideal = float(np.mean(prompt_len + steps))
    if path == "full":
        actual = float(cache_slots)
    else:
        block = min(cfg.attention_block_kv, attention.DECODE_BLOCK_KV, cache_slots)
        live = prompt_slots + steps
        actual = float(np.mean(np.minimum(-(-live // block) * block, cache_slots)))
    return {"ideal": ideal, "actual": actual}


def graphdef_for(model, path: str):
    """The model's graphdef whose decode attention is the given path (same parameter tree)."""
    if path == "live":
        return nnx.graphdef(model)
    cfg = model.cfg
    model.cfg = cfg.replace(attention="xla")
    try:
        return nnx.graphdef(model)
    finally:
        model.cfg = cfg


def time_sampler(sampler: Sampler, decode_graphdefs: dict, batch: int, args) -> dict:
    """Prefill and decode timings (per decode path) for one batch of random prompts; every
    path decodes from the same prefill; compile excluded (a first untimed run)."""
    cfg = sampler.cfg
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, size=(batch, args.prompt_len)).tolist()
    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    prompt_slots = bucket_size(args.prompt_len, sampler.min_prompt_bucket)
    response_slots = bucket_size(args.new_tokens, sampler.min_response_bucket)
    ids, mask = left_pad(prompts, prompt_slots, sampler.pad_id)
    ids, mask = sampler._put(ids), sampler._put(mask)
    rows = np.arange(batch, dtype=np.int32)
    stop_ids = jnp.asarray(sampler._stop_ids(()))
    paths = list(decode_graphdefs)

    def decode(graphdef, cache, logits, kv_mask, next_pos):
        start = time.perf_counter()
        out = _decode(graphdef, sampler.state, cache, logits, kv_mask, next_pos,
                      jnp.ones(batch, bool), jnp.asarray(rows), jnp.zeros(batch, jnp.int32),
                      np.uint32(0), stop_ids, np.float32(args.temperature),
                      np.float32(args.top_p), np.int32(args.new_tokens),
                      np.int32(sampler.pad_id), top_k=params.effective_top_k(cfg.vocab_size),
                      use_top_p=params.use_top_p, greedy=params.greedy,
                      response_slots=response_slots, batch_spec=sampler._batch_spec)
        lengths = np.asarray(out[3])
        seconds = time.perf_counter() - start
        tokens = np.asarray(out[0])
        del out
        return seconds, int(lengths.sum()), tokens

    def run():
        prefill_s, decodes = math.inf, {}
        for path in paths:
            # A fresh prefill per path (the cache is donated to decode): one cache alive at a
            # time, where a copy per path would double the largest buffer (45 GB of bf16 K/V at
            # batch 256 x 1536 slots for Qwen3-0.6B). The prefill is deterministic.
            start = time.perf_counter()
            cache, logits, kv_mask, next_pos = _prefill(
                sampler.graphdef, sampler.state, ids, mask, num_copies=1,
                response_slots=response_slots, batch_spec=sampler._batch_spec)
            jax.block_until_ready(logits)
            prefill_s = min(prefill_s, time.perf_counter() - start)
            decodes[path] = decode(decode_graphdefs[path], cache, logits, kv_mask, next_pos)
            del cache
        return prefill_s, decodes

    start = time.perf_counter()
    _, first = run()  # compile the programs
    compile_s = time.perf_counter() - start
    timings = [run() for _ in range(args.repeats)]
    out = {"compile_and_first_run_s": compile_s,
           "prefill_s": min(t[0] for t in timings),
           "prompt_slots": prompt_slots, "cache_slots": prompt_slots + response_slots}
    out["prefill_tokens_per_s"] = batch * args.prompt_len / out["prefill_s"]
    for path in paths:
        decode_s = min(t[1][path][0] for t in timings)
        tokens = first[path][1]
        if tokens != batch * args.new_tokens:
            raise RuntimeError(f"{path}: generated {tokens} tokens, expected "
                               f"{batch * args.new_tokens} (no stop token is set)")
        out[path] = {"decode_s": decode_s, "decode_tokens": batch * (args.new_tokens - 1),
                     "decode_tokens_per_s": batch * (args.new_tokens - 1) / decode_s}
    if len(paths) == 2 and args.temperature == 0:  # greedy: both paths should agree
        out["paths_same_tokens"] = bool(np.array_equal(first["live"][2], first["full"][2]))
    return out


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


def main(argv=None):
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
    if args.hf != "never":
        for batch in args.batch:
            print(f"transformers generate (--hf {args.hf}): batch {batch}", flush=True)
            hf_results[batch] = time_transformers_in_subprocess(batch, argv)
            if not hf_results[batch]:  # no torch, or --hf auto without CUDA: none for any batch
                break

    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    decode_graphdefs = {path: graphdef_for(model, path) for path in args.decode_attention}
    bandwidth = copy_bandwidth(args.copy_mib)
    device = jax.devices()[0]

    results = []
    for batch in args.batch:
        sampler = Sampler(model, max_batch_size=batch)
        row = {"preset": args.preset, "dtype": args.dtype, "batch": batch,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "device": f"{device.platform}:{device.device_kind}",
               "copy_bandwidth_gb_s": bandwidth / 1e9, "param_gb": param_bytes(cfg) / 1e9}
        row.update(time_sampler(sampler, decode_graphdefs, batch, args))
        for path in args.decode_attention:
            slots = cache_slots_read(cfg, path, args.prompt_len, row["prompt_slots"],
                                     args.new_tokens, row["cache_slots"])
            ideal_bytes = param_bytes(cfg) + cache_bytes(cfg, batch, slots["ideal"])
            path_bytes = param_bytes(cfg) + cache_bytes(cfg, batch, slots["actual"])
            r = row[path]
            r.update({
                "cache_read_ideal_gb": cache_bytes(cfg, batch, slots["ideal"]) / 1e9,
                "cache_read_actual_gb": cache_bytes(cfg, batch, slots["actual"]) / 1e9,
                "step_read_ideal_gb": ideal_bytes / 1e9,
                "step_read_actual_gb": path_bytes / 1e9,
                "bandwidth_limit_tokens_per_s": batch * bandwidth / ideal_bytes,
                "path_bandwidth_limit_tokens_per_s": batch * bandwidth / path_bytes,
            })
            r["fraction_of_limit"] = r["decode_tokens_per_s"] / r["bandwidth_limit_tokens_per_s"]
        row.update(hf_results.get(batch, {}))
        if "hf_decode_tokens_per_s" in row:
            for path in args.decode_attention:
                row[path]["speedup_vs_hf"] = (row[path]["decode_tokens_per_s"]
                                              / row["hf_decode_tokens_per_s"])
        results.append(row)
        write_results(args, results)  # after every batch: a later failure keeps these
        del sampler

    header = ["batch", "path", "decode tok/s", "limit tok/s", "% limit", "read GB/step",
              "ideal GB/step", "prefill s", "HF tok/s", "x HF", "copy GB/s"]
    print(" | ".join(f"{h:>13}" for h in header))
    for r in results:
        for path in args.decode_attention:
            p = r[path]
            hf = "hf_decode_tokens_per_s" in r
            hf_cell = "error" if "hf_error" in r else "skip"
            cells = [r["batch"], path, f"{p['decode_tokens_per_s']:.1f}",
                     f"{p['bandwidth_limit_tokens_per_s']:.1f}",
                     f"{100 * p['fraction_of_limit']:.1f}", f"{p['step_read_actual_gb']:.4g}",
                     f"{p['step_read_ideal_gb']:.4g}", f"{r['prefill_s']:.3f}",
                     f"{r['hf_decode_tokens_per_s']:.1f}" if hf else hf_cell,
                     f"{p['speedup_vs_hf']:.2f}" if hf else "-",
                     f"{r['copy_bandwidth_gb_s']:.1f}"]
            print(" | ".join(f"{c:>13}" for c in cells))
    print("decode tok/s = B * (new_tokens - 1) / decode time (prefill excluded); HF: the same "
          "over (generate total - 1-token generate); limit = B * copy bandwidth / ideal bytes "
          "per step (params + K/V at the live length)")
    print(f"wrote {args.output}")


def write_results(args, results):
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "jax": jax.__version__, "host": platform.node(),
                   "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
