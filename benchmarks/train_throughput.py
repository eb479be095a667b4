"""Training throughput: tokens/s and MFU of the RL train step, and its peak memory with and
without the fused LM-head log-prob.

Runs delta_jax.train.step.make_train_step (the trainer's own jitted step: forward, DAPO loss,
backward, AdamW after a global-norm clip) on a random-init preset model and a fixed random batch
of --batch sequences of --seq tokens, of which the last --response-len are the response (the
columns the loss and the LM head see).

Timing (median of --iters after --warmup, block_until_ready), for each --logprob-impls entry:
    forward       the loss only (jit)
    fwd+bwd       value_and_grad of the loss (jit)
    step          the full train step (state donated, optimizer included)
    optimizer     the optimizer alone: clip + AdamW + applying the update, on the gradients
    other         step - fwd+bwd - optimizer (the step's loop over micro-batches, metrics)
tokens/s = batch * seq / step time.

MFU = model FLOPs per step / step time / peak FLOP/s. Model FLOPs (no rematerialisation counted):
    6 * N * tokens                  N = matmul parameters outside the embedding and LM head
  + 6 * H * V * response tokens     the LM head, on the response columns only
  + 6 * L * heads * head_dim * S^2 * batch   causal attention (QK^T and PV, half the square)
Peak: --peak-tflops, default 989 on an H100/H200 (dense bf16 tensor cores), or on other devices
the matmul rate measured in this run (a --peak-matmul-size square matmul in --dtype), so a CPU
MFU says how close the step gets to that machine's own matmul speed.

Memory: XLA's static analysis of the compiled step (temporaries + arguments + outputs - aliased)
at --memory-preset / --memory-seq / --memory-batch, lowered from abstract shapes only (nothing is
allocated, so the full Qwen3-1.7B shape can be analysed on a CPU; the figure is then the CPU
compiler's buffer assignment, which is close to but not the GPU's), printed beside plan mode's
"update" figure (delta_jax.plan) for the same shape. The timed programs' own analyses (forward,
fwd+bwd, step at the throughput shape) are printed on the backend that runs them.

Issue #9 shapes (GPU):
    python benchmarks/train_throughput.py --batch 8 --micro-batch 2
CPU recording run (Qwen3-1.7B width with 2 layers, sequence 512, float32):
    python benchmarks/train_throughput.py --layers 2 --seq 512 --response-len 384 --batch 2 \
        --dtype float32 --iters 3 --warmup 1
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax import models
from delta_jax.kernels import timing
from delta_jax.train import state as state_lib
from delta_jax.train.config import default_config, resolve_method
from delta_jax.train.features import response_forward
from delta_jax.train.run import make_loss_fn
from delta_jax.train.step import make_train_step

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) from NVIDIA's data sheets.
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}


def model_config(preset: str, layers: int | None, dtype: str, remat: str, attention: str):
    overrides = dict(dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype), remat=remat, attention=attention)
    if layers:
        overrides["num_layers"] = layers
    return models.get_preset(preset, **overrides)


def model_flops(cfg, batch: int, seq: int, response_len: int) -> dict:
    """Training FLOPs of one step (forward + backward = 3x forward), by part."""
    dense = 6 * cfg.num_params(include_embeddings=False) * batch * seq
    head = 6 * cfg.hidden_size * cfg.vocab_size * batch * response_len
    attention = 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq * seq * batch
    return {"dense": dense, "lm_head": head, "attention": attention,
            "total": dense + head + attention}


def peak_flops(dtype, size: int, iters: int) -> tuple[float, str]:
    """(FLOP/s, how it was obtained): the data-sheet peak on a known GPU, else measured."""
    kind = getattr(jax.devices()[0], "device_kind", "")
    for name, tflops in GPU_PEAK_TFLOPS.items():
        if name in kind:
            return tflops * 1e12, f"{name} dense bf16 data sheet"
    a = jax.random.normal(jax.random.key(1), (size, size), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    seconds, _ = timing.median_seconds(matmul, a, a, warmup=1, iters=iters)
    return 2 * size ** 3 / seconds, f"measured {size}^3 {jnp.dtype(dtype).name} matmul"


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
    """The jitted forward, forward+backward and full train step of one model / log-prob impl."""

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

        self.forward = jax.jit(loss)
        self.fwd_bwd = jax.jit(jax.value_and_grad(loss))

        def apply_optimizer(params, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

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


def throughput(args, impl: str, peak: float) -> dict:
    cfg = model_config(args.preset, args.layers, args.dtype, args.remat, args.attention)
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
    memory = {name: timing.print_compiled_memory(f"{name} ({impl})", fn, *fn_args,
                                                 plan_bytes=plan)
              for name, fn, fn_args, plan in (
                  ("forward", programs.forward, (params, batch), None),
                  ("fwd+bwd", programs.fwd_bwd, (params, batch), None),
                  ("train step", programs.step, (state, batch), plan_bytes))}
    step_s, state = time_step(programs.step, state, batch, args.warmup, args.iters)
    flops = model_flops(cfg, args.batch, args.seq, args.response_len)
    tokens = args.batch * args.seq
    return {"impl": impl, "forward_s": fwd_s, "fwd_bwd_s": fwd_bwd_s, "step_s": step_s,
            "optimizer_s": optimizer_s,
            "other_s": step_s - fwd_bwd_s - optimizer_s, "tokens_per_s": tokens / step_s,
            "model_tflops_per_step": flops["total"] / 1e12,
            "achieved_tflops": flops["total"] / step_s / 1e12, "mfu": flops["total"] / step_s / peak,
            "flops_by_part": flops, "params": cfg.num_params(), "compiled_memory": memory}


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


def peak_memory(args, impl: str) -> dict:
    """Compiled-memory analysis of the full-shape train step, from abstract shapes only, printed
    beside plan mode's "update" figure for the same shape."""
    cfg = model_config(args.memory_preset, None, args.memory_dtype, args.remat, args.attention)
    shape = dict(chunk=args.logprob_chunk, batch=args.memory_batch,
                 micro_batch=args.memory_micro_batch, seq=args.memory_seq,
                 response_len=args.memory_response_len)
    step, state, batch = abstract_step(cfg, impl=impl, **shape)
    plan_bytes = plan_update_bytes(cfg, **shape)
    start = time.perf_counter()
    memory = timing.print_compiled_memory(f"train step ({impl})", step, state, batch,
                                          plan_bytes=plan_bytes)
    return {"impl": impl, "compile_s": time.perf_counter() - start, **memory,
            "plan_update_bytes": plan_bytes,
            "plan_gib": plan_bytes / 2 ** 30,
            "peak_estimate_gib": memory.get("peak_estimate_bytes", 0) / 2 ** 30,
            "temp_gib": memory.get("temp_bytes", 0) / 2 ** 30}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--response-len", type=int, default=3072,
                        help="response columns of the sequence (the rest is prompt)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=0, help="0: the whole batch at once")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--remat", default="full", choices=list(models.REMAT_POLICIES))
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--logprob-chunk", type=int, default=4096,
                        help="tokens (rows x positions) per LM-head chunk "
                             "(model.logprob_chunk_tokens)")
    parser.add_argument("--logprob-impls", nargs="+", default=["chunked", "fused"],
                        choices=["chunked", "fused"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak FLOP/s for MFU (default: data sheet on H100/H200, else measured)")
    parser.add_argument("--peak-matmul-size", type=int, default=2048)
    parser.add_argument("--memory-preset", default="qwen3-1.7b")
    parser.add_argument("--memory-seq", type=int, default=4096)
    parser.add_argument("--memory-response-len", type=int, default=3072)
    parser.add_argument("--memory-batch", type=int, default=8)
    parser.add_argument("--memory-micro-batch", type=int, default=2)
    parser.add_argument("--memory-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="parameter and activation dtype of the memory analysis (the recipes' bf16)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/train_throughput.json")
    args = parser.parse_args(argv)
    if not 0 < args.response_len < args.seq or not 0 < args.memory_response_len < args.memory_seq:
        parser.error("response lengths must lie in (0, seq)")
    if args.micro_batch and args.batch % args.micro_batch:
        parser.error("--batch must be a multiple of --micro-batch")

    print(f"device: {timing.device_description()}")
    payload = {}
    if not args.skip_throughput:
        if args.peak_tflops:
            peak, source = args.peak_tflops * 1e12, "--peak-tflops"
        else:
            peak, source = peak_flops(jnp.dtype(args.dtype), args.peak_matmul_size, args.iters)
        print(f"peak for MFU: {peak / 1e12:.2f} TFLOP/s ({source})")
        rows = []
        for impl in args.logprob_impls:
            print(f"timing the train step, logprob_impl={impl} ...", flush=True)
            rows.append(throughput(args, impl, peak))
        timing.print_table(
            f"train step: {args.preset}{f' x{args.layers} layers' if args.layers else ''}, "
            f"batch {args.batch} x seq {args.seq} (response {args.response_len}), {args.dtype}, "
            f"remat {args.remat}",
            [("logprob", "impl", "9s"), ("fwd ms", lambda r: r["forward_s"] * 1e3, "10.1f"),
             ("fwd+bwd ms", lambda r: r["fwd_bwd_s"] * 1e3, "11.1f"),
             ("optim ms", lambda r: r["optimizer_s"] * 1e3, "10.1f"),
             ("step ms", lambda r: r["step_s"] * 1e3, "10.1f"),
             ("tokens/s", "tokens_per_s", "10.0f"), ("TFLOP/s", "achieved_tflops", "9.3f"),
             ("MFU", lambda r: 100 * r["mfu"], "7.1f")], rows)
        payload.update(peak_tflops=peak / 1e12, peak_source=source, throughput=rows)
    if not args.skip_memory:
        rows = []
        for impl in args.logprob_impls:
            print(f"compiling the {args.memory_preset} step for its memory analysis, "
                  f"logprob_impl={impl} ...", flush=True)
            rows.append(peak_memory(args, impl))
        timing.print_table(
            f"compiled train-step memory: {args.memory_preset}, batch {args.memory_batch} "
            f"(micro {args.memory_micro_batch}) x seq {args.memory_seq} "
            f"(response {args.memory_response_len}), {args.memory_dtype}, remat {args.remat}",
            [("logprob", "impl", "9s"), ("peak GiB", "peak_estimate_gib", "9.2f"),
             ("temp GiB", "temp_gib", "9.2f"), ("plan GiB", "plan_gib", "9.2f"),
             ("compile s", "compile_s", "10.1f")], rows)
        payload["memory"] = rows
    timing.write_json(args.out, payload, args=args)


if __name__ == "__main__":
    main()
