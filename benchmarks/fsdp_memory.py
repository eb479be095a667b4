"""Plan mode against a TPU slice's compiler for FSDP-sharded programs, without a TPU.

Compiles the trainer's train step (train.step.make_train_step) and old-policy pass
(train.features.make_old_policy_pass) of a bf16 Qwen3 preset over a (data 1, fsdp N, tensor 1)
mesh of a v5p slice's N chips (libtpu, given the slice's topology by name; nothing runs: see
tests/tpu_compile.py), the state placed by the rules table, and prints XLA's memory analysis of
each per chip beside plan mode's figure for its phase (delta_jax.plan.plan_memory on the same
mesh shape). Rows: 4 per chip in micro-batches of 2 per chip, as benchmarks/train_throughput.py's
single-device default (8 rows, micro-batches of 2) scaled to the mesh.

    PYTHONPATH=.tpu-compile JAX_PLATFORMS=cpu JAX_COMPILATION_CACHE_DIR= \\
        .venv/bin/python benchmarks/fsdp_memory.py --preset qwen3-1.7b --fsdp 4 8

~70 s a compile on a 2-core VM. `--dump DIR` also writes XLA's dumps (the buffer report is
DIR/*memory-usage-report.txt).
"""
from __future__ import annotations

import argparse
import json
import os
import time

TOPOLOGIES = {4: "v5p:2x2x1", 8: "v5p:2x2x2"}
GIB = 2 ** 30


def measure(preset: str, fsdp: int, remat: str, seq: int, response_len: int,
            chunk: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from delta_jax import models, plan, sharding
    from delta_jax.train import state as state_lib
    from delta_jax.train.config import default_config, resolve_method
    from delta_jax.train.features import make_old_policy_pass
    from delta_jax.train.run import make_loss_fn
    from delta_jax.train.step import make_train_step

    chips = topologies.get_topology_desc(topology_name=TOPOLOGIES[fsdp], platform="tpu").devices
    mesh = Mesh(np.array(chips).reshape(1, fsdp, 1), ("data", "fsdp", "tensor"))
    mc = models.get_preset(preset, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, remat=remat,
                           attention="auto")
    graphdef, params, rest = state_lib.split_model(
        nnx.eval_shape(lambda: models.Transformer(mc, rngs=nnx.Rngs(0))))
    optimizer = state_lib.make_optimizer(lambda _: 1e-6)
    state, shardings = state_lib.abstract_train_state(params, optimizer, mesh)
    rows, micro = 4 * fsdp, 2 * fsdp

    def rows_of(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(shape, mesh))
    batch = {"input_ids": rows_of((rows, seq), jnp.int32),
             "attention_mask": rows_of((rows, seq), jnp.int32),
             "advantages": rows_of((rows,), jnp.float32),
             **{k: rows_of((rows, response_len), jnp.float32)
                for k in ("old_logp", "response_mask", "token_weights")}}
    step = make_train_step(graphdef, rest, optimizer, make_loss_fn(resolve_method(
        default_config())), temperature=1.0, chunk_size=chunk, micro_batch_size=micro,
        mesh=mesh, state_shardings=shardings)
    old_pass = make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=chunk, mesh=mesh)

    def peak(compiled):
        m = compiled.memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)
    start = time.perf_counter()
    compiled = {"update": peak(step.lower(state, batch).compile()),
                "old pass": peak(old_pass.lower(state.params, batch["input_ids"],
                                                batch["attention_mask"], response_len).compile())}
    p = plan.plan_memory(mc, mesh_shape=(1, fsdp, 1), device_memory_gb=95.0, rollout_rows=rows,
                         prompt_len=seq - response_len, response_len=response_len,
                         sampler_rows=rows, group_size=1, mini_batch_rows=rows,
                         micro_batch_rows=micro, logprob_chunk_tokens=chunk,
                         recompute_chunk=rows, target="tpu")
    # the old-policy phase less the optimizer state (beside the pass, no argument of it)
    planned = {"update": p.phases["update"],
               "old pass": p.phases["old-policy pass + DelTA"] - p.optimizer}
    out = {"preset": preset, "fsdp": fsdp, "remat": remat, "rows": rows, "micro_rows": micro,
           "seq": seq, "response_len": response_len, "chunk": chunk,
           "compile_s": time.perf_counter() - start}
    for name in compiled:
        out[name] = {"compiled_bytes": compiled[name], "planned_bytes": planned[name],
                     "plan_over_compiled": planned[name] / compiled[name]}
        print(f"{preset} fsdp={fsdp} remat={remat} {name}: compiled {compiled[name] / GIB:.2f} "
              f"GiB per chip, plan {planned[name] / GIB:.2f} GiB "
              f"(plan / compiled {planned[name] / compiled[name]:.2f})", flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--fsdp", type=int, nargs="+", default=[4, 8], choices=sorted(TOPOLOGIES))
    parser.add_argument("--remat", default="full")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--response-len", type=int, default=3072)
    parser.add_argument("--logprob-chunk", type=int, default=4096)
    parser.add_argument("--dump", default="", help="XLA dump directory (buffer reports)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.dump:  # before JAX starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump}"
                                   " --xla_dump_hlo_pass_re=NONE").strip()
    results = [measure(args.preset, n, args.remat, args.seq, args.response_len,
                       args.logprob_chunk) for n in args.fsdp]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
