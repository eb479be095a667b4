"""Everything the tiny default run needs, made locally: synthetic train/test JSONL + tiny tokenizer.

    paths = prepare_tiny_task("/tmp/delta_jax_tiny")
    # {"train": ".../train.jsonl", "test": ".../test.jsonl", "tokenizer": ".../tokenizer"}

Idempotent: a manifest records the arguments, and files are rewritten only when they change.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from delta_jax.data import synthetic, tiny_tokenizer

_MANIFEST = "tiny_task.json"


def prepare_tiny_task(
    out_dir: str,
    num_train: int = 20_000,
    num_test: int = 500,
    seed: int = 0,
    levels: Sequence[int] = (1, 2, 3, 4),
) -> dict[str, str]:
    """Write (or reuse) <out_dir>/{train,test}.jsonl and <out_dir>/tokenizer/; returns their paths."""
    paths = {
        "train": os.path.join(out_dir, "train.jsonl"),
        "test": os.path.join(out_dir, "test.jsonl"),
        "tokenizer": os.path.join(out_dir, "tokenizer"),
    }
    manifest = {
        "num_train": num_train, "num_test": num_test, "seed": seed, "levels": list(levels),
        "vocab_size": tiny_tokenizer.DEFAULT_VOCAB_SIZE, "format": 1,
    }
    manifest_path = os.path.join(out_dir, _MANIFEST)
    if os.path.isfile(manifest_path) and all(os.path.exists(p) for p in paths.values()):
        with open(manifest_path) as f:
            if json.load(f) == manifest:
                return paths
    synthetic.write_synthetic_splits(out_dir, num_train, num_test, seed=seed, levels=levels)
    tiny_tokenizer.build_tiny_tokenizer(paths["tokenizer"])
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return paths
