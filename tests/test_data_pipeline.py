"""Grain prompt pipeline over the tfds source: resumable state, per-epoch shuffling, sharding."""
import collections
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from delta_jax.data import builders, pipeline, templates

NUM_JSONL, NUM_PARQUET = 23, 14  # 37 records: batches do not divide epochs evenly


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_data")
    with open(tmp / "a.jsonl", "w") as f:
        for i in range(NUM_JSONL):
            f.write(json.dumps({"id": f"j{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n")
    pq.write_table(
        pa.table({
            "id": [f"p{i}" for i in range(NUM_PARQUET)],
            "problem": [f"What is {i} * 2?" for i in range(NUM_PARQUET)],
            "answer": [str(2 * i) for i in range(NUM_PARQUET)],
        }),
        tmp / "b.parquet",
    )
    return builders.build_tfds_source([tmp / "a.jsonl", tmp / "b.parquet"], name="pipe", data_dir=tmp / "tfds")


ALL_IDS = {f"j{i}" for i in range(NUM_JSONL)} | {f"p{i}" for i in range(NUM_PARQUET)}


def ids(batches):
    return [r["id"] for batch in batches for r in batch]


def take(it, n):
    return [next(it) for _ in range(n)]


def first_records(it, n):
    """The first n records the (endless) pipeline yields, batch boundaries ignored."""
    records = []
    while len(records) < n:
        records += next(it)
    return records[:n]


def test_batches_carry_prompt_and_fields(source):
    it = pipeline.make_prompt_pipeline(source, batch_size=4, seed=0, template="qwen_math")
    batch = next(it)
    assert len(batch) == 4
    for rec in batch:
        assert rec["prompt"] == templates.PromptTemplate("qwen_math")(rec["problem"])
        assert rec["problem"] in rec["prompt"]
        assert rec["epoch"] == 0
        assert set(rec) >= {"id", "problem", "answer", "prompt"}


def test_each_epoch_is_a_permutation_and_epochs_differ(source):
    n = len(source)
    it = pipeline.make_prompt_pipeline(source, batch_size=5, seed=3)
    records = first_records(it, 3 * n)  # batches span epoch boundaries (37 = 7 * 5 + 2)
    epochs = [[r["id"] for r in records[e * n : (e + 1) * n]] for e in range(3)]
    for e, order in enumerate(epochs):
        assert set(order) == ALL_IDS and len(order) == n
        assert {r["epoch"] for r in records[e * n : (e + 1) * n]} == {e}
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert epochs[0] != sorted(epochs[0], key=lambda i: (i[0], int(i[1:])))  # actually shuffled


def test_same_seed_same_order_other_seed_other_order(source):
    def order(seed):
        return ids(take(pipeline.make_prompt_pipeline(source, batch_size=6, seed=seed), 12))

    assert order(7) == order(7)
    assert order(7) != order(8)


def test_unshuffled_pipeline_keeps_source_order_every_epoch(source):
    n = len(source)
    batches = take(pipeline.make_prompt_pipeline(source, batch_size=8, seed=0, shuffle=False), 10)
    assert [len(b) for b in batches] == [8] * 10  # full batches across the epoch boundary
    in_order = [source[i]["id"] for i in range(n)]
    assert ids(batches) == (in_order * 3)[:80]
    assert [r["epoch"] for b in batches for r in b] == [i // n for i in range(80)]


@pytest.mark.parametrize("consumed", [3, 9])  # mid-epoch, and in the second epoch
def test_restore_mid_epoch_after_json_round_trip(source, consumed):
    def build():
        return pipeline.make_prompt_pipeline(source, batch_size=4, seed=11, template="base")

    it = build()
    take(it, consumed)
    state = json.loads(json.dumps(it.get_state()))  # what the trainer writes next to a checkpoint
    expected = take(it, 8)
    restored = build()
    restored.set_state(state)
    assert take(restored, 8) == expected
    # A fresh iterator (no restore) would not continue where the first left off.
    assert take(build(), 8) != expected


def test_restore_rejects_state_from_other_settings(source):
    it = pipeline.make_prompt_pipeline(source, batch_size=4, seed=1)
    next(it)
    state = it.get_state()
    other = pipeline.make_prompt_pipeline(source, batch_size=4, seed=2)
    with pytest.raises(ValueError, match="seed"):
        other.set_state(state)
    with pytest.raises(ValueError, match="not a PromptIterator state"):
        other.set_state({"next_index": 3})


@pytest.mark.parametrize("shard_count", [2, 3])
def test_shards_partition_the_data(source, shard_count):
    shards = []
    for k in range(shard_count):
        it = pipeline.make_prompt_pipeline(
            source, batch_size=3, seed=5, shard_index=k, shard_count=shard_count
        )
        records = first_records(it, it.num_records)  # one epoch of this shard
        assert {r["epoch"] for r in records} == {0}
        shards.append([r["id"] for r in records])
    counts = collections.Counter(i for shard in shards for i in shard)
    assert set(counts) == ALL_IDS and set(counts.values()) == {1}
    assert all(abs(len(a) - len(b)) <= 1 for a in shards for b in shards)


def test_encode_fn_adds_prompt_ids(source):
    it = pipeline.make_prompt_pipeline(
        source, batch_size=2, seed=0, template="plain", encode_fn=lambda s: [ord(c) for c in s]
    )
    rec = next(it)[0]
    assert rec["prompt_ids"] == [ord(c) for c in rec["prompt"]]
    assert rec["prompt"].startswith(rec["problem"])


def test_bad_arguments_are_clear_errors(source):
    with pytest.raises(ValueError, match="shard_index"):
        pipeline.make_prompt_pipeline(source, 2, 0, shard_index=2, shard_count=2)
    with pytest.raises(ValueError, match="empty"):
        pipeline.make_prompt_pipeline([{"problem": "p"}], 2, 0, shard_index=1, shard_count=2)
    with pytest.raises(ValueError, match="batch_size"):
        pipeline.make_prompt_pipeline(source, 0, 0)


def test_prompts_over_the_limit_are_left_out_refused_or_kept(source):
    """A prompt's length is counted in tokens of template(problem) (here one per character):
    "drop" leaves the longer records out of every epoch and counts them, "error" refuses the
    data naming the knobs, "truncate" keeps all (the sampler cuts them); none left: an error."""
    encode = list  # one token per character
    template = templates.make_template("plain")
    lengths = {source[i]["id"]: len(template(source[i]["problem"])) for i in range(len(source))}
    in_order = [len(template(source[i]["problem"])) for i in range(len(source))]
    for src in (source, [source[i] for i in range(len(source))]):  # __getitems__, or one by one
        assert pipeline.prompt_lengths(src, template, lambda ts: [list(t) for t in ts],
                                       chunk=7) == in_order
    limit = sorted(lengths.values())[len(lengths) // 2]  # about half of the prompts are longer
    short = {k for k, n in lengths.items() if n <= limit}
    assert 0 < len(short) < len(lengths)

    it = pipeline.make_prompt_pipeline(source, batch_size=3, seed=1, template="plain",
                                       encode_fn=encode, max_prompt_tokens=limit)
    records = first_records(it, 2 * len(short))  # two epochs
    assert [r["id"] for r in records].count(next(iter(short))) == 2  # each kept one, each epoch
    assert {r["id"] for r in records} == short and len(records) == 2 * len(short)
    assert all(len(r["prompt_ids"]) <= limit for r in records)
    assert it.num_overlong == len(lengths) - len(short) and it.num_records == len(short)
    assert it.longest_prompt == max(lengths.values())
    kept_all = pipeline.make_prompt_pipeline(source, 3, 1, template="plain", encode_fn=encode)
    with pytest.raises(ValueError, match="num_records.*resumes with data.overlong_prompts=trunc"):
        it.set_state(kept_all.get_state())  # a run from before prompts were left out

    with pytest.raises(ValueError, match=r"data.max_prompt_len=.*data.overlong_prompts"):
        pipeline.make_prompt_pipeline(source, 3, 1, template="plain", encode_fn=encode,
                                      max_prompt_tokens=limit, overlong_prompts="error")
    it = pipeline.make_prompt_pipeline(source, 3, 1, template="plain", encode_fn=encode,
                                       max_prompt_tokens=limit, overlong_prompts="truncate")
    assert {r["id"] for r in first_records(it, len(lengths))} == set(lengths)
    assert it.num_overlong == 0
    with pytest.raises(ValueError, match="none is left; raise data.max_prompt_len"):
        pipeline.make_prompt_pipeline(source, 3, 1, template="plain", encode_fn=encode,
                                      max_prompt_tokens=min(lengths.values()) - 1)
    with pytest.raises(ValueError, match="data.overlong_prompts: must be one of"):
        pipeline.make_prompt_pipeline(source, 3, 1, template="plain", encode_fn=encode,
                                      max_prompt_tokens=limit, overlong_prompts="cut")
