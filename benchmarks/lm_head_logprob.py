"""LM-head log-prob: fused (Pallas) vs chunked jnp vs naive full logits; time and memory.

For each implementation, forward (log p and entropy) and forward+backward (grad of a weighted sum
of both outputs w.r.t. h and W) are timed (warm-up, block_until_ready, median of --iters runs);
memory is XLA's static analysis of each compiled program on the backend it runs on (temporaries +
arguments + outputs - aliased; printed per program and in the table).
Default shape: N=8192 tokens, H=2048, V=151936, bf16 (GPU). On CPU use small shapes; the Pallas
kernel then runs in interpret mode (correctness only, not speed):

    python benchmarks/lm_head_logprob.py --tokens 256 --hidden 128 --vocab 4096 --iters 3
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from delta_jax.kernels import backend, timing
from delta_jax.kernels.lm_head_logprob import lm_head_logprob, lm_head_logprob_reference


def naive_logprob(h, w, labels, temperature):
    """Full [N, V] fp32 logits."""
    z = jnp.dot(h, w, preferred_element_type=jnp.float32) / temperature
    logq = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logq, labels[:, None], axis=1)[:, 0]
    return logp, -jnp.sum(jnp.exp(logq) * logq, axis=-1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-size", type=int, default=8192, help="vocab chunk of the jnp version")
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--block-vocab", type=int, default=128)
    parser.add_argument("--block-hidden", type=int, default=64)
    parser.add_argument("--num-splits", type=int, default=None)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=3)
    parser.add_argument("--impls", default="naive,chunked,pallas")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/lm_head_logprob.json")
    args = parser.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (args.tokens, args.hidden), dtype)
    w = (jax.random.normal(k[1], (args.hidden, args.vocab), jnp.float32)
         / args.hidden ** 0.5).astype(dtype)
    labels = jax.random.randint(k[2], (args.tokens,), 0, args.vocab)
    cot = jax.random.normal(k[3], (2, args.tokens))
    interpret = not backend.on_gpu()
    temperature = args.temperature

    impls = {
        "naive": lambda h, w, y: naive_logprob(h, w, y, temperature),
        "chunked": lambda h, w, y: lm_head_logprob_reference(h, w, y, temperature,
                                                             chunk_size=args.chunk_size),
        "pallas": lambda h, w, y: lm_head_logprob(
            h, w, y, temperature, block_tokens=args.block_tokens, block_vocab=args.block_vocab,
            block_hidden=args.block_hidden, num_splits=args.num_splits, num_warps=args.num_warps,
            num_stages=args.num_stages, backward_chunk_size=args.chunk_size, interpret=interpret),
    }
    results = []
    for name in args.impls.split(","):
        fn = impls[name]
        label = name + (" (interpret)" if name == "pallas" and interpret else "")

        def loss(h, w, fn=fn):
            logp, ent = fn(h, w, labels)
            return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent)

        programs = {
            "forward": (jax.jit(lambda h, w, fn=fn: fn(h, w, labels))),
            "forward+backward": jax.jit(jax.grad(loss, argnums=(0, 1))),
        }
        for mode, jitted in programs.items():
            seconds, runs = timing.median_seconds(jitted, h, w, warmup=args.warmup, iters=args.iters)
            memory = timing.print_compiled_memory(f"{label} {mode}", jitted, h, w)
            results.append({"impl": label, "mode": mode, "median_s": seconds, "runs_s": runs,
                            **memory})

    timing.print_table(
        f"LM-head log-prob on {timing.device_description()}: N={args.tokens} H={args.hidden} "
        f"V={args.vocab} dtype={args.dtype}",
        [("impl", "impl", "22s"), ("mode", "mode", "17s"),
         ("median ms", lambda r: 1e3 * r["median_s"], "10.3f"),
         ("temp MiB", lambda r: r.get("temp_bytes", 0) / 2**20, "10.1f"),
         ("peak est MiB", lambda r: r.get("peak_estimate_bytes", 0) / 2**20, "13.1f")],
        results)
    timing.write_json(args.out, {"results": results}, args=args)

if __name__ == "__main__":
    main()
