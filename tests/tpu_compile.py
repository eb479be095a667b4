"""Programs compiled for a Cloud TPU on a machine without one: libtpu's TPU compiler (jax's `tpu`
extra; scripts/test.sh places it in .tpu-compile beside the venv), given a slice's topology by
name (jax.experimental.topologies), compiles from abstract arguments; nothing runs.

The compiles run in a subprocess (`python -m tests.tpu_compile OUT ...`, which writes each
program's optimized HLO to OUT/<name>.hlo): once libtpu is loaded into a process, JAX's profiler
there records no CPU kernels (tests/test_decode_throughput.py's profiled runs read empty traces
after it), so no pytest worker loads it. Tests that need it skip where libtpu is not installed.
"""
import argparse
import functools
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# A v5p slice of 2 x 2 chips (one host): four TPU v5 devices of 95 GB each.
TOPOLOGY = "v5p:2x2x1"
# Decode programs' slots, page size and pages a sequence; "sharded": 4 slots a chip over the 4.
SLOTS, PAGE_SIZE, PAGES_PER_SEQ, SLOTS_PER_CHIP = 8, 16, 8, 4


def tpu_model():
    """A Qwen3-shaped bf16 model small enough to compile in seconds: 8 KV heads of 128 (Qwen3's),
    so a page pool [8, pages, page_size, 128] is laid out on a TPU as the real models' are."""
    import jax.numpy as jnp
    from delta_jax import models
    return models.get_preset("tiny", num_kv_heads=8, num_heads=16, head_dim=128, hidden_size=256,
                             intermediate_size=512, vocab_size=1024, dtype=jnp.bfloat16,
                             param_dtype=jnp.bfloat16)


def run_compiling_for_a_tpu(command: list) -> subprocess.CompletedProcess:
    """`command` (python arguments) run in the repository by a subprocess that may load libtpu
    (module docstring), asserted to succeed; skips where libtpu is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("compiling for a TPU without one needs libtpu: pip install 'jax[tpu]' "
                    "(scripts/test.sh places it in .tpu-compile)")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               # an executable compiled without its device cannot be read back from the cache
               JAX_COMPILATION_CACHE_DIR="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), *sys.path])))
    done = subprocess.run([sys.executable, *command], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def compiled_for_a_tpu(tmp_path, *args) -> dict:
    """{program name: optimized HLO text} of `python -m tests.tpu_compile tmp_path *args`
    (run_compiling_for_a_tpu)."""
    run_compiling_for_a_tpu(["-m", "tests.tpu_compile", str(tmp_path), *args])
    return {p.stem: p.read_text() for p in pathlib.Path(tmp_path).glob("*.hlo")}


def write_then_read(write, pool, pages, offsets, values, tables):
    """A decode loop's use of one pool in miniature: each step writes a token per row (`write`)
    and reads each row's first pages (the page reader's gather)."""
    import jax
    import jax.numpy as jnp

    def step(i, carry):
        pool, acc = carry
        pool = write(pool, pages + i, offsets, values)
        read = pool[:, tables]                                # [K, B, pages, page_size, D]
        return pool, acc + jnp.sum(read.astype(jnp.float32), axis=(0, 2, 3))
    return jax.lax.fori_loop(0, 4, step, (pool, jnp.zeros(values.shape[::2], jnp.float32)))


def window_write(pool, pages, offsets, values):
    """The page write as attention.write_pages wrote it until 2026-11-28: a [K, D] window at each
    (page, offset)."""
    import jax.numpy as jnp
    return pool.at[:, pages, offsets].set(jnp.swapaxes(values, 0, 1), mode="drop",
                                          unique_indices=True)


def main(argv=None):
    p = argparse.ArgumentParser(description="compile the rollout engine's programs for a TPU")
    p.add_argument("out")
    p.add_argument("--impl", default="reference", help="rollout.decode_attention")
    p.add_argument("--sharded", action="store_true",
                   help="only the decode program, over a (data=4) mesh of the slice's 4 chips")
    args = p.parse_args(argv)
    import numpy as np
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from delta_jax import models
    from delta_jax.kernels.timing import abstract_like
    from delta_jax.models import attention
    from delta_jax.sampling import programs

    chips = list(topologies.get_topology_desc(topology_name=TOPOLOGY, platform="tpu").devices)
    out = pathlib.Path(args.out)

    def save(name, compiled):
        (out / f"{name}.hlo").write_text(compiled.as_text())

    cfg = tpu_model()
    graphdef, state = nnx.split(nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0))))
    K = cfg.num_kv_heads
    if args.sharded:
        mesh = Mesh(np.array(chips).reshape(4, 1, 1), ("data", "fsdp", "tensor"))
        slots, num_pages = 4 * SLOTS_PER_CHIP, 4 * (1 + SLOTS_PER_CHIP * PAGES_PER_SEQ)
        pools = NamedSharding(mesh, attention.pool_specs(mesh, ("data",), K)[0])
        placed = NamedSharding(mesh, PartitionSpec())
        rows = NamedSharding(mesh, PartitionSpec("data"))
        batch_spec = (mesh, ("data",))
    else:
        slots, num_pages = SLOTS, 1 + SLOTS * PAGES_PER_SEQ
        pools = placed = rows = jax.sharding.SingleDeviceSharding(chips[0])
        batch_spec = None
    cache = abstract_like(jax.eval_shape(lambda: models.init_paged_cache(cfg, num_pages,
                                                                         PAGE_SIZE)), pools)

    def ints(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=placed)

    with jax.default_device(chips[0]):  # the model's dispatch sees a TPU
        decode_args = programs.abstract_decode_args(graphdef, state, cache, slots, PAGES_PER_SEQ,
                                                    sharding=placed, row_sharding=rows)
        decode_args = decode_args[:3] + (cache,) + decode_args[4:]  # the pools' own sharding
        save("decode", programs.decode.lower(
            *decode_args, num_steps=4, top_k=-1, use_top_p=False, greedy=False,
            attention_impl=args.impl, pages_per_block=4, batch_spec=batch_spec).compile())
        if args.sharded:
            return 0
        (out / "auto.txt").write_text(attention.resolve_decode_impl(
            "auto", dtype=cfg.dtype, head_dim=cfg.head_dim, page_size=PAGE_SIZE,
            group=cfg.num_heads // K))
        layers = abstract_like(jax.eval_shape(programs.decode_layers, graphdef, state), placed)
        save("prefill", programs.prefill.lower(graphdef, abstract_like(state, placed), layers,
                                               cache,
                                               ints(4, 64), ints(4, 64), ints(4, 64),
                                               ints(4, 64)).compile())
        save("copy_pages", programs.copy_pages.lower(cache, ints(4), ints(4)).compile())
        pool = jax.ShapeDtypeStruct((K, num_pages, PAGE_SIZE, cfg.head_dim), jnp.bfloat16,
                                    sharding=placed)
        values = jax.ShapeDtypeStruct((slots, K, cfg.head_dim), jnp.bfloat16, sharding=placed)
        loop_args = (pool, ints(slots), ints(slots), values, ints(slots, 2))
        for name, write in (("window_write", window_write), ("write_pages", attention.write_pages)):
            save(name, jax.jit(functools.partial(write_then_read, write), donate_argnums=0).lower(
                *loop_args).compile())
    return 0


if __name__ == "__main__":
    sys.exit(main())
