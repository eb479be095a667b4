"""The decode step's weight matmuls alone, at the decode's row counts, against the memory-bandwidth
limit: XLA's dot as the model writes it, and split-K forms of it, so the next change to the
decode's matmuls can be chosen from measurements (issue #15).

    # GPU (Qwen3-0.6B shape, bf16, the rows of a batch-64 / 256 decode step):
    python benchmarks/decode_gemm.py --batch 64 256
    # CPU smoke run:
    python benchmarks/decode_gemm.py --preset tiny --batch 4 --split-k 2 --iters 2 --copy-mib 16

Why: on an H200 (2026-11-26, BENCHMARKS.md "Fourth GPU run") a batch-64 decode step spent 0.61
ms in its four per-layer matmul fusions, which read 0.88 GB of layer weights: ~1.4 TB/s against
a ~4.2 TB/s copy, the largest part of the step outside attention. A matmul of 64 rows reads its
weights once and does little arithmetic per byte, so it is bandwidth-bound; if it reads slower
than a copy, the cause may be how its work spreads over the GPU (too few output tiles to keep
every SM reading), which splitting the contraction (split-K) addresses. What the seventh run
found (H200, 2026-11-26, BENCHMARKS.md): XLA's Triton GEMM fusions already split the contraction;
alone, each layer GEMM takes the 4-7 us it takes inside the decode (a kernel's fixed cost, its
weights read in 1-3 us at the copy rate), and no variant here gains more than 0.4 us a call.

Groups (one layer's matmuls, as models.transformer._project_qkv / _finish_layer issue them, in
the compute dtype, without the norms and rotary in between):
  qkv      h [B, H] -> q [B, N D], k, v [B, K D]: three dots of one input (XLA may merge them)
  o        attn [B, N D] -> [B, H]
  gate_up  h [B, H] -> silu(h Wg) * (h Wu) [B, I]
  down     act [B, I] -> [B, H]
  lm_head  hidden [B, H] -> float32 logits [B, V] (once a step, not per layer)
Variants: "xla" (the model's einsums), "splitk<s>" (the contraction cut into s parts, a batched
dot over the parts with float32 partial sums added after; s must divide every contraction),
"concat" (qkv and gate_up only: one dot against the weights concatenated beforehand, as a
decode_layers() copy could hold them).

Bytes: the weights read once (inputs and outputs are ~1% beside them at 64 rows); limit = bytes /
the copy bandwidth measured in the same process (kernels.timing: read + write of a --copy-mib
float32 array, chains of copies waited for once). Timing, two figures:
  - device time (where the backend's profiler trace has device events, i.e. a GPU): --trace-calls
    calls run under jax.profiler.trace, the device events' summed time per call (the GEMM
    kernels and whatever else the program runs, e.g. a split-K's partial-sum reduction). The
    rates and % of copy come from it where present.
  - wall time: kernels.timing.median_seconds, calls back to back and waited for once. For
    matmuls of a few microseconds this is the host's dispatch rate, not the GPU's: on an H200
    (2026-11-26, seventh run) every layer matmul read ~40-70 us a call, where the same GEMM fusions
    inside the decode program took 4-7 us of device time. Hence the device figure.
Each variant's output, "xla"'s included, is compared with a float64 NumPy product of the same
inputs (reference_output; max_abs_error: the largest absolute difference from it, which for bf16
outputs includes their own rounding, ~2^-9 of each value), and its compiled
program's XLA memory analysis on the backend it runs on is recorded (temporaries printed: split-K's
float32 partial sums are s x the output). On a GPU each
group's compiled "xla" program is searched for the GEMM configurations XLA chose (block sizes,
split_k of its Triton GEMM fusions, or cuBLAS custom calls), printed and recorded.
"""
from __future__ import annotations

import argparse
import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax import models
from delta_jax.kernels import timing

GROUPS = ("qkv", "o", "gate_up", "down", "lm_head")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-0.6b", help="a models preset: its layer shapes")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="rows of a decode step")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS)
    p.add_argument("--split-k", type=int, nargs="+", default=[2, 4, 8],
                   help="split-K variants (parts of the contraction)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--calls", type=int, default=0,
                   help="calls per timed sample (0: enough for ~20 ms, kernels.timing)")
    p.add_argument("--trace-calls", type=int, default=50,
                   help="calls run under the profiler for the device time (0: none)")
    p.add_argument("--trace-dir", default="/tmp/decode_gemm_trace",
                   help="where the profiler traces go (one folder per variant)")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/decode_gemm.json")
    args = p.parse_args(argv)
    if any(s < 2 for s in args.split_k):
        p.error("--split-k values must be >= 2 (1 is the 'xla' variant)")
    if args.calls < 0:
        p.error("--calls must be >= 0 (0: automatic)")
    if args.trace_calls < 0:
        p.error("--trace-calls must be >= 0 (0: no profiler trace)")
    return args


def group_weights(cfg: models.ModelConfig, group: str, key, dtype) -> dict:
    """The group's weights as 2-D [contraction, outputs] matrices, random normal / sqrt(fan-in)."""
    H, N, K, D, I, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    shapes = {"qkv": {"q": (H, N * D), "k": (H, K * D), "v": (H, K * D)},
              "o": {"o": (N * D, H)},
              "gate_up": {"gate": (H, I), "up": (H, I)},
              "down": {"down": (I, H)},
              "lm_head": {"lm_head": (H, V)}}[group]
    keys = jax.random.split(key, len(shapes))
    return {name: (jax.random.normal(k, s, jnp.float32) / s[0] ** 0.5).astype(dtype)
            for k, (name, s) in zip(keys, shapes.items())}


def dot(x, w, parts: int = 1, out_dtype=None):
    """x [B, C] @ w [C, F]: one dot (parts = 1; as the model writes it: x's dtype out, or float32
    asked of the dot as the LM head does), or the contraction in `parts` slices as one batched
    dot with float32 partial sums added after. Output in out_dtype (default x's)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if parts == 1:
        preferred = jnp.float32 if out_dtype == jnp.float32 else None
        return jnp.einsum("bc,cf->bf", x, w, preferred_element_type=preferred).astype(out_dtype)
    B, C = x.shape
    xs = x.reshape(B, parts, C // parts)
    ws = w.reshape(parts, C // parts, w.shape[1])
    partial = jnp.einsum("bsc,scf->sbf", xs, ws, preferred_element_type=jnp.float32)
    return partial.sum(axis=0).astype(out_dtype)


def group_fn(group: str, variant: str):
    """fn(x, weights) for a group and a variant ("xla" or "splitk<s>")."""
    parts = int(variant[len("splitk"):]) if variant.startswith("splitk") else 1

    def fn(x, w):
        if group == "qkv":
            return jnp.concatenate([dot(x, w[n], parts) for n in ("q", "k", "v")], axis=1)
        if group == "gate_up":
            return jax.nn.silu(dot(x, w["gate"], parts)) * dot(x, w["up"], parts)
        if group == "lm_head":
            return dot(x, w["lm_head"], parts, jnp.float32)
        (name,) = w
        return dot(x, w[name], parts)
    return fn


def reference_output(group: str, x, w: dict) -> np.ndarray:
    """The group's output (as group_fn computes it) in float64 NumPy from the same x and weights
    (widened exactly from their dtype): what every variant is checked against."""
    x = np.asarray(x.astype(jnp.float32), np.float64)
    w = {name: np.asarray(a.astype(jnp.float32), np.float64) for name, a in w.items()}
    if group == "qkv":
        return np.concatenate([x @ w[n] for n in ("q", "k", "v")], axis=1)
    if group == "gate_up":
        gate = x @ w["gate"]
        return gate / (1.0 + np.exp(-gate)) * (x @ w["up"])   # silu(x Wg) * (x Wu)
    (name,) = w
    return x @ w[name]


CONCAT = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def concat_fn(group: str):
    """The "concat" variant: fn(x, joined) with the group's weights joined along their outputs
    beforehand (outside the timed call, as weights stored that way)."""
    def fn(x, joined):
        out = dot(x, joined)
        if group == "gate_up":
            gate, up = jnp.split(out, 2, axis=1)
            return jax.nn.silu(gate) * up
        return out
    return fn


GEMM_KEYS = ("block_m", "block_n", "block_k", "split_k", "num_stages", "num_warps")
GEMM_VALUE = re.compile(r'"(%s)":\s*"?(\d+)' % "|".join(GEMM_KEYS))
FUSION_KIND = re.compile(r'"kind":\s*"(__triton[^"]*)"')
OUTPUT_TILES = re.compile(r'"sizes":\s*\[([^\]]*)\]')


def gemm_configs(compiled_text: str) -> list[str]:
    """The GEMM choices in a compiled GPU program's text, one string per Triton fusion (its kind,
    tile sizes and split_k: the legacy "triton_gemm_config" fields or the generic emitter's
    output tiles) or cuBLAS call ("cublas")."""
    found = []
    for line in compiled_text.splitlines():
        if "custom_call_target=\"__cublas" in line:
            found.append("cublas")
            continue
        kind = FUSION_KIND.search(line)
        if not kind:
            continue
        values = dict(GEMM_VALUE.findall(line))
        parts = [kind.group(1)] + [f"{k}={values[k]}" for k in GEMM_KEYS if k in values]
        parts += ["tiles=" + t.replace('"', "").replace(" ", "") for t in OUTPUT_TILES.findall(line)]
        found.append(" ".join(parts))
    return found


def main(argv=None):
    args = parse_args(argv)
    cfg = models.get_preset(args.preset)
    dtype = jnp.dtype(args.dtype)
    print(f"{timing.device_description()} | preset {args.preset}: H {cfg.hidden_size}, "
          f"N {cfg.num_heads} x D {cfg.head_dim}, K {cfg.num_kv_heads}, I "
          f"{cfg.intermediate_size}, V {cfg.vocab_size} | {args.dtype}", flush=True)
    bandwidth = timing.copy_bandwidth(args.copy_mib)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write of {args.copy_mib} MiB)",
          flush=True)
    calls = None if args.calls == 0 else args.calls
    rows = []
    key = jax.random.key(args.seed)
    for group in args.groups:
        w = group_weights(cfg, group, jax.random.fold_in(key, GROUPS.index(group)), dtype)
        contraction = next(iter(w.values())).shape[0]
        weight_bytes = sum(int(a.size) * a.dtype.itemsize for a in w.values())
        variants = ["xla"] + [f"splitk{s}" for s in args.split_k if contraction % s == 0]
        if group in CONCAT:
            variants.append("concat")
        for batch in args.batch:
            x = jax.random.normal(jax.random.fold_in(key, 100 + batch), (batch, contraction),
                                  jnp.float32).astype(dtype)
            reference = reference_output(group, x, w)
            for variant in variants:
                row = {"group": group, "batch": batch, "variant": variant,
                       "contraction": contraction, "weight_bytes": weight_bytes}
                try:
                    if variant == "concat":
                        joined = jnp.concatenate([w[n] for n in CONCAT[group]], axis=1)
                        fn, operands = concat_fn(group), (x, joined)
                    else:
                        fn, operands = group_fn(group, variant), (x, w)
                    program = jax.jit(fn).lower(*operands).compile()
                    row["compiled_memory"] = timing.compiled_memory_bytes(program)
                    out = jax.block_until_ready(program(*operands))
                    if variant == "xla" and jax.default_backend() == "gpu":
                        row["gemm_configs"] = gemm_configs(program.as_text())
                    row["max_abs_error"] = float(np.max(np.abs(
                        np.asarray(out.astype(jnp.float32), np.float64) - reference)))
                    seconds, samples = timing.median_seconds(program, *operands,
                                                             warmup=args.warmup, iters=args.iters,
                                                             calls=calls)
                    device_s = None
                    if args.trace_calls:
                        device_s = timing.device_seconds_per_call(
                            f"{args.trace_dir}/{group}_b{batch}_{variant}", program, operands,
                            args.trace_calls)
                    rate_s = seconds if device_s is None else device_s
                    row.update(us=seconds * 1e6, samples_us=[s * 1e6 for s in samples],
                               device_us=None if device_s is None else device_s * 1e6,
                               rate_from="wall" if device_s is None else "device",
                               gb_s=weight_bytes / rate_s / 1e9,
                               pct_copy=100 * weight_bytes / rate_s / bandwidth, ok=True)
                except Exception as e:  # a variant that fails is recorded and the run goes on
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
                    traceback.print_exc(file=sys.stderr)
                rows.append(row)
                configs = row.get("gemm_configs")
                temp = row.get("compiled_memory", {}).get("temp_bytes")
                print(f"  {group:8s} B={batch:4d} {variant:8s} "
                      + (f"wall {row['us']:8.1f} us  device "
                         + ("     n/a" if row["device_us"] is None else f"{row['device_us']:8.1f}")
                         + f" us {row['gb_s']:7.1f} GB/s {row['pct_copy']:5.1f}% "
                         f"of copy ({row['rate_from']})  err {row['max_abs_error']:.1e}  temp "
                         f"{'n/a' if temp is None else f'{temp / 2**20:.2f} MiB'}"
                         if row["ok"] else f"failed: {row['error'][:120]}")
                      + (f"  XLA: {'; '.join(configs)}" if configs else ""), flush=True)
    timing.print_table(
        "decode matmuls (weights read once; rates from the device time where traced, else the "
        "wall time; % of the copy bandwidth measured above)",
        [("group", "group", "9s"), ("batch", "batch", "6d"), ("variant", "variant", "9s"),
         ("wall us", "us", "10.1f"), ("device us", "device_us", "10.1f"),
         ("GB/s", "gb_s", "8.1f"), ("% copy", "pct_copy", "7.1f"),
         ("max err", "max_abs_error", "9.1e")],
        [r for r in rows if r["ok"]])
    timing.write_json(args.out, {"preset": args.preset, "dtype": args.dtype,
                                 "copy_bandwidth_gb_s": bandwidth / 1e9, "results": rows},
                      args=args)
    return rows


if __name__ == "__main__":
    main()
