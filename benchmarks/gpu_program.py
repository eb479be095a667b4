"""The rollout engine's programs as XLA:GPU compiles them for an H100 or an H200, on a machine
without a GPU: what runs at every decode step (kernels by kind, the GEMMs and the split of their
contraction, library calls, writes of a page-pool-sized buffer) at each row count a decode call
can have, with and without rollout.batch_invariant, and the prefill's.

    bash scripts/gpu_jax_check.sh --compile benchmarks/gpu_program.py --rows 8 16 32 64 128 256
    # (a Python 3.12 venv with the GPU image's jax 0.11.2 and its CUDA plugin, .venv-gpucompile)

How: a deviceless compile. jax's CUDA plugin (jax-cuda12-plugin, jax-cuda12-pjrt) describes the
GPU from a target config (--target: the device description XLA would query; cuDNN and CUDA
versions given, --cudnn / --cuda) instead of opening one; JAX_PLATFORMS stays "cpu", so no CUDA
driver is loaded. The programs are traced under jax.default_device(that GPU), so the model's
device checks pick what they pick on one (cuDNN attention in the prefill, the Mosaic GPU decode
kernel for "auto"), and compiled from abstract arguments (programs.abstract_decode_args).
XLA cannot autotune without the device: its GEMM configs here are its own choice without
measuring. `--target local` compiles for this machine's own device instead (on a GPU: the
autotuned programs a run gets, to set beside the predictions; on a CPU: XLA:CPU's). For the Qwen3-0.6B decode at 64 rows that choice split the contraction exactly as the
profiled H200 program did (2, 4 and 8 parts: BENCHMARKS.md "A decode step's GEMMs on an H100,
compiled without a GPU"); a GPU's autotuner may choose other tiles and splits elsewhere.
`--target v5p` / `v5e` compiles for the first chip of a TPU slice instead (libtpu, TPU_TARGETS):
only the compiled memory analysis is printed there.

Decode (programs.decode, or programs.batch_invariant_decode): one program per --rows value (the
rows of a call: all slots, or a shrunk call's bucket), --queue staged entries (0: what a shrunk
call and a call with nothing staged compile; the refill's work adds kernels), --steps-per-call
steps, a page table covering --prompt-len + --new-tokens. Per step (the while loop's body):
kernels (every instruction that launches one: fusions, custom calls, copies, ...), by kind;
the GEMMs (Triton GEMM fusions, cuBLAS calls) with their result shapes and the split of their
contraction (a 2-D GEMM whose f32 result has a leading dimension a consumer sums over: split-K);
the buffers of a page pool's size (or larger) written other than in place. Prefill
(programs.prefill), with --prefill-rows: that many prompts of --prompt-len tokens, the same for
a call (its layers run unrolled; jax asks the cuDNN library's version when it traces cuDNN attention,
so a bf16 prefill needs nvidia-cudnn-cu12 installed, ~700 MB: COMPILE_CUDNN=1 bash
scripts/gpu_jax_check.sh --compile ...; without it the prefill is reported not compiled).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import time

import hlo_fusions  # a sibling benchmark: the HLO text parser

# A GPU as XLA's GpuTargetConfig describes it (the fields a GPU compile reads from the device).
TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=81_559 * 2**20,
                 bandwidth=3_352_000_000_000, l2=50 * 2**20),
    "h200": dict(name="NVIDIA H200", memory=143_771 * 2**20, bandwidth=4_800_000_000_000,
                 l2=50 * 2**20),
}
# TPU slices to compile for instead (libtpu's compiler, given the slice's topology by name; the
# programs are compiled for its first chip): scripts/test.sh places libtpu in .tpu-compile, so
#   PYTHONPATH=.tpu-compile .venv/bin/python benchmarks/gpu_program.py --target v5p ...
# For a TPU only the compiled memory analysis is reported (the kernel census is XLA:GPU's).
TPU_TARGETS = {"v5p": "v5p:2x2x1", "v5e": "v5e:2x2"}
# The allocator's share of the card a compile plans for by default (target_config), as
# scripts/gpu_bench.sh runs the benchmarks.
MEMORY_FRACTION = 0.95
# The cuDNN and CUDA versions a target is described with by default (jax 0.11.2's CUDA 12
# plugin's era; XLA checks features such as cuDNN's flash attention against them).
CUDNN_VERSION, CUDA_VERSION = "9.8", "12.8"
# Instructions that launch no kernel of their own (control flow's bodies are listed apart; an
# asynchronous op's kernel is its "-start").
NOT_KERNELS = hlo_fusions.SKIPPED_OPS | {"while", "conditional", "call", "fusion-done",
                                         "async-done", "copy-done"}
GEMM_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas")


def target_config(target: str, cudnn: str, cuda: str,
                  memory_fraction: float = MEMORY_FRACTION) -> str:
    """The text proto of stream_executor's GpuTargetConfig for `target` (Hopper: compute
    capability 9.0, 132 SMs at 1.98 GHz, 228 KiB of shared memory an SM).

    Its memory is stated as the card's x memory_fraction / 0.8. XLA:GPU's scheduler and
    rematerialisation keep a program's temporaries under a limit: 95% of (the allocator limit
    JAX passes when it compiles for a device, XLA_CLIENT_MEM_FRACTION x the card's memory,
    less the program's arguments and outputs). A compile-only device has no allocator, and XLA
    then takes 80% of the described memory as that base; so described this way the base is the
    allocator limit of a run at memory_fraction (gpu_bench.sh runs at 0.95 of an 80 GB card)."""
    t = TARGETS[target]
    memory = int(t["memory"] * memory_fraction / 0.8)
    cudnn_major, cudnn_minor = (int(x) for x in cudnn.split(".")[:2])
    cuda_major, cuda_minor = (int(x) for x in cuda.split(".")[:2])
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {t["bandwidth"]}
  l2_cache_size: {t["l2"]}
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn_major} minor: {cudnn_minor} }}
runtime_version {{ major: {cuda_major} minor: {cuda_minor} }}
device_description_str: "{t["name"]}"
"""


def compile_only_device(target: str, cudnn: str, cuda: str,
                        memory_fraction: float = MEMORY_FRACTION):
    """The described GPU (target_config), or the first chip of a TPU slice (TPU_TARGETS), as a
    compile-only device (jax.experimental.topologies)."""
    import jax
    from jax.experimental import topologies
    if target in TPU_TARGETS:
        try:
            return topologies.get_topology_desc(topology_name=TPU_TARGETS[target],
                                                platform="tpu").devices[0]
        except Exception as e:  # no libtpu
            raise SystemExit(
                f"gpu_program: compiling for a TPU without one needs libtpu (pip install "
                f"'jax[tpu]', or PYTHONPATH=.tpu-compile after scripts/test.sh) and "
                f"JAX_PLATFORMS=cpu: {type(e).__name__}: {e}") from None
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name="", topology="1x1x1",
            target_config=target_config(target, cudnn, cuda, memory_fraction))
    except Exception as e:  # no CUDA plugin, or one that cannot describe a GPU without it
        raise SystemExit(
            f"gpu_program: compiling for a GPU without one needs jax's CUDA plugin "
            f"(pip install jax-cuda12-plugin=={jax.__version__} "
            f"jax-cuda12-pjrt=={jax.__version__}; scripts/gpu_jax_check.sh --compile makes a "
            f"venv with it) and JAX_PLATFORMS=cpu: {type(e).__name__}: {e}") from None
    return topology.devices[0]


# ----------------------------------------------------------------------------- the HLO's steps

def _operands(text: str) -> list[str]:
    """The instruction names an instruction's text takes as operands."""
    inside = text.split("(", 1)[1] if "(" in text else ""
    return re.findall(r"%([\w.\-]+)", inside.split("), ", 1)[0])


def _kind(ins: dict, fused: dict) -> str:
    """A kernel's kind: a fusion's (hlo_fusions.fusions' kind: kLoop, kInput, a Triton kind,
    ...), a custom call's target, else the opcode."""
    if ins["opcode"] == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', ins["text"])
        return "custom-call " + (target.group(1) if target else "?")
    if ins["opcode"] == "fusion":
        return "fusion " + fused.get(ins["name"], {}).get("kind", "?")
    return ins["opcode"]


def _is_gemm(kind: str) -> bool:
    return any(k in kind for k in GEMM_KINDS) or ("custom-call" in kind and "gemm" in kind)


def _dims(shape: str) -> list[int]:
    found = hlo_fusions.ARRAY.match(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def kernels(text: str, computation: str, pool_bytes: int | None = None) -> dict:
    """What one run of `computation` of an optimized HLO module launches: {"kernels": count,
    "by_kind": {kind: count}, "gemms": [{"name", "kind", "shape", "split_k", "source"}],
    "pool_sized": [descriptions of buffers of at least pool_bytes written other than in place]}.
    A GEMM's split_k is the leading dimension of its result where a consumer sums over it (how
    XLA's split-K rewrite leaves a 2-D GEMM: f32[split, rows, N], then a reduce), else 1."""
    computations = hlo_fusions.parse_module(text)
    body = computations[computation]
    fused = {f["name"]: f for f in hlo_fusions.fusions(text)}
    users = collections.defaultdict(list)
    for ins in body:
        for operand in _operands(ins["text"]):
            users[operand].append(ins)
    by_kind, gemms, pool_sized = collections.Counter(), [], []
    for ins in body:
        if ins["opcode"] in NOT_KERNELS:
            continue
        kind = _kind(ins, fused)
        by_kind[kind] += 1
        info = fused.get(ins["name"], {})
        if _is_gemm(kind):
            dims = _dims(ins["shape"])
            summed = any(u["opcode"] == "reduce"
                         or "reduce" in fused.get(u["name"], {}).get("ops", {})
                         for u in users[ins["name"]])
            gemms.append({"name": ins["name"], "kind": kind, "shape": ins["shape"].split("{")[0],
                          "split_k": dims[0] if len(dims) == 3 and summed else 1,
                          "source": info.get("source", "")})
        if pool_bytes and ins["opcode"] != "custom-call":
            written = info.get("write_bytes", hlo_fusions.shape_bytes(ins["shape"]))
            if written >= pool_bytes:
                pool_sized.append(f"{ins['name']} {kind} {ins['shape'].split('{')[0]}")
    return {"kernels": sum(by_kind.values()), "by_kind": dict(by_kind.most_common()),
            "gemms": gemms, "pool_sized": pool_sized}


def loop_bodies(text: str, computation: str | None = None) -> list[str]:
    """The bodies of the module's while loops (what runs at every iteration), or of those whose
    while instruction is in `computation` (the entry's: the outermost loops)."""
    if computation is not None:
        text = "\n".join(i["text"] for i in hlo_fusions.parse_module(text)[computation]
                         if i["opcode"] == "while")
    return sorted(set(re.findall(r"\bbody=%?([\w.\-]+)", text)))


def entry(text: str) -> str:
    """The module's entry computation's name."""
    found = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    if not found:
        raise ValueError("gpu_program: no ENTRY computation in the HLO text")
    return found.group(1)


def summary(found: dict) -> dict:
    """kernels()'s result with its GEMMs counted by (shape, split_k, source)."""
    gemms = collections.Counter((g["shape"], g["split_k"], g["source"]) for g in found["gemms"])
    return {"kernels": found["kernels"], "by_kind": found["by_kind"],
            "gemms": [{"shape": s, "split_k": k, "source": src, "count": n}
                      for (s, k, src), n in gemms.most_common()],
            "split_gemms": sum(1 for g in found["gemms"] if g["split_k"] > 1),
            "pool_sized": found["pool_sized"]}


def program_summary(text: str, label: str, pool_bytes: int | None = None) -> dict:
    """summary() of the body of the program's one outermost while loop (decode: a step; loops
    inside it count as no kernel), with "call_kernels": the kernels its entry launches once a
    call."""
    bodies = loop_bodies(text, entry(text))
    if len(bodies) != 1:
        raise SystemExit(f"gpu_program: {label}: expected one outermost while loop, found "
                         f"{bodies}")
    return {**summary(kernels(text, bodies[0], pool_bytes)),
            "call_kernels": kernels(text, entry(text))["kernels"]}


# ----------------------------------------------------------------------------- compiling

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="h100",
                   choices=sorted(TARGETS) + sorted(TPU_TARGETS) + ["local"],
                   help="the GPU described or the TPU slice named (compiled without it), or "
                        "'local': this machine's default device, its compiler's own (on a GPU: "
                        "autotuned) programs")
    p.add_argument("--cudnn", default=CUDNN_VERSION,
                   help="the cuDNN version XLA is told (major.minor)")
    p.add_argument("--cuda", default=CUDA_VERSION, help="the CUDA runtime version XLA is told")
    p.add_argument("--memory-fraction", type=float, default=MEMORY_FRACTION,
                   help="the allocator's share of the card that XLA plans temporaries against "
                        "(XLA_CLIENT_MEM_FRACTION of the run emulated)")
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--num-layers", type=int, default=0,
                   help="in place of the preset's (0: its own)")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="in place of the preset's (0: its own)")
    p.add_argument("--rows", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256],
                   help="rows of a decode call (slots, or a shrunk call's bucket; none: no decode)")
    p.add_argument("--queue", type=int, default=0,
                   help="staged entries of each decode call (0: no refill work)")
    p.add_argument("--batch-invariant", type=int, nargs="+", default=[0, 1], choices=(0, 1))
    p.add_argument("--steps-per-call", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--decode-attention", default="auto")
    p.add_argument("--decode-splits", type=int, default=1,
                   help="rollout.decode_splits of the decode programs (0 = auto: from each row "
                        "count and the target's SMs)")
    p.add_argument("--prefill-rows", type=int, nargs="*", default=[],
                   help="prompts of one prefill call (default none: the prefill's cuDNN "
                        "attention needs the cuDNN library to be traced)")
    p.add_argument("--dump", default=None, help="write each program's optimized HLO here")
    p.add_argument("--output", default=None, help="JSON record")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.target != "local":  # the CUDA plugin compiles only: no GPU is opened
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from delta_jax import models
    from delta_jax.kernels import timing
    from delta_jax.models import attention
    from delta_jax.sampling import programs

    if args.target == "local":
        device = jax.devices()[0]
    else:
        device = compile_only_device(args.target, args.cudnn, args.cuda, args.memory_fraction)
    placed = jax.sharding.SingleDeviceSharding(device)
    dtype = jnp.dtype(args.dtype)
    cfg = models.get_preset(args.preset, dtype=dtype, param_dtype=dtype)
    cfg = cfg.replace(num_layers=args.num_layers or cfg.num_layers,
                      vocab_size=args.vocab_size or cfg.vocab_size)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: models.Transformer(cfg,
                                                                          rngs=nnx.Rngs(0))))
    ps = args.page_size
    pages_per_seq = -(-(args.prompt_len + args.new_tokens) // ps)
    how = ("this machine's device" if args.target == "local" else
           f"compile only, {TPU_TARGETS[args.target]}" if args.target in TPU_TARGETS else
           f"compile only, memory fraction {args.memory_fraction}, cuDNN {args.cudnn}, "
           f"CUDA {args.cuda}")
    print(f"gpu_program: {args.preset} ({cfg.num_layers} layers, vocabulary {cfg.vocab_size}) "
          f"{args.dtype} for {device.device_kind} ({how}, jax {jax.__version__})", flush=True)
    results, memory = [], {}

    def compiled_text(label, lowered):
        """The program's optimized HLO and its compile time; XLA:GPU's memory analysis printed
        and kept (memory[label])."""
        start = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
        text = compiled.as_text()
        memory[label] = timing.compiled_memory_bytes(compiled)
        print(timing.format_compiled_memory(label, memory[label]), flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"{label}.txt"), "w") as f:
                f.write(text)
        return text, seconds

    with jax.default_device(device):
        for rows in args.rows:
            num_pages = 1 + rows * pages_per_seq
            cache = jax.eval_shape(lambda: models.init_paged_cache(cfg, num_pages, ps))
            pool_bytes = cache.k[0].size * cache.k[0].dtype.itemsize
            impl = attention.resolve_decode_impl(
                args.decode_attention, dtype=dtype, head_dim=cfg.head_dim, page_size=ps,
                group=cfg.num_heads // cfg.num_kv_heads)
            for invariant in args.batch_invariant:
                program = programs.batch_invariant_decode if invariant else programs.decode
                # auto varies with the rows: the batch-invariant sampler refuses it (one split)
                splits = 1 if invariant and not args.decode_splits else args.decode_splits
                lowered = program.lower(
                    *programs.abstract_decode_args(graphdef, state, cache, rows, pages_per_seq,
                                                   queued=args.queue, sharding=placed),
                    num_steps=args.steps_per_call, top_k=-1, use_top_p=False, greedy=False,
                    attention_impl=impl, pages_per_block=max(1, min(pages_per_seq, 256 // ps)),
                    attention_splits=splits)
                label = (f"decode_rows{rows}_queue{args.queue}_inv{invariant}"
                         + (f"_splits{splits}" if splits != 1 else ""))
                text, seconds = compiled_text(label, lowered)
                if args.target in TPU_TARGETS:  # the kernel census below is XLA:GPU's notion
                    results.append({"program": "decode", "rows": rows, "label": label,
                                    "compiled_memory": memory[label]})
                    continue
                row = {"program": "decode", "rows": rows, "queue": args.queue,
                       "batch_invariant": invariant, "decode_attention": impl,
                       "decode_splits": splits,
                       "compile_s": round(seconds, 1), "compiled_memory": memory[label],
                       **program_summary(text, label, pool_bytes)}
                results.append(row)
                print_row(row)
        for rows in args.prefill_rows:
            cache = timing.abstract_like(jax.eval_shape(lambda: models.init_paged_cache(
                cfg, 1 + rows * pages_per_seq, ps)), placed)
            ints = jax.ShapeDtypeStruct((rows, args.prompt_len), jnp.int32, sharding=placed)
            abstract_state = timing.abstract_like(state, placed)
            layers = timing.abstract_like(jax.eval_shape(programs.decode_layers, graphdef, state),
                                          placed)
            for invariant in args.batch_invariant:
                program = programs.batch_invariant_prefill if invariant else programs.prefill
                label = f"prefill_rows{rows}_len{args.prompt_len}_inv{invariant}"
                try:
                    text, seconds = compiled_text(label, program.lower(
                        graphdef, abstract_state, layers, cache, ints, ints, ints, ints))
                except RuntimeError as e:  # e.g. "cuDNN not found": jax asks the library's version
                    print(f"prefill rows {rows}: not compiled: {e} (the cuDNN attention of a "
                          f"bf16 prefill needs the cuDNN library: nvidia-cudnn-cu12, which "
                          f"COMPILE_CUDNN=1 bash scripts/gpu_jax_check.sh --compile installs)",
                          flush=True)
                    break
                if args.target in TPU_TARGETS:
                    results.append({"program": "prefill", "rows": rows, "label": label,
                                    "compiled_memory": memory[label]})
                    continue
                # the layers run unrolled (Transformer.prefill_paged): a call's kernels
                found = summary(kernels(text, entry(text)))
                row = {"program": "prefill", "rows": rows, "prompt_len": args.prompt_len,
                       "batch_invariant": invariant, "compile_s": round(seconds, 1),
                       "compiled_memory": memory[label], **found,
                       "call_kernels": found["kernels"]}
                results.append(row)
                print_row(row)
    if args.output:
        timing.write_json(args.output, {"jax": jax.__version__, "target": args.target,
                                        "device_kind": device.device_kind,
                                        "results": results}, args=args)


def print_row(row: dict) -> None:
    splits = ", ".join(f"{g['count']} x {g['shape']}" + (f" split {g['split_k']}"
                                                          if g["split_k"] > 1 else "")
                       for g in row["gemms"])
    where = ("a step" + f" (+ {row['call_kernels']} a call)" if row["program"] == "decode"
             else "a call")
    print(f"{row['program']} rows {row['rows']} batch_invariant {row['batch_invariant']}: "
          f"{row['kernels']} kernels {where}, "
          f"{row['split_gemms']} GEMMs split; GEMMs: {splits}"
          + (f"; pool-sized writes: {row['pool_sized']}" if row.get("pool_sized") else ""),
          flush=True)
    kinds = ", ".join(f"{n} {k}" for k, n in row["by_kind"].items())
    print(f"    by kind: {kinds}", flush=True)


if __name__ == "__main__":
    main()
