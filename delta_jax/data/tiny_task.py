"""The locally made assets of runs on the synthetic task (data.train / data.eval = "synthetic",
tokenizer.path = "synthetic"); train.run.prepare_assets calls these for the run's workdir.

    splits = prepare_synthetic_splits(out_dir, num_train, num_test, seed, levels,
                                      steps=0, digits=2, distractors=0)
    # {"train": "<out_dir>/train.jsonl", "test": "<out_dir>/test.jsonl"}
    tok_dir = prepare_tiny_tokenizer("<workdir>/tokenizer")

Both are idempotent: a manifest records what the files were made from, and they are rewritten
only when that changes (other data.synthetic_* values give other data, never the old files).
They are safe for several processes of one run on a shared workdir (every host of a multi-host
job prepares them): each writes into a private directory and moves the finished files into
place (os.replace, atomic), the manifest last, so no process reads a half-written file.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable, Sequence

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


def _make(out_dir: str, manifest: dict, write: Callable[[str], object]):
    """write(private_dir) makes the files; they replace out_dir's (atomically, one by one),
    then the manifest that says what they were made from."""
    os.makedirs(out_dir, exist_ok=True)
    private = tempfile.mkdtemp(prefix=".making-", dir=out_dir)
    try:
        write(private)
        with open(os.path.join(private, _MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f)
        names = sorted(os.listdir(private))
        for name in [n for n in names if n != _MANIFEST] + [_MANIFEST]:
            os.replace(os.path.join(private, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(private, ignore_errors=True)


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
        _make(out_dir, manifest, lambda d: synthetic.write_synthetic_splits(
            d, num_train, num_test, seed=seed, levels=levels, steps=steps, digits=digits,
            distractors=distractors))
    return paths


def prepare_tiny_tokenizer(out_dir: str) -> str:
    """Writes (or reuses) the tiny tokenizer of the synthetic task in out_dir; returns out_dir."""
    manifest = {"vocab_size": tiny_tokenizer.DEFAULT_VOCAB_SIZE, "format": 1}
    if not _up_to_date(out_dir, manifest, [os.path.join(out_dir, "tokenizer.json")]):
        _make(out_dir, manifest, tiny_tokenizer.build_tiny_tokenizer)
    return out_dir
