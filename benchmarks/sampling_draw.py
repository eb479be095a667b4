"""The rollout's sampling draw alone, one token a row from softmax(values) over a vocabulary:
the sampler's inverse CDF (delta_jax.sampling_utils.categorical) against jax.random.categorical's
Gumbel arg-max (the sampler's draw until 2026-11-27), at the rows of a decode step (issue #15).

    # GPU (the Qwen3 vocabulary, the rows of a batch-64 / 256 decode step):
    python benchmarks/sampling_draw.py
    # CPU smoke run:
    python benchmarks/sampling_draw.py --rows 4 --vocab 1000 --iters 2

Why: on an H200 (2026-11-26, BENCHMARKS.md "Seventh GPU run") the Gumbel draw was one fusion of
65 us in a 2.8 ms batch-64 decode step: it hashes a random number for each of the 151,936
candidates of every row, where the inverse CDF draws three uniforms a row and reads the values
twice. Both run on float32 values [rows, vocab] (the tempered logits) with one PRNG key a row,
as sampling_utils.sample_tokens calls them, and return the drawn tokens with their log-probs
(since 2026-11-27: the inverse CDF's normaliser comes from its slab masses, the Gumbel draw's
from a logsumexp; the H200 figures of that day's eighth GPU run are of the tokens alone).
Timing: kernels.timing.median_seconds (calls back to back, waited for once) and, where the
profiler trace has device events (a GPU), the device time per call (--trace-calls calls under
jax.profiler.trace): a draw of tens of microseconds is dispatch-bound in wall time. Each draw's
tokens are checked to be in range; the two draws differ (other random streams, the same
distribution: tests/test_sampling_filters.py).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from delta_jax import sampling_utils
from delta_jax.kernels import timing


def gumbel(keys, values):
    """The sampler's draw until 2026-11-27: the token by a Gumbel arg-max, its log-prob by a
    logsumexp over the row."""
    tokens = jax.vmap(jax.random.categorical)(keys, values)
    chosen = jnp.take_along_axis(values, tokens[:, None], axis=1)[:, 0]
    return tokens, chosen - jax.nn.logsumexp(values, axis=-1)


DRAWS = {"inverse_cdf": sampling_utils.categorical, "gumbel": gumbel}   # (tokens, log-probs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--vocab", type=int, default=151936, help="151,936: the Qwen3 vocabulary")
    p.add_argument("--draws", nargs="+", default=list(DRAWS), choices=list(DRAWS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--trace-calls", type=int, default=50,
                   help="calls run under the profiler for the device time (0: none)")
    p.add_argument("--trace-dir", default="/tmp/sampling_draw_trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/sampling_draw.json")
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.vocab < 1:
        p.error("--rows and --vocab must be >= 1")
    if args.trace_calls < 0:
        p.error("--trace-calls must be >= 0 (0: no profiler trace)")
    return args


def main(argv=None):
    args = parse_args(argv)
    print(f"{timing.device_description()} | vocabulary {args.vocab}", flush=True)
    results = []
    for rows in args.rows:
        key = jax.random.fold_in(jax.random.key(args.seed), rows)
        values = 3.0 * jax.random.normal(key, (rows, args.vocab), jnp.float32)
        keys = jax.random.split(jax.random.fold_in(key, 1), rows)
        for name in args.draws:
            program = jax.jit(DRAWS[name]).lower(keys, values).compile()
            tokens, _ = jax.block_until_ready(program(keys, values))
            seconds, _ = timing.median_seconds(program, keys, values, warmup=args.warmup,
                                               iters=args.iters, calls=None)
            device_s = None
            if args.trace_calls:
                device_s = timing.device_seconds_per_call(
                    f"{args.trace_dir}/{name}_r{rows}", program, (keys, values), args.trace_calls)
            results.append({
                "draw": name, "rows": rows, "vocab": args.vocab, "us": seconds * 1e6,
                "device_us": None if device_s is None else device_s * 1e6,
                "tokens_in_range": bool(jnp.all((tokens >= 0) & (tokens < args.vocab))),
                "compiled_memory": timing.compiled_memory_bytes(program)})
            r = results[-1]
            print(f"  {name:12s} rows {rows:4d}: wall {r['us']:9.1f} us  device "
                  + ("n/a" if device_s is None else f"{r['device_us']:9.1f} us")
                  + f"  tokens in range {r['tokens_in_range']}", flush=True)
    timing.print_table(
        "sampling draw, one token a row (device time where traced)",
        [("draw", "draw", "12s"), ("rows", "rows", "6d"), ("wall us", "us", "10.1f"),
         ("device us", "device_us", "10.1f")], results)
    timing.write_json(args.out, {"vocab": args.vocab, "results": results}, args=args)
    return results


if __name__ == "__main__":
    main()
