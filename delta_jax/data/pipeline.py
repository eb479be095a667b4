"""Grain pipelines of prompt batches with deterministic per-epoch shuffling and resumable state.

    source (random access: RecordSource from builders.py, or any list of record dicts)
      -> this host's shard: records shard_index, shard_index + shard_count, ...
      -> shuffle with seed + epoch (grain's per-epoch index shuffle), repeat num_epochs
      -> add "prompt" = template(problem), "epoch" (and "prompt_ids" when an encode_fn is given)
      -> batches: lists of record dicts (they may span an epoch boundary)

The iterator's state is a small JSON-serialisable dict (grain's position plus the settings it
depends on), so the trainer can save it next to an Orbax checkpoint and resume mid-epoch with the
identical remaining order.
"""
from __future__ import annotations

from typing import Callable, Sequence

import grain

from delta_jax.data import templates as templates_lib

STATE_VERSION = 1


class PromptIterator:
    """Iterates batches (list[dict]) of records with a "prompt"; get_state()/set_state() resume."""

    def __init__(self, dataset: "grain.IterDataset", settings: dict):
        self._dataset = dataset
        self._iterator = iter(dataset)
        self.settings = settings  # what the order depends on; checked on restore

    @property
    def num_records(self) -> int:
        """Records in this host's shard (one epoch)."""
        return self.settings["num_records"]

    @property
    def batches_per_epoch(self) -> float:
        return self.num_records / self.settings["batch_size"]

    def __iter__(self) -> "PromptIterator":
        return self

    def __next__(self) -> list[dict]:
        return next(self._iterator)

    def get_state(self) -> dict:
        """JSON-serialisable position: {"version", "settings", "grain"}."""
        return {"version": STATE_VERSION, "settings": dict(self.settings), "grain": self._iterator.get_state()}

    def set_state(self, state: dict) -> None:
        """Resume at a position from get_state() (of an iterator built with the same settings)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "grain" not in state:
            raise ValueError(f"not a PromptIterator state (version {STATE_VERSION}): {state!r}")
        saved = state.get("settings", {})
        diff = {k: (saved.get(k), v) for k, v in self.settings.items() if saved.get(k) != v}
        if diff:
            raise ValueError(
                "the saved data-iterator state was made with other pipeline settings "
                f"(saved, current): {diff}; resuming would not continue the same order"
            )
        self._iterator.set_state(state["grain"])


def make_prompt_pipeline(
    source: Sequence[dict],
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    template: str | templates_lib.PromptTemplate | Callable[[str], str] | None = "qwen_math",
    shard_index: int = 0,
    shard_count: int = 1,
    drop_remainder: bool = False,
    encode_fn: Callable[[str], Sequence[int]] | None = None,
    num_threads: int = 1,
    prefetch_buffer_size: int | None = None,
) -> PromptIterator:
    """Batches of {id, problem, answer, solution, level, index?, epoch, prompt[, prompt_ids]}.

    Args:
      source: random-access records (len() and [i]); e.g. builders.build_tfds_source(...).
      batch_size: prompts per batch (per host).
      seed: shuffle seed; epoch e uses seed + e, so every epoch has its own order.
      shuffle: False keeps the source order (evaluation).
      num_epochs: None repeats forever; else stop after that many passes.
      template: a templates.KINDS name, a PromptTemplate or any str -> str callable (None: the
        problem as is).
      shard_index, shard_count: this host takes records shard_index::shard_count (disjoint shards
        that cover the data), e.g. jax.process_index(), jax.process_count().
      drop_remainder: drop a last incomplete batch (only matters when num_epochs is finite).
      encode_fn: optional str -> token ids (e.g. lambda s: tok.encode(s)); adds "prompt_ids".
      num_threads, prefetch_buffer_size: grain read threads and read-ahead (elements).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be None or >= 1, got {num_epochs}")
    template_fn = templates_lib.make_template(template)

    ds = grain.MapDataset.source(source)[shard_index::shard_count]
    num_records = len(ds)
    if num_records == 0:
        raise ValueError(
            f"shard {shard_index} of {shard_count} is empty: the source has only {len(source)} records"
        )
    if shuffle:
        ds = ds.shuffle(seed=seed)  # indices past one epoch reshuffle with seed + epoch
    ds = ds.repeat(num_epochs)

    def add_prompt(index: int, record: dict) -> dict:
        out = dict(record)
        out["epoch"] = index // num_records
        out["prompt"] = template_fn(out["problem"])
        if encode_fn is not None:
            out["prompt_ids"] = list(encode_fn(out["prompt"]))
        return out

    ds = ds.map_with_index(add_prompt)
    read_options = grain.ReadOptions(
        num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size or 2 * batch_size
    )
    iter_ds = ds.to_iter_dataset(read_options).batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
    settings = {
        "num_records": num_records,
        "batch_size": batch_size,
        "seed": seed,
        "shuffle": shuffle,
        "num_epochs": num_epochs,
        "shard_index": shard_index,
        "shard_count": shard_count,
    }
    return PromptIterator(iter_ds, settings)
