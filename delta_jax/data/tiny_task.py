"""The locally made assets of runs on the synthetic task (data.train / data.eval = "synthetic",
tokenizer.path = "synthetic"); train.run.prepare_assets calls these for the run's workdir.

    splits = prepare_synthetic_splits(out_dir, num_train, num_test, seed, levels,
                                      steps=0, digits=2, distractors=0)
    # {"train": "<out_dir>/train.jsonl", "test": "<out_dir>/test.jsonl"}
    tok_dir = prepare_tiny_tokenizer("<workdir>/tokenizer")

Both are idempotent: a manifest records what the files were made from, and they are rewritten
only when that changes (other data.synthetic_* values give other data, never the old files).
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from delta_jax.data import synthetic, tiny_tokenizer

_MANIFEST = "manifest.json"


def _up_to_date(out_dir: str, manifest: dict, paths: Sequence[str]) -> bool:
    path = os.path.join(out_dir, _MANIFEST)
    if not (os.path.isfile(path) and all(os.path.exists(p) for p in paths)):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f) == manifest
    except (OSError, ValueError):
        return False  # unreadable: make the files again


def _write_manifest(out_dir: str, manifest: dict):
    with open(os.path.join(out_dir, _MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def prepare_synthetic_splits(out_dir: str, num_train: int = 20_000, num_test: int = 500,
                             seed: int = 0, levels: Sequence[int] = (1, 2, 3, 4), *,
                             steps: int = 0, digits: int = synthetic.DEFAULT_DIGITS,
                             distractors: int = 0) -> dict[str, str]:
    """Writes (or reuses) <out_dir>/{train,test}.jsonl of the synthetic arithmetic task
    (data.synthetic.write_synthetic_splits, with its difficulty knobs steps / digits /
    distractors); returns their paths."""
    paths = {"train": os.path.join(out_dir, "train.jsonl"),
             "test": os.path.join(out_dir, "test.jsonl")}
    manifest = {"num_train": int(num_train), "num_test": int(num_test), "seed": int(seed),
                "levels": [int(x) for x in levels], "steps": int(steps), "digits": int(digits),
                "distractors": int(distractors), "format": 1}
    if not _up_to_date(out_dir, manifest, list(paths.values())):
        synthetic.write_synthetic_splits(out_dir, num_train, num_test, seed=seed, levels=levels,
                                         steps=steps, digits=digits, distractors=distractors)
        _write_manifest(out_dir, manifest)
    return paths


def prepare_tiny_tokenizer(out_dir: str) -> str:
    """Writes (or reuses) the tiny tokenizer of the synthetic task in out_dir; returns out_dir."""
    manifest = {"vocab_size": tiny_tokenizer.DEFAULT_VOCAB_SIZE, "format": 1}
    if not _up_to_date(out_dir, manifest, [os.path.join(out_dir, "tokenizer.json")]):
        tiny_tokenizer.build_tiny_tokenizer(out_dir)
        _write_manifest(out_dir, manifest)
    return out_dir
