"""Decode throughput of delta_jax.sampling.Sampler next to its memory-bandwidth limit and to
transformers' PyTorch generate on the same device.

    # On an accelerator (the reference configuration):
    python benchmarks/decode_throughput.py --preset qwen3-0.6b --dtype bfloat16 \
        --batch 64 256 --prompt-len 512 --new-tokens 1024 --output decode_throughput.json
    # A quick CPU run:
    python benchmarks/decode_throughput.py --preset tiny --batch 4 --prompt-len 32 --new-tokens 32

Per batch size it reports:
* decode tokens/s of the sampler (decode loop only, prefill timed separately, compile excluded;
  no stop tokens, so every sequence generates exactly --new-tokens tokens);
* the bandwidth limit: B / (bytes read per decode step / copy bandwidth), where bytes per step =
  the parameters (the embedding table counted once, as the LM head; the token gather is tiny) +
  the K and V cache at the mean cache length prompt_len + new_tokens / 2. The copy bandwidth is
  measured in the same run (a jitted device-to-device copy: bytes read + bytes written / time);
  "ideal %" = measured / limit. The sampler's attention reads the whole bucketed cache each step,
  so its own bytes per step (reported as cache_read_actual_gb) are higher than the ideal;
* transformers generate (greedy, static shapes, same model shape, random weights, sdpa) on the
  same device when torch has CUDA (or with --hf always on CPU); skipped otherwise.
Results are printed as a table and written as JSON (--output).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax import models
from delta_jax.sampling import Sampler, _decode, _prefill, bucket_size, left_pad
from delta_jax.sampling_utils import SamplingParams


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
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch (best is kept)")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy-bandwidth probe")
    p.add_argument("--hf", choices=["auto", "always", "never"], default="auto",
                   help="transformers baseline: auto = only when torch has CUDA")
    p.add_argument("--output", default="decode_throughput.json")
    return p.parse_args(argv)


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
    """Bytes of parameters read per decode step (every matmul weight once)."""
    return cfg.num_params() * jnp.dtype(cfg.param_dtype).itemsize


def cache_bytes(cfg: models.ModelConfig, batch: int, length: float) -> float:
    """Bytes of K and V for `batch` sequences of `length` cached tokens."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    return batch * length * per_token * jnp.dtype(cfg.dtype).itemsize


def time_sampler(sampler: Sampler, batch: int, args) -> dict:
    """Prefill and decode timings for one batch of random prompts (compile excluded)."""
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

    def run():
        start = time.perf_counter()
        cache, logits, kv_mask, next_pos = _prefill(
            sampler.graphdef, sampler.state, ids, mask, num_copies=1,
            response_slots=response_slots, batch_spec=sampler._batch_spec)
        jax.block_until_ready(logits)
        mid = time.perf_counter()
        out = _decode(sampler.graphdef, sampler.state, cache, logits, kv_mask, next_pos,
                      jnp.ones(batch, bool), jnp.asarray(rows), jnp.zeros(batch, jnp.int32),
                      np.uint32(0), stop_ids, np.float32(args.temperature),
                      np.float32(args.top_p), np.int32(args.new_tokens),
                      np.int32(sampler.pad_id), top_k=params.effective_top_k(cfg.vocab_size),
                      use_top_p=params.use_top_p, greedy=params.greedy,
                      response_slots=response_slots, batch_spec=sampler._batch_spec)
        lengths = np.asarray(out[3])
        end = time.perf_counter()
        del out
        return mid - start, end - mid, int(lengths.sum())

    start = time.perf_counter()
    run()  # compile both programs
    compile_s = time.perf_counter() - start
    timings = [run() for _ in range(args.repeats)]
    prefill_s = min(t[0] for t in timings)
    decode_s, tokens = min((t[1], t[2]) for t in timings)
    return {
        "compile_and_first_run_s": compile_s,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": batch * args.prompt_len / prefill_s,
        "decode_s": decode_s,
        "decode_tokens": tokens,
        "decode_tokens_per_s": tokens / decode_s,
        "cache_slots": prompt_slots + response_slots,
    }


def time_transformers(cfg: models.ModelConfig, batch: int, args, device: str) -> dict:
    import torch
    import transformers

    hf_cfg = models.hf_config_dict(cfg)
    config = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype, torch.float32)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                           attn_implementation="sdpa").eval()
    ids = torch.randint(1, cfg.vocab_size, (batch, args.prompt_len), device=device)
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                  do_sample=args.temperature > 0, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids))
    if args.temperature > 0:
        kwargs.update(temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k if args.top_k > 0 else None)

    def run(new_tokens):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, **{**kwargs, "max_new_tokens": new_tokens,
                                      "min_new_tokens": new_tokens})
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out.shape[1] - args.prompt_len

    run(2)  # warm-up
    # Decode time = full generate - a 1-token generate (which is the prefill).
    prefill_s = min(run(1)[0] for _ in range(args.repeats))
    total_s, new = min(run(args.new_tokens) for _ in range(args.repeats))
    decode_s = max(total_s - prefill_s, 1e-9)
    return {"hf_prefill_s": prefill_s, "hf_decode_s": decode_s,
            "hf_decode_tokens_per_s": batch * (new - 1) / decode_s}


def main(argv=None):
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    cfg = models.get_preset(args.preset, dtype=dtype, param_dtype=dtype)
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings,
                                                  args.prompt_len + args.new_tokens))
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    bandwidth = copy_bandwidth(args.copy_mib)
    device = jax.devices()[0]

    hf_device = None
    if args.hf != "never":
        try:
            import torch
            if torch.cuda.is_available():
                hf_device = "cuda"
            elif args.hf == "always":
                hf_device = "cpu"
        except ImportError:
            hf_device = None

    results = []
    for batch in args.batch:
        sampler = Sampler(model, max_batch_size=batch)
        row = {"preset": args.preset, "dtype": args.dtype, "batch": batch,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "device": f"{device.platform}:{device.device_kind}",
               "copy_bandwidth_gb_s": bandwidth / 1e9}
        row.update(time_sampler(sampler, batch, args))
        mean_len = args.prompt_len + args.new_tokens / 2
        step_bytes = param_bytes(cfg) + cache_bytes(cfg, batch, mean_len)
        row.update({
            "param_gb": param_bytes(cfg) / 1e9,
            "cache_read_mean_gb": cache_bytes(cfg, batch, mean_len) / 1e9,
            "cache_read_actual_gb": cache_bytes(cfg, batch, row["cache_slots"]) / 1e9,
            "bandwidth_limit_tokens_per_s": batch * bandwidth / step_bytes,
        })
        row["fraction_of_limit"] = row["decode_tokens_per_s"] / row["bandwidth_limit_tokens_per_s"]
        if hf_device is not None:
            row["hf_device"] = hf_device
            row.update(time_transformers(cfg, batch, args, hf_device))
        results.append(row)
        del sampler

    header = ["batch", "decode tok/s", "limit tok/s", "% limit", "prefill s", "HF tok/s",
              "copy GB/s"]
    print(" | ".join(f"{h:>12}" for h in header))
    for r in results:
        cells = [r["batch"], f"{r['decode_tokens_per_s']:.1f}",
                 f"{r['bandwidth_limit_tokens_per_s']:.1f}", f"{100 * r['fraction_of_limit']:.1f}",
                 f"{r['prefill_s']:.3f}",
                 f"{r['hf_decode_tokens_per_s']:.1f}" if "hf_decode_tokens_per_s" in r else "skip",
                 f"{r['copy_bandwidth_gb_s']:.1f}"]
        print(" | ".join(f"{c:>12}" for c in cells))
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "jax": jax.__version__, "host": platform.node(),
                   "results": results}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
