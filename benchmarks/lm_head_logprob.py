"""LM-head log-prob: the trainer's two paths (fused vocabulary tiles, chunked sequence
positions) vs naive full logits; time and memory.

Each implementation is the function the trainer runs for model.logprob_impl (models.token_logprobs
on hidden states [rows, N / rows, H] under a budget of --chunk-tokens tokens), plus the naive
[N, V] logits for scale. Forward (log p and entropy) and forward+backward (grad of a weighted sum
of both outputs w.r.t. h and W) are timed (warm-up, then the median of --iters samples, each
--calls calls dispatched back to back and waited for once, divided by the calls:
kernels.timing.median_seconds, so that the ~50-150 us of GPU dispatch + sync latency of a call
waited for is not timed with each call; --calls 0, the default, picks them per program for a
sample of ~20 ms, calls_per_sample in the JSON);
memory is XLA's static analysis of each compiled program on the backend it runs on (temporaries +
arguments + outputs - aliased; printed per program and in the table).
Default shape: N=8192 tokens (16 rows x 512), H=2048, V=151936, bf16 (GPU). On CPU:

    python benchmarks/lm_head_logprob.py --tokens 256 --rows 4 --hidden 128 --vocab 4096 --iters 3

(The Pallas forward kernel this script used to time was retired: kernels/lm_head_logprob.py.)
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from delta_jax import models
from delta_jax.kernels import timing


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
    parser.add_argument("--rows", type=int, default=16, help="sequences the N tokens form")
    parser.add_argument("--chunk-tokens", type=int, default=4096,
                        help="token budget of both paths (model.logprob_chunk_tokens)")
    parser.add_argument("--impls", default="naive,chunked,fused")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--calls", type=int, default=0,
                        help="calls per timed sample (0: enough for ~20 ms, kernels.timing)")
    parser.add_argument("--out", default="benchmarks/results/lm_head_logprob.json")
    args = parser.parse_args(argv)
    if args.tokens % args.rows:
        parser.error(f"--tokens {args.tokens} must be a multiple of --rows {args.rows}")
    if args.calls < 0:
        parser.error("--calls must be >= 0 (0: automatic)")

    dtype = jnp.dtype(args.dtype)
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (args.tokens, args.hidden), dtype)
    w = (jax.random.normal(k[1], (args.hidden, args.vocab), jnp.float32)
         / args.hidden ** 0.5).astype(dtype)
    labels = jax.random.randint(k[2], (args.tokens,), 0, args.vocab)
    cot = jax.random.normal(k[3], (2, args.tokens))
    temperature = args.temperature

    def trainer_path(impl):
        def fn(h, w, y):
            logp, ent = models.token_logprobs(w, h.reshape(args.rows, -1, args.hidden),
                                              y.reshape(args.rows, -1), temperature,
                                              chunk_size=args.chunk_tokens, impl=impl)
            return logp.reshape(-1), ent.reshape(-1)
        return fn

    impls = {"naive": lambda h, w, y: naive_logprob(h, w, y, temperature),
             "chunked": trainer_path("chunked"), "fused": trainer_path("fused")}
    results = []
    for name in args.impls.split(","):
        if name not in impls:
            parser.error(f"--impls: unknown {name!r}; expected some of {sorted(impls)}")
        fn = impls[name]
        label = name

        def loss(h, w, fn=fn):
            logp, ent = fn(h, w, labels)
            return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent)

        programs = {
            "forward": (jax.jit(lambda h, w, fn=fn: fn(h, w, labels))),
            "forward+backward": jax.jit(jax.grad(loss, argnums=(0, 1))),
        }
        for mode, jitted in programs.items():
            calls = args.calls or timing.calls_per_sample(jitted, h, w)
            seconds, runs = timing.median_seconds(jitted, h, w, warmup=args.warmup,
                                                  iters=args.iters, calls=calls)
            memory = timing.print_compiled_memory(f"{label} {mode}", jitted, h, w)
            results.append({"impl": label, "mode": mode, "median_s": seconds, "runs_s": runs,
                            "calls_per_sample": calls, **memory})

    timing.print_table(
        f"LM-head log-prob on {timing.device_description()}: N={args.tokens} H={args.hidden} "
        f"V={args.vocab} dtype={args.dtype}",
        [("impl", "impl", "22s"), ("mode", "mode", "17s"),
         ("median ms", lambda r: 1e3 * r["median_s"], "10.3f"),
         ("calls", "calls_per_sample", "6d"),
         ("temp MiB", lambda r: r.get("temp_bytes", 0) / 2**20, "10.1f"),
         ("peak est MiB", lambda r: r.get("peak_estimate_bytes", 0) / 2**20, "13.1f")],
        results)
    timing.write_json(args.out, {"results": results}, args=args)

if __name__ == "__main__":
    main()
