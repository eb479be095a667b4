"""Training throughput: tokens/s and MFU of the RL train step, and its peak memory, for each
remat policy x attention implementation x LM-head log-prob implementation asked for.

Runs delta_jax.train.step.make_train_step (the trainer's own jitted step: forward, DAPO loss,
backward, AdamW after a global-norm clip) on a random-init preset model and a fixed random batch
of --batch sequences of --seq tokens, of which the last --response-len are the response (the
columns the loss and the LM head see), in micro-batches of --micro-batch sequences.

One row per combination of --remat (models.REMAT_POLICIES), --attention (model.attention:
auto / xla / blockwise / cudnn) and --logprob-impls (chunked / fused). The "attn run" column is
the implementation attend() runs for the step's calls (auto picks cuDNN on an NVIDIA GPU in
bf16/fp16, else blockwise or xla by length). A requested implementation that does not apply on
this backend (cudnn on a CPU, or in float32) is not run but reported as a skipped row with the
reason: attend() would silently run its fallback, which would be timed under the wrong name.

Timing (median of --iters after --warmup, one call per sample waited for: these programs run
~10 ms - 1 s, so a call's ~50-150 us of GPU dispatch + sync latency is a small part of it; the
step donates its state, so it could not be called twice on the same arrays anyway, and a second
call of fwd+bwd or the optimizer in flight would hold another copy of the gradients or of the
parameters and optimizer state):
    forward       the loss only (jit), over the batch in the step's micro-batches
    fwd+bwd       value_and_grad of the loss (jit), gradients summed over the micro-batches
    step          the full train step (state donated, optimizer included)
    optimizer     the optimizer alone: clip + AdamW + applying the update, on the gradients
    other         step - fwd+bwd - optimizer (normalisation, norm, metrics, the finite check)
tokens/s = batch * seq / step time. --profile DIR traces one more step per row into DIR and
prints its device time by kernel (where the backward's time goes: issue #16).

MFU = model FLOPs per step / step time / peak FLOP/s. Model FLOPs (no rematerialisation counted):
    6 * N * tokens                  N = matmul parameters outside the embedding and LM head
  + 6 * H * V * response tokens     the LM head, on the response columns only
  + 6 * L * heads * head_dim * S^2 * batch   causal attention (QK^T and PV, half the square)
With --lora-rank R (adapters of rank R on the default targets trained, everything else frozen:
the trainer's model.lora_rank) the frozen N and LM-head terms count 4x (forward and the input
gradient: no weight gradient is formed) and the adapters' parameters 6x per token.
Reported against two peaks in every run:
    MFU sheet     the data-sheet peak: 989 TFLOP/s (dense bf16 tensor cores) on an H100/H200,
                  or --peak-tflops; n/a (JSON null) on other devices
    MFU matmul    the rate of a --peak-matmul-size square matmul in --dtype measured in this run
                  (default 8192 on a GPU, 2048 elsewhere), so a CPU MFU says how close the step
                  gets to that machine's own matmul speed; each of its --iters samples is
                  enough calls back to back for ~20 ms, waited for once (kernels.timing: one
                  ~1.4 ms call waited for alone read 530 TFLOP/s on an H200 whose cuBLAS does
                  ~790); the calls per sample are printed and stored (peak_matmul_calls)

Memory: XLA's static analysis of the compiled step (temporaries + arguments + outputs - aliased)
at --memory-preset / --memory-seq / --memory-batch, for each remat x attention x log-prob
combination, lowered from abstract shapes only (nothing is allocated, so the full Qwen3-1.7B shape
can be analysed on a CPU; the figure is then the CPU compiler's buffer assignment, which is close
to but not the GPU's), printed beside plan mode's "update" figure (delta_jax.plan) for the same
shape (plan mode models every remat policy: none, full and the dots_* policies from the matmul
outputs they save). With --compile-for h100 / h200 (or v5p / v5e: a TPU chip, libtpu; and
--skip-throughput) the step is compiled for that device on this machine instead, deviceless
(benchmarks/gpu_program.py: jax's CUDA plugin,
`bash scripts/gpu_jax_check.sh --compile benchmarks/train_throughput.py --skip-throughput
--compile-for h100`, with COMPILE_CUDNN=1 for cuDNN attention's library), with the model's
dispatch as on that GPU (cuDNN attention): XLA:GPU's figures next to the plan, without a GPU.
The timed programs' own analyses (forward, fwd+bwd, step at the throughput shape) are printed on
the backend that runs them.

Defaults (one GPU call, issue #9 / #16: Qwen3-1.7B, batch 8 in micro-batches of 2 x sequence
4096, bf16): remat full (the layer input only) and dots_with_no_batch_dims_saveable (also the
projection / MLP matmul outputs, ~40 KB per token per layer in bf16: ~9.4 GB over 28 layers at
micro-batch 2 x 4096, which fits an 80 GB GPU beside the parameters and AdamW state: XLA:CPU's
analysis of the whole step says 47.8 GiB against 32.0 with full remat, BENCHMARKS.md section 4;
dots_saveable would also keep the xla path's [B, N, T, S] scores, 2 GiB per layer in fp32);
attention auto (cuDNN flash on a GPU in bf16) and xla (the materialised-scores reference).
    python benchmarks/train_throughput.py
CPU recording run (Qwen3-1.7B width with 2 layers, sequence 512, float32):
    python benchmarks/train_throughput.py --layers 2 --seq 512 --response-len 384 --batch 2 \
        --dtype float32 --iters 3 --warmup 1 --remat full --attention auto
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax import models, xla_env
from delta_jax.kernels import timing
from delta_jax.models import attention as attention_lib
from delta_jax.train import state as state_lib
from delta_jax.train.config import CHOICES, default_config, lora_targets, resolve_method
from delta_jax.train.features import response_forward
from delta_jax.train.run import make_loss_fn
from delta_jax.train.step import add_grads, make_train_step, split_micro, zero_grad_sum

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) from NVIDIA's data sheets.
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}


def model_config(preset: str, layers: int | None, dtype: str, remat: str, attention: str,
                 lora_rank: int = 0):
    overrides = dict(dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype), remat=remat,
                     attention=attention)
    if lora_rank:  # the run config's LoRA defaults (targets, alpha)
        run = default_config()
        overrides.update(lora_rank=lora_rank, lora_targets=lora_targets(run),
                         lora_alpha=float(run.model.lora_alpha))
    if layers:
        overrides["num_layers"] = layers
    return models.get_preset(preset, **overrides)


def model_flops(cfg, batch: int, seq: int, response_len: int) -> dict:
    """Training FLOPs of one step by part: forward + backward = 3x the forward's for trained
    weights; with LoRA (cfg.lora_rank > 0) the frozen base weights and LM head take 2x (forward
    and the input gradient, no weight gradient) and the adapters 3x."""
    frozen = 4 if cfg.lora_rank else 6
    dense = frozen * cfg.num_params(include_embeddings=False) * batch * seq
    head = frozen * cfg.hidden_size * cfg.vocab_size * batch * response_len
    attention = 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq * seq * batch
    lora = 6 * cfg.num_lora_params() * batch * seq
    return {"dense": dense, "lm_head": head, "attention": attention, "lora": lora,
            "total": dense + head + attention + lora}


def datasheet_peak_flops() -> tuple[float | None, str]:
    """(FLOP/s, source) of the device's data-sheet peak; (None, why) on an unknown device."""
    kind = getattr(jax.devices()[0], "device_kind", "")
    for name, tflops in GPU_PEAK_TFLOPS.items():
        if name in kind:
            return tflops * 1e12, f"{name} dense bf16 data sheet"
    return None, f"no data-sheet peak for {kind or jax.default_backend()!r}"


def measured_peak_flops(dtype, size: int, iters: int) -> tuple[float, str, int]:
    """(FLOP/s, source, calls per sample): a size^3 matmul in `dtype` timed here, the median of
    `iters` samples of back-to-back calls (enough for ~20 ms: kernels.timing.calls_per_sample,
    whose first call is the warm-up)."""
    a = jax.random.normal(jax.random.key(1), (size, size), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    calls = timing.calls_per_sample(matmul, a, a)
    seconds, _ = timing.median_seconds(matmul, a, a, warmup=0, iters=iters, calls=calls)
    return (2 * size ** 3 / seconds,
            f"measured {size}^3 {jnp.dtype(dtype).name} matmul, {calls} calls per sample", calls)


def attention_run(cfg, rows: int, seq: int) -> tuple[str, str | None]:
    """(the implementation attend() runs for the train step's causal self-attention at this
    shape, why cfg.attention is skipped or None): an explicit choice that attend() would replace
    by its fallback (cudnn off an NVIDIA GPU or in float32) is skipped, not timed under its name."""
    run = attention_lib.resolve_impl(cfg.attention, (rows, seq, cfg.num_heads, cfg.head_dim),
                                     cfg.dtype, kv_len=seq)
    if cfg.attention in ("auto", run):
        return run, None
    return run, (f"attention={cfg.attention} does not apply on {jax.default_backend()} in "
                 f"{jnp.dtype(cfg.dtype).name} with head_dim {cfg.head_dim} (cuDNN needs an "
                 f"NVIDIA GPU, bf16/fp16, head_dim a multiple of 8 <= 128); attend() would run "
                 f"{run!r}")


def auto_remat(args, preset: str, layers: int | None, dtype: str, attention: str,
               shape: dict) -> str:
    """What model.remat=auto picks for this step (delta_jax.plan.pick_remat over
    plan_update_bytes at `shape`, in this backend's plan.auto_remat_order), against this
    device's allocator limit, or
    --device-memory-gb where the backend reports none (the CPU); printed."""
    from delta_jax import plan as plan_lib
    capacity = plan_lib.capacity_bytes(args.device_memory_gb)
    policy, tried = plan_lib.pick_remat(lambda p: plan_update_bytes(
        model_config(preset, layers, dtype, p, attention, args.lora_rank), **shape), capacity,
        plan_lib.auto_remat_order())
    print(f"remat=auto, attention={attention} -> {policy} (planned update: "
          + ", ".join(f"{k} {v / 2 ** 30:.2f} GiB" for k, v in tried.items())
          + f"; capacity {capacity / 2 ** 30:.2f} GiB)", flush=True)
    return policy


def sweep(args, label: str, preset: str, layers: int | None, dtype: str, shape: dict,
          measure) -> list[dict]:
    """measure(cfg, logprob impl) -> dict for each --remat x --attention x --logprob-impls
    combination, as rows {"remat", "attention", "attention_run", "logprob", **measured}, or
    with "skipped": why where the attention implementation does not apply here. `shape`:
    plan_update_bytes' keywords for the step measured (remat auto is resolved at it, the row's
    remat then "auto:<policy>")."""
    out = []
    rows, seq = shape["micro_batch"] or shape["batch"], shape["seq"]
    for remat, attention in itertools.product(args.remat, args.attention):
        policy = (auto_remat(args, preset, layers, dtype, attention, shape) if remat == "auto"
                  else remat)
        cfg = model_config(preset, layers, dtype, policy, attention, args.lora_rank)
        run, skipped = attention_run(cfg, rows, seq)
        if remat == "auto":
            remat = f"auto:{policy}"
        for impl in args.logprob_impls:
            key = {"remat": remat, "attention": attention, "attention_run": run, "logprob": impl}
            if skipped:  # printed under the table
                out.append({**key, "skipped": skipped})
                continue
            print(f"{label}: remat={remat} attention={attention} ({run}) logprob_impl={impl} ...",
                  flush=True)
            out.append({**key, **measure(cfg, impl)})
    return out


def make_batch(cfg, batch: int, seq: int, response_len: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    return {"input_ids": jnp.asarray(ids),
            "attention_mask": jnp.ones((batch, seq), jnp.int32),
            "response_mask": jnp.ones((batch, response_len), jnp.float32),
            # Old log-probs near a uniform policy's, so ratios stay in the clip range.
            "old_logp": jnp.full((batch, response_len), -np.log(cfg.vocab_size), jnp.float32),
            "advantages": jnp.asarray(rng.choice([-1.0, 1.0], batch), jnp.float32),
            "token_weights": jnp.ones((batch, response_len), jnp.float32)}


def abstract_batch(batch: int, seq: int, response_len: int) -> dict:
    s = jax.ShapeDtypeStruct
    return {"input_ids": s((batch, seq), jnp.int32), "attention_mask": s((batch, seq), jnp.int32),
            "response_mask": s((batch, response_len), jnp.float32),
            "old_logp": s((batch, response_len), jnp.float32),
            "advantages": s((batch,), jnp.float32),
            "token_weights": s((batch, response_len), jnp.float32)}


class StepPrograms:
    """The jitted forward, forward+backward (both over the batch in the step's micro-batches,
    so they hold what one micro-batch holds, as the step does) and full train step of one
    model / log-prob impl."""

    def __init__(self, graphdef, rest, optimizer, *, impl: str, chunk: int, micro_batch: int):
        rl_cfg = default_config()
        rl_cfg.method = "dapo"
        rl_cfg = resolve_method(rl_cfg)   # DAPO's loss settings
        loss_fn = make_loss_fn(rl_cfg)
        temperature = float(rl_cfg.rollout.temperature)

        def loss(params, batch):
            model = nnx.merge(graphdef, params, rest)
            logp, entropy, _ = response_forward(
                model, batch["input_ids"], batch["attention_mask"],
                batch["response_mask"].shape[1], temperature=temperature, chunk_size=chunk,
                with_hidden=False, logprob_impl=impl)
            total, denom, _ = loss_fn(logp, batch["old_logp"], batch["advantages"],
                                      batch["response_mask"], batch["token_weights"], entropy)
            return total / jnp.maximum(denom, 1.0)

        def forward(params, batch):
            return jax.lax.map(lambda mb: loss(params, mb), split_micro(batch, micro_batch)).mean()

        def fwd_bwd(params, batch):  # gradients of the trainable parameters (all, or LoRA's),
            def body(grads, mb):     # summed in float32 as the trainer's step sums them
                (value, _), g = state_lib.trainable_value_and_grad(
                    lambda p, m: (loss(p, m), None), params, mb)
                return add_grads(grads, g), value
            grads, values = jax.lax.scan(body, zero_grad_sum(params),
                                         split_micro(batch, micro_batch))
            return values.mean(), grads

        self.forward = jax.jit(forward)
        self.fwd_bwd = jax.jit(fwd_bwd)

        def apply_optimizer(params, opt_state, grads):
            trainable, frozen = state_lib.split_trainable(params)
            updates, opt_state = optimizer.update(grads, opt_state, trainable)
            return (state_lib.merge_trainable(optax.apply_updates(trainable, updates), frozen),
                    opt_state)

        self.optimizer = jax.jit(apply_optimizer)
        self.step = make_train_step(graphdef, rest, optimizer, loss_fn, temperature=temperature,
                                    chunk_size=chunk, micro_batch_size=micro_batch,
                                    logprob_impl=impl)


def time_step(step, state, batch, warmup: int, iters: int) -> tuple[float, object]:
    """Median seconds of the donating train step (the state is threaded through the calls)."""
    for _ in range(warmup):
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), state


def throughput(args, cfg, impl: str, peaks: dict) -> dict:
    """Times one model config / log-prob impl; MFU against each of `peaks` ({name: FLOP/s or
    None}) as mfu_<name> (None where the peak is)."""
    graphdef, params, rest = state_lib.split_model(models.Transformer(cfg, rngs=nnx.Rngs(0)))
    optimizer = state_lib.make_optimizer(lambda _: 1e-6, weight_decay=0.1, max_grad_norm=1.0)
    programs = StepPrograms(graphdef, rest, optimizer, impl=impl, chunk=args.logprob_chunk,
                            micro_batch=args.micro_batch)
    batch = make_batch(cfg, args.batch, args.seq, args.response_len)
    fwd_s, _ = timing.median_seconds(programs.forward, params, batch, warmup=args.warmup,
                                     iters=args.iters)
    fwd_bwd_s, _ = timing.median_seconds(programs.fwd_bwd, params, batch, warmup=args.warmup,
                                         iters=args.iters)
    state = state_lib.init_train_state(params, optimizer)
    _, grads = programs.fwd_bwd(params, batch)
    optimizer_s, _ = timing.median_seconds(programs.optimizer, params, state.opt_state, grads,
                                           warmup=args.warmup, iters=args.iters)
    del grads
    plan_bytes = plan_update_bytes(cfg, chunk=args.logprob_chunk, batch=args.batch,
                                   micro_batch=args.micro_batch, seq=args.seq,
                                   response_len=args.response_len)
    label = f"({cfg.remat_policy}, {cfg.attention}, {impl})"
    memory = {name: timing.print_compiled_memory(f"{name} {label}", fn, *fn_args,
                                                 plan_bytes=plan)
              for name, fn, fn_args, plan in (
                  ("forward", programs.forward, (params, batch), None),
                  ("fwd+bwd", programs.fwd_bwd, (params, batch), None),
                  ("train step", programs.step, (state, batch), plan_bytes))}
    step_s, state = time_step(programs.step, state, batch, args.warmup, args.iters)
    flops = model_flops(cfg, args.batch, args.seq, args.response_len)
    achieved = flops["total"] / step_s
    profile = profile_step(args, label, programs.step, state, batch) if args.profile else {}
    return {"forward_s": fwd_s, "fwd_bwd_s": fwd_bwd_s, "step_s": step_s,
            "optimizer_s": optimizer_s,
            "other_s": step_s - fwd_bwd_s - optimizer_s,
            "tokens_per_s": args.batch * args.seq / step_s,
            "model_tflops_per_step": flops["total"] / 1e12, "achieved_tflops": achieved / 1e12,
            **{f"mfu_{name}": None if peak is None else achieved / peak
               for name, peak in peaks.items()},
            "flops_by_part": flops, "params": cfg.num_params(),
            "trainable_params": sum(x.size for x in jax.tree.leaves(
                state_lib.split_trainable(params)[0])),
            "compiled_memory": memory, **profile}


def profile_step(args, label: str, step, state, batch) -> dict:
    """One more train step under the profiler (into --profile/<label>): prints and returns its
    device time by kernel (the top 30) and the device's summed kernel time (against the row's
    timed step, the rest is launches and gaps)."""
    folder = os.path.join(args.profile, re.sub(r"[^\w.-]+", "_", label).strip("_"))
    _, every, device_s = timing.traced_kernels(folder, lambda: step(state, batch))
    rows = every[:30]
    timing.print_table(f"device time by kernel, one train step {label}", [
        ("kernel", lambda r: r["name"][:70], "70s"), ("ms", lambda r: r["total_us"] / 1e3, "9.2f"),
        ("calls", "count", "6d"), ("share", "share", "7.3f")], rows)
    print(f"train step {label}: device kernels "
          f"{'n/a (no device in the trace)' if device_s is None else f'{device_s:.3f} s'}",
          flush=True)
    return {"profile": {"device_kernel_s": device_s, "kernels": rows}}


def abstract_step(cfg, *, impl: str, chunk: int, batch: int, micro_batch: int, seq: int,
                  response_len: int):
    """(train step, abstract state, abstract batch): the trainer's jitted step for `cfg` and the
    shapes to lower it with; nothing is allocated."""
    abstract_model = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = state_lib.split_model(abstract_model)
    optimizer = state_lib.make_optimizer(lambda _: 1e-6, weight_decay=0.1, max_grad_norm=1.0)
    state = jax.eval_shape(lambda p: state_lib.init_train_state(p, optimizer), params)
    programs = StepPrograms(graphdef, rest, optimizer, impl=impl, chunk=chunk,
                            micro_batch=micro_batch)
    return programs.step, state, abstract_batch(batch, seq, response_len)


def plan_update_bytes(cfg, *, chunk: int, batch: int, micro_batch: int, seq: int,
                      response_len: int) -> int:
    """Plan mode's "update" phase (delta_jax.plan.plan_memory) for this step on one device: one
    mini-batch of `batch` rows in micro-batches of `micro_batch` (0 = all), the same optimizer."""
    from delta_jax import plan as plan_lib
    optimizer = state_lib.make_optimizer(lambda _: 1e-6, weight_decay=0.1, max_grad_norm=1.0)
    memory_plan = plan_lib.plan_memory(
        cfg, mesh_shape=(1, 1, 1), device_memory_gb=80.0, rollout_rows=batch,
        prompt_len=seq - response_len, response_len=response_len, sampler_rows=batch,
        group_size=1, mini_batch_rows=batch, micro_batch_rows=micro_batch,
        logprob_chunk_tokens=chunk, recompute_chunk=batch, optimizer=optimizer)
    return memory_plan.phases["update"]


def memory_shape(args) -> dict:
    """plan_update_bytes' keywords for the --memory-* step."""
    return dict(chunk=args.logprob_chunk, batch=args.memory_batch,
                micro_batch=args.memory_micro_batch, seq=args.memory_seq,
                response_len=args.memory_response_len)


def peak_memory(args, cfg, impl: str, sharding=None) -> dict:
    """Compiled-memory analysis of the full-shape train step, from abstract shapes only, printed
    beside plan mode's "update" figure for the same shape; `sharding` places the abstract state
    and batch (a compile-only GPU's device: --compile-for)."""
    shape = memory_shape(args)
    step, state, batch = abstract_step(cfg, impl=impl, **shape)
    if sharding is not None:
        state, batch = timing.abstract_like((state, batch), sharding)
    plan_bytes = plan_update_bytes(cfg, **shape)
    start = time.perf_counter()
    memory = timing.print_compiled_memory(
        f"train step ({cfg.remat_policy}, {cfg.attention}, {impl})", step, state, batch,
        plan_bytes=plan_bytes)
    return {"compile_s": time.perf_counter() - start, **memory,
            "plan_update_bytes": plan_bytes,
            "plan_gib": plan_bytes / 2 ** 30,
            "peak_estimate_gib": memory.get("peak_estimate_bytes", 0) / 2 ** 30,
            "temp_gib": memory.get("temp_bytes", 0) / 2 ** 30}


def print_skipped(rows) -> None:
    """One line per skipped remat / attention pair (the reason is the same for every log-prob)."""
    reasons = {(r["remat"], r["attention"]): r["skipped"] for r in rows if "skipped" in r}
    for (remat, attention), reason in reasons.items():
        print(f"skipped remat={remat} attention={attention}: {reason}")


KEY_COLUMNS = [("remat", "remat", "37s"), ("attention", "attention", "9s"),
               ("attn run", lambda r: "skipped" if "skipped" in r else r["attention_run"], "9s"),
               ("logprob", "logprob", "8s")]


def scaled(key: str, factor: float):
    """A print_table column key: row[key] * factor, blank where the row has no such value."""
    return lambda row: None if row.get(key) is None else row[key] * factor


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--response-len", type=int, default=3072,
                        help="response columns of the sequence (the rest is prompt)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2,
                        help="rows per micro-batch (0: the whole batch at once)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--remat", nargs="+", default=["full", "dots_with_no_batch_dims_saveable"],
                        choices=["auto", *models.REMAT_POLICIES],
                        help="model.remat values; auto = what the run config's model.remat=auto "
                             "picks for this step (delta_jax.plan.pick_remat)")
    parser.add_argument("--device-memory-gb", type=float, default=80.0,
                        help="capacity --remat auto plans against where the backend reports no "
                             "allocator limit (the CPU)")
    parser.add_argument("--attention", nargs="+", default=["auto", "xla"],
                        choices=list(CHOICES["model.attention"]),
                        help="model.attention values (auto = cuDNN on an NVIDIA GPU in bf16)")
    parser.add_argument("--logprob-chunk", type=int, default=4096,
                        help="tokens (rows x positions) per LM-head chunk "
                             "(model.logprob_chunk_tokens)")
    parser.add_argument("--logprob-impls", nargs="+", default=["chunked", "fused"],
                        choices=list(CHOICES["model.logprob_impl"]))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="data-sheet peak TFLOP/s for MFU (default: 989 on H100/H200, "
                             "none elsewhere)")
    parser.add_argument("--peak-matmul-size", type=int, default=None,
                        help="side of the square matmul whose measured rate is the second MFU "
                             "peak (default 8192 on a GPU, 2048 elsewhere)")
    parser.add_argument("--memory-preset", default="qwen3-1.7b")
    parser.add_argument("--memory-seq", type=int, default=4096)
    parser.add_argument("--memory-response-len", type=int, default=3072)
    parser.add_argument("--memory-batch", type=int, default=8)
    parser.add_argument("--memory-micro-batch", type=int, default=2)
    parser.add_argument("--memory-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="parameter and activation dtype of the memory analysis (the recipes' bf16)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters of this rank with the run config's default "
                             "targets and alpha instead of every weight (0: full fine-tuning)")
    parser.add_argument("--profile", default="",
                        help="a folder: trace one more train step per timed row there and "
                             "print its device time by kernel")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--compile-for", default=None, choices=["h100", "h200", "v5p", "v5e"],
                        help="compile the memory analysis's step for this GPU, or the first chip "
                             "of this TPU slice, without one (needs jax's CUDA plugin, or "
                             "libtpu, and --skip-throughput; benchmarks/gpu_program.py)")
    parser.add_argument("--out", default="benchmarks/results/train_throughput.json")
    args = parser.parse_args(argv)
    xla_env.apply_default_flags()  # the product's XLA flags (as delta_jax.main), before JAX starts
    if not 0 < args.response_len < args.seq or not 0 < args.memory_response_len < args.memory_seq:
        parser.error("response lengths must lie in (0, seq)")
    if args.lora_rank < 0:
        parser.error("--lora-rank must be >= 0")
    if args.compile_for and not (args.skip_throughput and not args.skip_memory):
        parser.error("--compile-for compiles the memory analysis only: give --skip-throughput "
                     "and not --skip-memory")
    for batch, micro in ((args.batch, args.micro_batch),
                         (args.memory_batch, args.memory_micro_batch)):
        if 0 < micro < batch and batch % micro:
            parser.error("batch sizes must be multiples of their micro-batch sizes")

    print(f"device: {timing.device_description()}")
    lora = f" + LoRA rank {args.lora_rank}" if args.lora_rank else ""  # for the table titles
    payload = {}
    if not args.skip_throughput:
        if args.peak_tflops:
            sheet, sheet_source = args.peak_tflops * 1e12, "--peak-tflops"
        else:
            sheet, sheet_source = datasheet_peak_flops()
        size = args.peak_matmul_size or (8192 if jax.default_backend() == "gpu" else 2048)
        matmul, matmul_source, matmul_calls = measured_peak_flops(jnp.dtype(args.dtype), size,
                                                                  args.iters)
        print(f"peaks for MFU: sheet {'n/a' if sheet is None else f'{sheet / 1e12:.2f} TFLOP/s'} "
              f"({sheet_source}); matmul {matmul / 1e12:.2f} TFLOP/s ({matmul_source})")
        peaks = {"sheet": sheet, "matmul": matmul}
        rows = sweep(args, "timing the train step", args.preset, args.layers, args.dtype,
                     dict(chunk=args.logprob_chunk, batch=args.batch, micro_batch=args.micro_batch,
                          seq=args.seq, response_len=args.response_len),
                     lambda cfg, impl: throughput(args, cfg, impl, peaks))
        timing.print_table(
            f"train step: {args.preset}{f' x{args.layers} layers' if args.layers else ''}{lora}, "
            f"batch {args.batch} (micro {args.micro_batch or args.batch}) x seq {args.seq} "
            f"(response {args.response_len}), {args.dtype}",
            KEY_COLUMNS + [
                ("fwd ms", scaled("forward_s", 1e3), "10.1f"),
                ("fwd+bwd ms", scaled("fwd_bwd_s", 1e3), "11.1f"),
                ("optim ms", scaled("optimizer_s", 1e3), "10.1f"),
                ("step ms", scaled("step_s", 1e3), "10.1f"),
                ("tokens/s", "tokens_per_s", "10.0f"), ("TFLOP/s", "achieved_tflops", "9.3f"),
                ("MFU sheet", lambda r: None if "skipped" in r else "n/a" if r["mfu_sheet"] is None
                 else f"{100 * r['mfu_sheet']:.1f}", ">10s"),
                ("MFU matmul", scaled("mfu_matmul", 100), "11.1f")], rows)
        print_skipped(rows)
        payload.update(peak_sheet_tflops=None if sheet is None else sheet / 1e12,
                       peak_sheet_source=sheet_source, peak_matmul_tflops=matmul / 1e12,
                       peak_matmul_source=matmul_source, peak_matmul_calls=matmul_calls,
                       throughput=rows)
    if not args.skip_memory:
        target, sharding = contextlib.nullcontext(), None
        if args.compile_for:
            import gpu_program  # a sibling benchmark: the deviceless GPU compile
            device = gpu_program.compile_only_device(args.compile_for, gpu_program.CUDNN_VERSION,
                                                     gpu_program.CUDA_VERSION)
            target, sharding = jax.default_device(device), jax.sharding.SingleDeviceSharding(device)
            print(f"compiling for {device.device_kind} (compile only, "
                  + (gpu_program.TPU_TARGETS[args.compile_for]
                     if args.compile_for in gpu_program.TPU_TARGETS else
                     f"cuDNN {gpu_program.CUDNN_VERSION}, CUDA {gpu_program.CUDA_VERSION}") + ")")
        with target:
            rows = sweep(args, f"compiling the {args.memory_preset} step for its memory analysis",
                         args.memory_preset, None, args.memory_dtype, memory_shape(args),
                         lambda cfg, impl: peak_memory(args, cfg, impl, sharding))
        timing.print_table(
            f"compiled train-step memory: {args.memory_preset}{lora}, batch {args.memory_batch} "
            f"(micro {args.memory_micro_batch}) x seq {args.memory_seq} "
            f"(response {args.memory_response_len}), {args.memory_dtype}",
            KEY_COLUMNS + [("peak GiB", "peak_estimate_gib", "9.2f"),
                           ("temp GiB", "temp_gib", "9.2f"), ("plan GiB", "plan_gib", "9.2f"),
                           ("compile s", "compile_s", "10.1f")], rows)
        print_skipped(rows)
        payload["memory"] = rows
    timing.write_json(args.out, payload, args=args)


if __name__ == "__main__":
    main()
