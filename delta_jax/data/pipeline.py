"""Grain pipelines of prompt batches with deterministic per-epoch shuffling and resumable state.

    source (random access: RecordSource from builders.py, or any list of record dicts)
      -> records whose prompt is over max_prompt_tokens left out (counted) or refused
      -> this host's shard: records shard_index, shard_index + shard_count, ...
      -> shuffle with seed + epoch (grain's per-epoch index shuffle), repeated without end
      -> add "prompt" = template(problem), "epoch" (and "prompt_ids" when an encode_fn is given)
      -> batches: lists of record dicts (they may span an epoch boundary)

The iterator's state is a small JSON-serialisable dict (grain's position plus the settings it
depends on), so the trainer can save it next to an Orbax checkpoint and resume mid-epoch with the
identical remaining order.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import grain

from delta_jax.data import templates as templates_lib
from delta_jax.errors import InputError

log = logging.getLogger("delta_jax.data")
STATE_VERSION = 1
OVERLONG_PROMPTS = ("drop", "error", "truncate")


class _Subset:
    """The records of `source` at `indices` (random access, in that order)."""

    def __init__(self, source: Sequence[dict], indices: Sequence[int]):
        self._source, self._indices = source, list(indices)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i: int) -> dict:
        return self._source[self._indices[i]]


def prompt_lengths(source: Sequence[dict], template_fn: Callable[[str], str],
                   encode_batch_fn: Callable[[list[str]], Sequence[Sequence[int]]],
                   chunk: int = 4096) -> list[int]:
    """Token count of every record's prompt (template(problem)), in source order; records are
    read and encoded `chunk` at a time (a source's __getitems__ reads many at once: 100k records
    of an ArrayRecord source in ~5 s where one by one took ~30 s)."""
    many = getattr(source, "__getitems__", None)
    out = []
    for start in range(0, len(source), chunk):
        index = range(start, min(start + chunk, len(source)))
        rows = many(index) if many is not None else [source[i] for i in index]
        out += [len(ids) for ids in encode_batch_fn([template_fn(r["problem"]) for r in rows])]
    return out


def within_prompt_limit(source: Sequence[dict], template_fn, encode_batch_fn, max_tokens: int,
                        overlong: str, name: str = "data.train"):
    """(the records of `source` whose prompt has at most max_tokens tokens, how many were left
    out, the longest prompt). overlong: "drop" leaves the longer ones out (an error when none
    is left), "error" refuses the data when any is longer, "truncate" keeps them all (the sampler
    keeps a long prompt's last max_tokens tokens)."""
    if overlong not in OVERLONG_PROMPTS:
        raise InputError(f"data.overlong_prompts: must be one of {OVERLONG_PROMPTS}, got "
                         f"{overlong!r}")
    if overlong == "truncate":
        return source, 0, None
    t0 = time.perf_counter()
    lengths = prompt_lengths(source, template_fn, encode_batch_fn)
    if len(lengths) >= 10000:
        log.info("%s: measured %d prompts in %.1f s", name, len(lengths), time.perf_counter() - t0)
    keep = [i for i, n in enumerate(lengths) if n <= max_tokens]
    dropped, longest = len(lengths) - len(keep), max(lengths, default=0)
    what = (f"{dropped} of {len(lengths)} records of {name} have a prompt over "
            f"data.max_prompt_len={max_tokens} tokens (the longest: {longest})")
    if dropped and overlong == "error":
        raise InputError(f"{what}; raise data.max_prompt_len, or set data.overlong_prompts to "
                         "'drop' (leave them out) or 'truncate' (keep their last tokens)")
    if not keep:
        raise InputError(f"{what}: none is left; raise data.max_prompt_len")
    return (_Subset(source, keep) if dropped else source), dropped, longest


class PromptIterator:
    """Iterates batches (list[dict]) of records with a "prompt"; get_state()/set_state() resume."""

    def __init__(self, dataset: "grain.IterDataset", settings: dict, num_overlong: int = 0,
                 longest_prompt: int | None = None):
        self._dataset = dataset
        self._iterator = iter(dataset)
        self.settings = settings  # what the order depends on; checked on restore
        self.num_overlong = num_overlong      # records left out: prompt over max_prompt_tokens
        self.longest_prompt = longest_prompt  # tokens, over all records (None: not measured)

    @property
    def num_records(self) -> int:
        """Records in this host's shard (one epoch)."""
        return self.settings["num_records"]

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
            hint = ""
            if "num_records" in diff and self.num_overlong:
                hint = (f" ({self.num_overlong} records with a prompt over the length limit are "
                        "left out now; a run started when they were kept resumes with "
                        "data.overlong_prompts=truncate)")
            raise InputError(
                "the saved data-iterator state was made with other pipeline settings "
                f"(saved, current): {diff}; resuming would not continue the same order{hint}"
            )
        self._iterator.set_state(state["grain"])


def make_prompt_pipeline(
    source: Sequence[dict],
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    template: str | templates_lib.PromptTemplate | Callable[[str], str] | None = "qwen_math",
    shard_index: int = 0,
    shard_count: int = 1,
    encode_fn: Callable[[str], Sequence[int]] | None = None,
    num_threads: int = 1,
    prefetch_buffer_size: int | None = None,
    max_prompt_tokens: int | None = None,
    overlong_prompts: str = "drop",
    encode_batch_fn: Callable[[list[str]], Sequence[Sequence[int]]] | None = None,
) -> PromptIterator:
    """Batches of {id, problem, answer, solution, level, index?, epoch, prompt[, prompt_ids]},
    epoch after epoch without end (the trainer stops after train.steps).

    Args:
      source: random-access records (len() and [i]); e.g. builders.build_tfds_source(...).
      batch_size: prompts per batch (per host).
      seed: shuffle seed; epoch e uses seed + e, so every epoch has its own order.
      shuffle: False keeps the source order in every epoch (data.shuffle).
      template: a templates.KINDS name, a PromptTemplate or any str -> str callable (None: the
        problem as is).
      shard_index, shard_count: this host takes records shard_index::shard_count (disjoint shards
        that cover the data), e.g. jax.process_index(), jax.process_count().
      encode_fn: optional str -> token ids (e.g. lambda s: tok.encode(s)); adds "prompt_ids".
      num_threads, prefetch_buffer_size: grain read threads and read-ahead (elements).
      max_prompt_tokens, overlong_prompts: with an encode_fn, the records whose prompt has more
        tokens are left out ("drop": counted in num_overlong, an error when none is left),
        refused ("error") or kept ("truncate"), before sharding (within_prompt_limit);
        encode_batch_fn (list of str -> token ids each; default: encode_fn on each) measures
        them a chunk at a time (e.g. a fast tokenizer's batch encode).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    template_fn = templates_lib.make_template(template)
    num_overlong, longest = 0, None
    if max_prompt_tokens is not None:
        if encode_fn is None:
            raise ValueError("max_prompt_tokens needs an encode_fn (prompts are measured in "
                             "tokens)")
        batch_fn = encode_batch_fn or (lambda texts: [encode_fn(t) for t in texts])
        source, num_overlong, longest = within_prompt_limit(
            source, template_fn, batch_fn, max_prompt_tokens, overlong_prompts)

    ds = grain.MapDataset.source(source)[shard_index::shard_count]
    num_records = len(ds)
    if num_records == 0:
        raise ValueError(
            f"shard {shard_index} of {shard_count} is empty: the source has only {len(source)} records"
        )
    if shuffle:
        ds = ds.shuffle(seed=seed)  # indices past one epoch reshuffle with seed + epoch
    ds = ds.repeat()

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
    iter_ds = ds.to_iter_dataset(read_options).batch(batch_size, batch_fn=list)
    settings = {
        "num_records": num_records,
        "batch_size": batch_size,
        "seed": seed,
        "shuffle": shuffle,
        "shard_index": shard_index,
        "shard_count": shard_count,
    }
    return PromptIterator(iter_ds, settings, num_overlong, longest)
