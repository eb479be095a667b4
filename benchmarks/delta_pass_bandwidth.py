"""DelTA pass bandwidth: the fused pass (kernels.delta_pass, XLA) vs a device copy.

Effective bandwidth = the fewest bytes the pass must move (h read once, p/a/mask read, lambda
written when asked) / median time. The device copy (y = -h: read + write) measured in the same run
is the practical ceiling. Time per call: the median of --iters samples, each --calls calls
dispatched back to back and waited for once, divided by the calls (kernels.timing.median_seconds;
one call of a few ms waited for alone also times ~50-150 us of GPU dispatch + sync latency);
--calls 0 (the default) picks them per case for a sample of ~20 ms (calls_per_sample in the
JSON). Each case also prints XLA's memory analysis of its compiled program on the backend it runs
on. Default shape: 1M tokens x hidden 4096, bf16 (GPU). On CPU use a smaller
shape:

    python benchmarks/delta_pass_bandwidth.py --tokens 65536 --hidden 4096 --iters 3

(The Pallas version this script used to time beside it was retired: kernels/delta_pass.py.)
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from delta_jax.kernels import timing
from delta_jax.kernels.delta_pass import delta_pass


def make_inputs(tokens, hidden, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (tokens, hidden), dtype)
    p = jax.random.uniform(k[1], (tokens,))
    a = jax.random.choice(k[2], jnp.array([1.0, -1.0, 0.5, -0.5, 0.0]), (tokens,))
    mask = (jax.random.uniform(k[3], (tokens,)) > 0.1).astype(jnp.float32)
    mu = 0.05 * jax.random.normal(k[4], (2, hidden))
    return h, p, a, mask, mu[0], mu[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--calls", type=int, default=0,
                        help="calls per timed sample (0: enough for ~20 ms, kernels.timing)")
    parser.add_argument("--kinds", nargs="+", choices=["copy", "xla"], default=["copy", "xla"],
                        help="which cases to time")
    parser.add_argument("--out", default="benchmarks/results/delta_pass_bandwidth.json")
    args = parser.parse_args(argv)
    if args.calls < 0:
        parser.error("--calls must be >= 0 (0: automatic)")

    dtype = jnp.dtype(args.dtype)
    h, p, a, mask, mu_pos, mu_neg = make_inputs(args.tokens, args.hidden, dtype)
    gammas = (jnp.float32(1.0), jnp.float32(1.0))
    feature_bytes = args.tokens * args.hidden * dtype.itemsize
    token_bytes = 3 * 4 * args.tokens  # p, a, mask in fp32

    cases = {
        # name: (function, bytes it must move)
        "device copy (y = -h)": (jax.jit(lambda h: -h), 2 * feature_bytes),
    }
    final = dict(lam_range=(0.8, 1.2), with_centroids=False)
    for label, extra in (("refine", {}), ("final lambda", final)):
        lam_bytes = 4 * args.tokens if "lam_range" in extra else 0
        cases[f"xla {label}"] = (
            jax.jit(lambda *x, e=extra: delta_pass(*x, **e)),
            feature_bytes + token_bytes + lam_bytes)

    kind_of = lambda name: name.split()[0].replace("device", "copy")  # noqa: E731
    cases = {name: case for name, case in cases.items() if kind_of(name) in args.kinds}
    results = []
    for name, (fn, nbytes) in cases.items():
        call_args = (h,) if name.startswith("device copy") else (h, p, a, mask, mu_pos, mu_neg, *gammas)
        calls = args.calls or timing.calls_per_sample(fn, *call_args)
        seconds, runs = timing.median_seconds(fn, *call_args, warmup=args.warmup, iters=args.iters,
                                              calls=calls)
        memory = timing.print_compiled_memory(name, fn, *call_args)
        results.append({"case": name, "median_s": seconds, "runs_s": runs, "bytes": nbytes,
                        "calls_per_sample": calls, "effective_GBps": nbytes / seconds / 1e9,
                        "compiled_memory": memory})
    copy = next((r["effective_GBps"] for r in results if r["case"].startswith("device copy")), None)
    for r in results:
        r["share_of_copy"] = None if copy is None else r["effective_GBps"] / copy

    timing.print_table(
        f"DelTA pass bandwidth on {timing.device_description()}: tokens={args.tokens} "
        f"hidden={args.hidden} dtype={args.dtype}",
        [("case", "case", "34s"), ("median ms", lambda r: 1e3 * r["median_s"], "10.3f"),
         ("calls", "calls_per_sample", "6d"),
         ("GB moved", lambda r: r["bytes"] / 1e9, "9.3f"), ("GB/s", "effective_GBps", "9.1f"),
         ("% of copy", lambda r: None if r["share_of_copy"] is None else 100 * r["share_of_copy"],
          "10.1f")],
        results)
    timing.write_json(args.out, {"results": results}, args=args)

if __name__ == "__main__":
    main()
