"""Paged decode attention alone (delta_jax.models.attention.paged_decode_attention, the rollout
decode's attention) at the decode shapes, against the memory-bandwidth limit: a sweep of the
Mosaic GPU kernel's parameters (delta_jax.kernels.paged_decode: k_splits x pages_per_block x
stages x rows_per_block, the --num-stages and --rows-per-block values; configurations over its
shared memory are skipped), of the TPU
kernel's compute block (attention.paged_decode_tpu, pallas.ops' Mosaic TPU paged attention: the
--pages-per-block values; `--impls tpu reference` on a TPU) and of the jnp page reader's block
size, so that the sampler's defaults can be chosen from measurements.
(pallas.ops' Triton kernel, swept here until 2026-11-26, was retired: BENCHMARKS.md "Kernel
decisions".)

    # GPU, Hopper (issue #15; the H200 sweep of 2026-11-26 chose paged_decode's defaults: one
    # split, 2 pages a step, 2 stages; BENCHMARKS.md "Fifth GPU run"):
    python benchmarks/paged_attention.py --batch 64 256
    # a layer's whole decode step: the fused kernel at 1 / 2 / 4 rows a block, the unfused Mosaic
    # step (scripts/gpu_bench.sh paged_rows):
    python benchmarks/paged_attention.py --batch 64 256 --fused --impls mosaic --k-splits 1 \
        --pages-per-block 2 --num-stages 2 3 --rows-per-block 1 2 4
    # CPU smoke run (the interpreted kernel is slow: one small point):
    python benchmarks/paged_attention.py --batch 2 --length 64 --pages-per-seq 4 --page-size 16 \
        --impls reference --reference-ppb 1 2 --iters 2 --copy-mib 16

Shapes (defaults = Qwen3-0.6B's attention at issue #15's decode: 16 query / 8 KV heads of 128,
bf16, 32-token pages, block tables 64 pages wide = the sampler's power-of-two bucket for 512 +
1024 tokens). Every row attends --length tokens (the mean live length of that decode), or lengths
drawn uniformly from [length / 2, 3 length / 2] with --ragged; with --live-fraction F only a
random F of the rows are live, the rest have length 0 (continuous batching's free slots: about
half at batch 64 on decode_throughput.py's long-tailed workload). The pool holds B x pages_per_seq
random pages, scrambled over the rows (page ids a random permutation), as the sampler's allocator
leaves them.

Bytes: the K and V of every live token of every row, read once (queries and outputs are
negligible); limit = those bytes / the copy bandwidth measured in the same run (kernels.timing:
read + write of a 1 GiB float32 array, chains of copies waited for once). "% of copy" = (bytes /
time) / copy bandwidth. One layer's call; a decode step makes one per layer.
Timing: the median of --iters samples, each --calls calls dispatched back to back and waited for
once, divided by the calls (kernels.timing.median_seconds): one call of ~0.1 ms waited for alone
also times ~50-150 us of GPU dispatch + sync latency (an ~80 us call read 186 us on an H200).
--calls 0 (the default) picks the calls per configuration for a sample of ~20 ms; each row
records them (calls_per_sample).
Memory: each configuration's compiled program's XLA memory analysis on the backend it runs on
(its temporaries printed, the whole analysis in the JSON records).
--fused times a layer's whole decode step (models.attention.paged_write_attend) instead of the
attention alone, as each rollout.decode_attention runs it at head_dim 128 in bf16: "mosaic_fused"
(the --impls mosaic sweep) is kernels.paged_decode.paged_write_decode_mosaic, the new token's
q / k RMSNorm and RoPE, its key and value written into the pools in place and the attention in
one kernel; "mosaic" (once, at the kernel's defaults, with --impls mosaic) is XLA's norms, RoPE
and two scatters, then the attention kernel; "reference" is XLA's step with the jnp page
reader. Each
row's new token is its last live one (lengths count it; its page slot is overwritten), so the
bytes are the K / V of every live token but the new ones. Its pools are written by every call,
so a call is timed inside one program: --fused-calls N calls in a loop that carries the pools
(in place, as the decode loop carries them), against 2N calls; the time a call is the
difference over N, which leaves out the program's dispatch and its one copy of the pools in.
Correctness: each configuration's output is compared with the jnp reference on the same inputs
(max abs error, printed; a configuration over --tolerance is flagged and not ranked). A
configuration that fails to compile or run is recorded with its error and the sweep goes on.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.kernels import paged_decode, timing
from delta_jax.models import attention


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--pages-per-seq", type=int, default=64, help="block-table width (power of 2)")
    p.add_argument("--length", type=int, default=1024, help="live tokens per row")
    p.add_argument("--ragged", action="store_true", help="lengths uniform in [L/2, 3L/2]")
    p.add_argument("--live-fraction", type=float, default=1.0,
                   help="fraction of rows with a live sequence; the others have length 0, as a "
                        "continuous-batching decode's free slots (half of them on the long-tailed "
                        "workload at batch 64)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--impls", nargs="+", default=["mosaic", "reference"],
                   choices=["mosaic", "tpu", "reference"])
    p.add_argument("--k-splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--pages-per-block", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--num-stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--rows-per-block", type=int, nargs="+", default=[1],
                   help="rows (sequences) a block of the Mosaic kernel attends in turn")
    p.add_argument("--reference-ppb", type=int, nargs="+", default=[4, 8, 16, 32],
                   help="pages per block of the jnp page reader")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--calls", type=int, default=0,
                   help="calls per timed sample (0: enough for ~20 ms, kernels.timing)")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--tolerance", type=float, default=2e-2, help="max abs error vs the reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fused", action="store_true",
                   help="time a layer's whole decode step (norms, RoPE, K / V writes and the "
                        "attention): the fused kernel (mosaic_fused; head_dim 128, bf16), the "
                        "unfused Mosaic step and XLA's, instead of the attention alone")
    p.add_argument("--fused-calls", type=int, default=20,
                   help="with --fused: calls in the shorter timed program (the other has twice)")
    p.add_argument("--out", default="benchmarks/results/paged_attention.json")
    args = p.parse_args(argv)
    if args.fused:
        problem = paged_decode.config_problem(jnp.dtype(args.dtype), args.head_dim,
                                              args.page_size, args.q_heads // args.kv_heads,
                                              fused=True)
        if problem:
            p.error(f"--fused: {problem}")
        if "tpu" in args.impls:
            p.error("--fused: the TPU kernel has no fused step (--impls mosaic reference)")
        if args.fused_calls < 1:
            p.error("--fused-calls must be >= 1")
    if args.pages_per_seq & (args.pages_per_seq - 1):
        p.error("--pages-per-seq must be a power of two (the sampler's block-table bucket)")
    hi = (3 * args.length) // 2 if args.ragged else args.length
    if hi > args.pages_per_seq * args.page_size:
        p.error(f"--length {args.length} (max {hi}) exceeds the table: --pages-per-seq "
                f"{args.pages_per_seq} x --page-size {args.page_size}")
    if args.q_heads % args.kv_heads:
        p.error("--q-heads must be a multiple of --kv-heads")
    if not 0.0 < args.live_fraction <= 1.0:
        p.error("--live-fraction must be in (0, 1]")
    if args.calls < 0:
        p.error("--calls must be >= 0 (0: automatic)")
    return args


def make_case(args, batch: int):
    """(q [B, N, D], k_pages, v_pages [K, P, page, D], block_tables [B, pages_per_seq], lengths)."""
    rng = np.random.default_rng(args.seed + batch)
    dtype = jnp.dtype(args.dtype)
    K, D, page = args.kv_heads, args.head_dim, args.page_size
    pages = batch * args.pages_per_seq
    if args.ragged:
        lengths = rng.integers(args.length // 2, (3 * args.length) // 2 + 1, size=batch)
    else:
        lengths = np.full(batch, args.length)
    live = max(1, round(args.live_fraction * batch))
    lengths[rng.permutation(batch)[live:]] = 0  # free slots, scattered over the rows
    tables = rng.permutation(pages).reshape(batch, args.pages_per_seq).astype(np.int32)
    key = jax.random.key(args.seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, args.q_heads, D), jnp.float32).astype(dtype)
    k_pages = jax.random.normal(kk, (K, pages, page, D), jnp.float32).astype(dtype)
    v_pages = jax.random.normal(kv, (K, pages, page, D), jnp.float32).astype(dtype)
    return q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)


def make_fused_case(args, case):
    """The fused step's arguments from make_case's: (qkv [B, K, G + 2, D], k_pages, v_pages,
    write_page, write_offset, block_tables, lengths, cos, sin, q_norm, k_norm), each row's new
    token at its last live position (page -1 for a free row)."""
    from delta_jax.models.rope import rope_cos_sin
    _, k_pages, v_pages, tables, lengths = case
    B, K, D = lengths.shape[0], args.kv_heads, args.head_dim
    G = args.q_heads // K
    rng = np.random.default_rng(args.seed + 7)
    n = np.asarray(lengths)
    pos = np.maximum(n - 1, 0)
    page = np.where(n > 0, np.asarray(tables)[np.arange(B), pos // args.page_size], -1)
    offset = np.where(n > 0, pos % args.page_size, 0)
    qkv = jnp.asarray(rng.standard_normal((B, K, G + 2, D)), jnp.dtype(args.dtype))
    cos, sin = rope_cos_sin(jnp.asarray(pos, jnp.int32), D, 1e6)
    q_norm, k_norm = (jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.float32)
                      for _ in range(2))
    return (qkv, k_pages, v_pages, jnp.asarray(page, jnp.int32), jnp.asarray(offset, jnp.int32),
            tables, lengths, cos, sin, q_norm, k_norm)


def fused_step(impl: str, kwargs: dict):
    """One layer's decode step as the product runs it for rollout.decode_attention `impl`:
    (out, k_pages, v_pages). "mosaic_fused" calls the fused kernel itself, so that `kwargs` (its
    parameters) reach it; "reference" takes the reader's pages_per_block; "mosaic" none."""
    def step(qkv, kp, vp, page, offset, tables, lengths, cos, sin, q_norm, k_norm):
        if impl == "mosaic_fused":
            return paged_decode.paged_write_decode_mosaic(
                qkv, kp, vp, tables, lengths, page, offset, rope=(cos, sin), q_norm=q_norm,
                k_norm=k_norm, **kwargs)
        return attention.paged_write_attend(qkv, kp, vp, page, offset, tables, lengths,
                                            rope=(cos, sin), qk_norm=(q_norm, k_norm),
                                            impl=impl, **kwargs)
    return step


def chained(step, calls: int):
    """A jitted program running `calls` steps in a loop that carries the pools (written in place
    by each) and the last output (so no step's attention is dead code); returns that output."""
    def run(qkv, kp, vp, *rest):
        def body(_, carry):
            out, kp, vp = step(qkv, carry[1], carry[2], *rest)
            return out, kp, vp
        out0 = jnp.zeros((qkv.shape[0], qkv.shape[1] * (qkv.shape[2] - 2), qkv.shape[3]),
                         qkv.dtype)
        return jax.lax.fori_loop(0, calls, body, (out0, kp, vp))[0]
    return jax.jit(run)


def fused_seconds(step, operands, args) -> float:
    """The time of one step: programs of N and 2N chained steps (N = --fused-calls), the median
    of --iters each, the difference over N."""
    n = args.fused_calls
    times = []
    for calls in (n, 2 * n):
        program = chained(step, calls)
        seconds, _ = timing.median_seconds(program, *operands, warmup=args.warmup,
                                           iters=args.iters, calls=1)
        times.append(seconds)
    return (times[1] - times[0]) / n


def configurations(args):
    """(label, impl, kwargs) of every point of the sweep."""
    for impl in args.impls:
        if impl == "reference":
            for ppb in args.reference_ppb:
                yield f"reference ppb={ppb}", impl, {"pages_per_block": ppb}
            continue
        if impl == "tpu":
            for ppb in args.pages_per_block:
                if args.pages_per_seq % ppb == 0:  # the kernel's block must divide the table
                    yield f"tpu ppb={ppb}", impl, {"pages_per_block": ppb}
            continue
        if args.fused:   # the unfused Mosaic step once, at the kernel's defaults, to compare with
            yield "mosaic (unfused step, kernel defaults)", "mosaic", {}
            impl = "mosaic_fused"
        for ks, ppb, stages, rows in itertools.product(args.k_splits, args.pages_per_block,
                                                       args.num_stages, args.rows_per_block):
            if ks > args.pages_per_seq or ppb > args.pages_per_seq // ks \
                    or paged_decode.config_problem(
                        jnp.dtype(args.dtype), args.head_dim, args.page_size,
                        args.q_heads // args.kv_heads, ppb, ks, stages, args.fused, rows):
                continue  # more pages than a split holds, or a shape the kernel refuses
            yield (f"{impl} k_splits={ks} ppb={ppb} stages={stages} rows={rows}", impl,
                   {"k_splits": ks, "pages_per_block": ppb, "stages": stages,
                    "rows_per_block": rows})


def build(impl: str, kwargs: dict):
    """The product's function for one configuration, jitted."""
    if impl == "reference":
        fn = lambda *a: attention.paged_decode_reference(*a, **kwargs)  # noqa: E731
    elif impl == "tpu":
        fn = lambda *a: attention.paged_decode_tpu(*a, **kwargs)  # noqa: E731
    else:
        fn = lambda *a: paged_decode.paged_decode_mosaic(*a, **kwargs)  # noqa: E731
    return jax.jit(fn)


def main(argv=None):
    args = parse_args(argv)
    print(f"device: {timing.device_description()}", flush=True)
    bandwidth = timing.copy_bandwidth(args.copy_mib)
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write, {args.copy_mib} MiB)",
          flush=True)
    itemsize = jnp.dtype(args.dtype).itemsize
    rows = []
    for batch in args.batch:
        case = make_case(args, batch)
        lengths = np.asarray(case[4])
        read = np.maximum(lengths - 1, 0) if args.fused else lengths   # the new token: in qkv
        kv_bytes = int(read.sum()) * 2 * args.kv_heads * args.head_dim * itemsize
        if args.fused:
            case = make_fused_case(args, case)
            want = np.asarray(jax.jit(fused_step("reference", {}))(*case)[0], np.float32)
        else:
            want = np.asarray(jax.jit(attention.paged_decode_reference)(*case), np.float32)
        print(f"batch {batch}: {kv_bytes / 1e9:.3f} GB of live K/V per call, limit "
              f"{kv_bytes / bandwidth * 1e6:.1f} us", flush=True)
        for label, impl, kwargs in configurations(args):
            row = {"batch": batch, "config": label, "impl": impl, **kwargs,
                   "fused": args.fused, "kv_bytes": kv_bytes,
                   "limit_us": kv_bytes / bandwidth * 1e6}
            try:
                one = jax.jit(fused_step(impl, kwargs)) if args.fused else build(impl, kwargs)
                fn = one.lower(*case).compile()
                row["compiled_memory"] = timing.compiled_memory_bytes(fn)
                got = fn(*case)
                got = np.asarray(got[0] if args.fused else got, np.float32)
                row["max_abs_error"] = float(np.max(np.abs(got - want)))
                row["ok"] = bool(np.isfinite(got).all() and row["max_abs_error"] <= args.tolerance)
                if args.fused:
                    calls = args.fused_calls
                    seconds = fused_seconds(fused_step(impl, kwargs), case, args)
                else:
                    calls = args.calls or timing.calls_per_sample(fn, *case)
                    seconds, _ = timing.median_seconds(fn, *case, warmup=args.warmup,
                                                       iters=args.iters, calls=calls)
                row["calls_per_sample"] = calls
                row["us"] = seconds * 1e6
                row["gb_s"] = kv_bytes / seconds / 1e9
                row["fraction_of_copy"] = kv_bytes / seconds / bandwidth
                temp = row["compiled_memory"].get("temp_bytes")
                print(f"  {label:55s} {row['us']:9.1f} us (x{calls}) {row['gb_s']:8.1f} GB/s "
                      f"{100 * row['fraction_of_copy']:5.1f}% of copy  err "
                      f"{row['max_abs_error']:.1e}{'' if row['ok'] else '  WRONG'}  temp "
                      f"{'n/a' if temp is None else f'{temp / 2**20:.1f} MiB'}", flush=True)
            except Exception as e:  # noqa: BLE001  (record it, go on with the sweep)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                print(f"  {label:55s} failed: {row['error']}", flush=True)
                traceback.print_exc(limit=2, file=sys.stdout)
            rows.append(row)
        timing.write_json(args.out, {"copy_bandwidth_gb_s": bandwidth / 1e9, "results": rows},
                          args=args)
    print_best(rows)
    print(f"wrote {args.out}")


def print_best(rows):
    """The fastest correct configuration per batch and implementation, and the product's defaults
    (attention.DECODE_PAGES_PER_BLOCK, paged_decode's defaults)."""
    print("\nbatch | impl      | best configuration                                      |      us "
          "| % of copy | current default us")
    for batch in sorted({r["batch"] for r in rows}):
        for impl in sorted({r["impl"] for r in rows}):
            ok = [r for r in rows if r["batch"] == batch and r["impl"] == impl and r.get("ok")]
            if not ok:
                print(f"{batch:5d} | {impl:9s} | none ran correctly")
                continue
            best = min(ok, key=lambda r: r["us"])
            if impl in ("reference", "tpu"):
                current = [r for r in ok
                           if r["pages_per_block"] == attention.DECODE_PAGES_PER_BLOCK]
            else:   # the Mosaic kernels' rows (the unfused step's one row has no parameters)
                current = [r for r in ok if (r.get("k_splits"), r.get("pages_per_block"),
                                             r.get("stages"), r.get("rows_per_block"))
                           in ((paged_decode.K_SPLITS, paged_decode.PAGES_PER_BLOCK,
                                paged_decode.STAGES, paged_decode.ROWS_PER_BLOCK),
                               (None,) * 4)]
            cur = f"{current[0]['us']:.1f}" if current else "-"
            print(f"{batch:5d} | {impl:9s} | {best['config']:55s} | {best['us']:7.1f} | "
                  f"{100 * best['fraction_of_copy']:8.1f}% | {cur}")


if __name__ == "__main__":
    main()
