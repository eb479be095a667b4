"""How long reading a Hugging Face checkpoint takes, whole and by shards, and what a run that
resumes no longer reads.

Writes a random model of a preset's shape (default Qwen3-0.6B, bf16: 1.5 GB) to a directory
(or reads --path), then times, in fresh order each repeat:

  header check   models.pretrained_config: config.json and every tensor's name and shape from
                 the safetensors headers (what a resumed run or mode=eval of a checkpoint reads)
  whole          models.from_pretrained onto the default device, tensor by tensor
  by shards      models.from_pretrained with the run's sharding rules over a (1, N, 1) fsdp mesh
                 of this process's devices: each device's block read by itself

and the bytes each read took from the files (sum of the blocks read). The page cache is warm
after the first repeat (the first one is reported apart).

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python benchmarks/load_weights.py --preset qwen3-0.6b --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

GB = 1e9


def write_checkpoint(preset: str, path: str) -> None:
    """A bf16 model of the preset's shape with random values (one numpy draw a parameter, not
    the initialiser's), saved as an HF directory."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from delta_jax import models
    cfg = models.get_preset(preset, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        var.set_value(jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, jnp.bfloat16))
    models.save_pretrained(model, path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--path", default="", help="an HF directory to read instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from delta_jax import models, sharding
    from delta_jax.models import hf_io

    tmp = None
    path = args.path
    if not path:
        tmp = tempfile.TemporaryDirectory()
        path = tmp.name
        start = time.perf_counter()
        write_checkpoint(args.preset, path)
        print(f"wrote a random {args.preset} (bf16) to {path} in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                if f.endswith(".safetensors"))
    devices = jax.local_devices()
    mesh = sharding.make_mesh(1, len(devices), 1, devices=devices)
    readers = []  # each way's readers, to sum the bytes they count (_TensorReader.bytes_read)
    real_reader = hf_io._TensorReader

    class RecordedReader(real_reader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            readers.append(self)

    hf_io._TensorReader = RecordedReader
    ways = {
        "header check": lambda: models.pretrained_config(path, jnp.bfloat16),
        "whole": lambda: models.from_pretrained(path, jnp.bfloat16),
        "by shards": lambda: models.from_pretrained(
            path, jnp.bfloat16, shardings=sharding.param_sharding_fn(mesh)),
    }
    times = {name: [] for name in ways}
    read = {}
    for r in range(args.repeats + 1):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            readers.clear()
            start = time.perf_counter()
            out = ways[name]()
            if not isinstance(out, models.ModelConfig):
                jax.block_until_ready(nnx.state(out))
            elapsed = time.perf_counter() - start
            del out
            read[name] = sum(reader.bytes_read for reader in readers)
            times[name].append(elapsed)
            print(f"repeat {r}{' (cold)' if r == 0 else ''}: {name}: {elapsed:.3f} s, "
                  f"{read[name] / GB:.3f} GB read", flush=True)
    hf_io._TensorReader = real_reader
    result = {"preset": args.preset if not args.path else args.path, "files_gb": files / GB,
              "devices": len(devices), "backend": jax.default_backend(),
              "first_s": {k: v[0] for k, v in times.items()},
              "median_s": {k: statistics.median(v[1:]) for k, v in times.items()},
              "range_s": {k: [min(v[1:]), max(v[1:])] for k, v in times.items()},
              "read_gb": {k: v / GB for k, v in read.items()}}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
