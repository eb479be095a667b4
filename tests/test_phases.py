"""delta_jax.train.phases, each phase on plain arrays and stand-in callables (no Run):
the rollout with and without DAPO dynamic sampling, the chunked old-policy pass and its host
cache, the DelTA feature sources (device / host / recompute give the same weights, per-shard
statistics over a mesh), and the mini-batch updates."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax import models, sharding
from delta_jax.rl.delta import delta_coefficients
from delta_jax.sampling import GenerationOutput
from delta_jax.train import features, phases, state as state_lib

G = 3


def fake_generate_and_score(kind_of, seen=None):
    """generate_and_score over records {"id": i}: prompt i's G responses get rewards by
    kind_of(i) ("zero" | "one" | "mixed"); response texts name prompt, sample and round."""
    def generate_and_score(records, round_index):
        if seen is not None:
            seen.append((round_index, [r["id"] for r in records]))
        rewards = {"zero": [0.0] * G, "one": [1.0] * G, "mixed": [1.0] + [0.0] * (G - 1)}
        out = GenerationOutput(
            prompt_ids=[[r["id"]] for r in records],
            response_ids=[[[r["id"], j] for j in range(G)] for r in records],
            logprobs=[[[-0.5, -0.5]] * G for _ in records],
            tempered_logprobs=[[[-0.5, -0.5]] * G for _ in records],
            response_lengths=[[2] * G for _ in records],
            truncated=[[False] * G for _ in records],
            texts=[[f"{r['id']}.{j}@{round_index}" for j in range(G)] for r in records])
        r = np.asarray([rewards[kind_of(rec["id"])] for rec in records], np.float32).reshape(-1)
        return out, r, {"accuracy": r, "num_timeouts": 1.0, "num_no_box": 0.0,
                        "reward_fns": {"a": r, "b": 2.0 + np.arange(len(r)) % G}}
    return generate_and_score


def batches(size):
    i = 0
    while True:
        yield [{"id": i + k} for k in range(size)]
        i += size


def test_collect_rollout_keeps_one_batch_without_dynamic_sampling():
    seen = []
    roll = phases.collect_rollout(fake_generate_and_score(lambda i: "zero", seen), batches(4),
                                  num_prompts=4, group_size=G)
    assert seen == [(0, [0, 1, 2, 3])]
    assert [r["id"] for r in roll.records] == [0, 1, 2, 3]
    assert roll.samples.num_prompts == 4 and roll.rewards.shape == (4 * G,)
    assert roll.stats["rounds"] == 1 and roll.stats["num_timeouts"] == 1.0
    np.testing.assert_array_equal(roll.reward_fns["b"], [2, 3, 4] * 4)


def test_collect_rollout_dynamic_sampling_refills_with_groups_that_have_signal():
    kind = lambda i: ("zero", "mixed", "one")[i % 3]  # noqa: E731 -- 1, 4, 7, ... have signal
    seen = []
    roll = phases.collect_rollout(fake_generate_and_score(kind, seen), batches(4),
                                  num_prompts=4, group_size=G, dynamic_sampling=True,
                                  max_rounds=5)
    # Rounds draw whole batches of 4 with their own round index (the seed); kept in order.
    assert seen == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7]), (2, [8, 9, 10, 11])]
    assert [r["id"] for r in roll.records] == [1, 4, 7, 10]
    assert roll.samples.prompt_ids == [[1], [4], [7], [10]]
    assert roll.samples.texts[1] == [f"4.{j}@1" for j in range(G)]
    np.testing.assert_array_equal(roll.rewards.reshape(4, G), [[1, 0, 0]] * 4)
    np.testing.assert_array_equal(roll.accuracy, roll.rewards)
    assert roll.stats["rounds"] == 3 and roll.stats["dropped_groups"] == 8
    assert roll.stats["num_timeouts"] == 3.0
    # Each reward function's sums and the responses scored, over every round's 4 x G: of the
    # 12 prompts drawn, 4 are "mixed" (1 a group) and 4 "one" (G a group); the kept groups'
    # own rewards of each function, in the batch's order.
    assert roll.stats["num_scored"] == 3 * 4 * G
    assert roll.stats["reward_fn/a"] == 4 * 1 + 4 * G
    assert roll.stats["reward_fn/b"] == 12 * (2 + 3 + 4)
    assert list(roll.reward_fns) == ["a", "b"]
    np.testing.assert_array_equal(roll.reward_fns["a"], roll.rewards)
    np.testing.assert_array_equal(roll.reward_fns["b"], [2, 3, 4] * 4)
    with pytest.raises(RuntimeError, match="dynamic sampling: only 3 of 4 groups") as err:
        phases.collect_rollout(fake_generate_and_score(kind), batches(4), num_prompts=4,
                               group_size=G, dynamic_sampling=True, max_rounds=2)
    for field in ("rl.dynamic_sampling_max_rounds=2", "rollout.batch_prompts=4",
                  "rl.dynamic_sampling_prompts_per_round", "rl.dynamic_sampling_on_max_rounds=pad",
                  "rl.dynamic_sampling=False", "sft.steps"):
        assert field in str(err.value)


def test_collect_rollout_rounds_of_two_batches_and_padding():
    """prompts_per_round 8 (two data batches of 4 a round): the same kept groups in fewer rounds;
    on_max_rounds "pad" fills what one round leaves short with its latest dropped groups."""
    kind = lambda i: ("zero", "mixed", "one")[i % 3]  # noqa: E731 -- 1, 4, 7, ... have signal
    seen = []
    roll = phases.collect_rollout(fake_generate_and_score(kind, seen), batches(4),
                                  num_prompts=4, group_size=G, dynamic_sampling=True,
                                  max_rounds=5, prompts_per_round=8)
    assert seen == [(0, list(range(8))), (1, list(range(8, 16)))]
    assert [r["id"] for r in roll.records] == [1, 4, 7, 10]
    assert roll.stats["rounds"] == 2 and roll.stats["padded_groups"] == 0
    assert roll.stats["keep_rate"] == 5 / 16  # 1, 4, 7, 10, 13 had signal
    with pytest.warns(RuntimeWarning, match="only 3 of 4 groups.*Padded with 1"):
        roll = phases.collect_rollout(fake_generate_and_score(kind), batches(4), num_prompts=4,
                                      group_size=G, dynamic_sampling=True, max_rounds=1,
                                      prompts_per_round=8, on_max_rounds="pad")
    assert [r["id"] for r in roll.records] == [1, 4, 7, 6]  # 6: the latest dropped group
    assert roll.stats["padded_groups"] == 1 and roll.stats["dropped_groups"] == 5
    np.testing.assert_array_equal(roll.rewards.reshape(4, G)[3], [0, 0, 0])


def fake_pass(params, ids, attn, response_len):
    """A pass on plain arrays: logp = -ids, entropy = attn, h = ids broadcast over H = 2,
    top-K = ids / 10."""
    ids = ids[:, -response_len:].astype(jnp.float32)
    return (-ids, attn[:, -response_len:].astype(jnp.float32),
            jnp.stack([ids, 2 * ids], -1).astype(jnp.bfloat16),
            ids[..., None].astype(jnp.int32), ids[..., None] / 10)


def test_old_policy_features_chunks_and_host_cache():
    ids = jnp.arange(7 * 5, dtype=jnp.int32).reshape(7, 5)
    attn = jnp.ones_like(ids)
    want = fake_pass(None, ids, attn, 3)
    dev = phases.old_policy_features(fake_pass, None, ids, attn, 3, row_chunk=3)
    for got, ref in zip((dev.logp, dev.entropy, dev.hidden, dev.topk_ids, dev.topk_probs), want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    host = phases.old_policy_features(fake_pass, None, ids, attn, 3, row_chunk=3,
                                      keep_hidden="host")
    assert isinstance(host.hidden, phases.HostChunks)
    assert host.hidden.bounds == [(0, 3), (3, 6), (6, 7)]
    assert all(p.sharding.memory_kind == "pinned_host" for p in host.hidden.parts)
    back = [host.hidden.restore(i) for i in range(3)]
    assert all(b.sharding.memory_kind == "device" for b in back)
    np.testing.assert_array_equal(np.concatenate([np.asarray(b) for b in back]),
                                  np.asarray(want[2]))
    drop = phases.old_policy_features(fake_pass, None, ids, attn, 3, row_chunk=4,
                                      keep_hidden="drop")
    assert drop.hidden is None
    with pytest.raises(ValueError, match="keep_hidden"):
        phases.old_policy_features(fake_pass, None, ids, attn, 3, row_chunk=4, keep_hidden="x")


def tiny_model(seed, num_layers=1):
    cfg = models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_layers=num_layers, num_heads=2, num_kv_heads=1,
                                            head_dim=16)
    return state_lib.split_model(models.Transformer(cfg, rngs=nnx.Rngs(seed)))


def test_feature_cache_modes_agree_and_recompute_streams_k_plus_3_times():
    graphdef, params, rest = tiny_model(1)
    rng = np.random.default_rng(0)
    n, P, R = 8, 4, 8
    ids = jnp.asarray(rng.integers(3, 64, (n, P + R)), jnp.int32)
    attn = jnp.ones((n, P + R), jnp.int32)
    mask = jnp.asarray(rng.uniform(size=(n, R)) > 0.2, jnp.float32)
    adv = jnp.asarray([1.0, 1.0, -1.0, 0.0, -0.5, 0.5, 2.0, -2.0])
    old_pass = features.make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=8)
    hidden_pass = features.make_hidden_pass(graphdef, rest)
    out = {}
    for mode in ("device", "host", "recompute"):
        settings = phases.DeltaSettings(num_refine=2, feature_cache=mode, recompute_chunk=3)
        old = phases.old_policy_features(old_pass, params, ids, attn, R, row_chunk=3,
                                         keep_hidden="drop" if mode == "recompute" else mode)
        calls = []

        def counted(*args):
            calls.append(1)
            return hidden_pass(*args)
        source = phases.delta_feature_source(old, settings, params=params, input_ids=ids,
                                             attention_mask=attn, hidden_pass=counted)
        w, _ = phases.delta_weights(source, adv, mask, settings)
        out[mode] = np.asarray(w)
        # Recompute runs the trunk once per chunk per pass: K + 3 passes over ceil(8 / 3)
        # chunks and nothing more (the hidden size comes from the first pass, not a peek).
        assert len(calls) == (3 * (2 + 3) if mode == "recompute" else 0)
    np.testing.assert_allclose(out["host"], out["device"], atol=1e-5)
    np.testing.assert_allclose(out["recompute"], out["device"], atol=1e-5)
    valid = np.asarray(mask) > 0
    np.testing.assert_allclose(out["device"][valid].mean(), 1.0, atol=1e-5)
    # The device mode is the one-shot coefficients of the pass's own features.
    old = phases.old_policy_features(old_pass, params, ids, attn, R, row_chunk=8)
    ref, _ = delta_coefficients(old.hidden, jnp.exp(old.logp), adv, mask, num_refine=2)
    np.testing.assert_allclose(out["device"], np.asarray(ref), atol=1e-6)


@pytest.mark.devices(8)
def test_per_shard_stats_on_eight_devices():
    """stats_mode=per_shard with the mesh and batch axes: on 8 devices (2 rows each) the weights
    equal the global coefficients of each shard's rows taken alone, and differ from global
    statistics; chunked sources refuse per-shard statistics."""
    mesh = sharding.make_mesh(4, 2, 1)  # rows over ("data", "fsdp"): 8 shards
    assert len(jax.devices()) == 8
    graphdef, params, rest = tiny_model(2)
    rng = np.random.default_rng(1)
    n, P, R = 16, 4, 6
    batch = sharding.put_batch({
        "input_ids": rng.integers(3, 64, (n, P + R)).astype(np.int32),
        "attention_mask": np.ones((n, P + R), np.int32),
        "response_mask": (rng.uniform(size=(n, R)) > 0.2).astype(np.float32),
        "advantages": rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], n).astype(np.float32)}, mesh)
    old_pass = features.make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=8,
                                             mesh=mesh)
    old = phases.old_policy_features(old_pass, params, batch["input_ids"],
                                     batch["attention_mask"], R, row_chunk=n)
    adv, mask = batch["advantages"], batch["response_mask"]
    settings = phases.DeltaSettings(stats_mode="per_shard")
    source = phases.delta_feature_source(old, settings)
    w, _ = phases.delta_weights(source, adv, mask, settings, mesh=mesh,
                                batch_axes=sharding.batch_axes(mesh))
    h_np, p_np = np.asarray(old.hidden), np.exp(np.asarray(old.logp))
    a_np, m_np = np.asarray(adv), np.asarray(mask)
    own = np.concatenate([np.asarray(delta_coefficients(
        jnp.asarray(h_np[s:s + 2]), jnp.asarray(p_np[s:s + 2]), jnp.asarray(a_np[s:s + 2]),
        jnp.asarray(m_np[s:s + 2]))[0]) for s in range(0, n, 2)])
    np.testing.assert_allclose(np.asarray(w), own, atol=1e-5)
    glob, _ = delta_coefficients(old.hidden, jnp.exp(old.logp), adv, mask)
    assert np.max(np.abs(np.asarray(w) - np.asarray(glob))) > 1e-2
    w_glob, _ = phases.delta_weights(source, adv, mask, phases.DeltaSettings(), mesh=mesh)
    np.testing.assert_allclose(np.asarray(w_glob), np.asarray(glob), atol=1e-6)
    chunked = phases.FeatureSource(token_prob=jnp.exp(old.logp),
                                   chunks=lambda: [(0, n, old.hidden)])
    with pytest.raises(ValueError, match="per-shard"):
        phases.delta_weights(chunked, adv, mask, settings, mesh=mesh)


def test_delta_settings_from_config_reads_every_field():
    from delta_jax.train.config import default_config

    d = default_config().delta
    got = phases.DeltaSettings.from_config(d)
    assert {f.name: getattr(got, f.name) for f in dataclasses.fields(got)} == {
        f.name: d[f.name] for f in dataclasses.fields(got)}


def test_delta_settings_carry_the_ablation_flags_and_delta_weights_honours_them():
    """delta.* ablation flags (issue #19): from_config reads them, delta_weights passes them on
    (one-shot and chunked sources), and random_lambda needs a key."""
    from delta_jax.rl.delta import Ablations
    from delta_jax.train.config import default_config

    d = default_config().delta
    assert phases.DeltaSettings.from_config(d).ablations() == Ablations()  # the full method
    d.fixed_gamma, d.assignment, d.normalize = 0.5, "hard", False
    d.weight, d.random_lambda = "alpha", True
    got = phases.DeltaSettings.from_config(d)
    assert got.ablations() == Ablations(0.5, "hard", False, "alpha", True)

    rng = np.random.default_rng(5)
    n, R, H = 6, 5, 4
    h = jnp.asarray(rng.normal(size=(n, R, H)), jnp.float32)
    p = jnp.asarray(rng.uniform(0.1, 0.9, size=(n, R)), jnp.float32)
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5, 0.0, 1.0])
    mask = jnp.asarray(rng.uniform(size=(n, R)) > 0.2, jnp.float32)
    source = phases.FeatureSource(features=h, token_prob=p)
    chunked = phases.FeatureSource(token_prob=p, chunks=lambda: [(0, 2, h[:2]), (2, n, h[2:])])
    default_w, _ = phases.delta_weights(source, adv, mask, phases.DeltaSettings())
    flags = phases.DeltaSettings(num_refine=2, assignment="hard", normalize=False)
    want, _ = delta_coefficients(h, p, adv, mask, num_refine=2,
                                 ablations=Ablations(assignment="hard", normalize=False))
    for src in (source, chunked):
        w, diag = phases.delta_weights(src, adv, mask, flags)
        np.testing.assert_allclose(np.asarray(w), np.asarray(want), rtol=1e-6, atol=1e-7)
        assert float(diag["normaliser"]) == 1.0
    assert np.abs(np.asarray(want) - np.asarray(default_w)).max() > 1e-2

    rand = phases.DeltaSettings(random_lambda=True)
    with pytest.raises(ValueError, match="delta.random_lambda"):
        phases.delta_weights(source, adv, mask, rand)
    w1, _ = phases.delta_weights(source, adv, mask, rand, key=jax.random.key(1))
    w2, _ = phases.delta_weights(source, adv, mask, rand, key=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(w1), np.asarray(w2))
    assert np.abs(np.asarray(w1) - np.asarray(default_w)).max() > 1e-2


def test_update_policy_visits_every_group_once_per_epoch_in_whole_groups():
    """Each epoch's mini-batches hold whole groups and cover every row once; the epochs visit
    the groups in orders that differ from each other and from the identity (shuffled per epoch,
    not once), the same orders again for the same seed."""
    num_prompts, group, mini, epochs = 6, 2, 2, 3
    batch = {"row": jnp.arange(num_prompts * group)}
    seen = []

    def train_step(state, mb):
        seen.append(np.asarray(mb["row"]).tolist())
        return state + 1, {"loss": 0.5, "n": float(len(seen))}

    state, sums, updates = phases.update_policy(
        train_step, 0, batch, num_prompts=num_prompts, group_size=group,
        mini_batch_prompts=mini, epochs=epochs, seed=7)
    assert state == updates == len(seen) == epochs * num_prompts // mini
    assert sums == {"loss": 0.5 * updates, "n": float(sum(range(1, updates + 1)))}
    per_epoch = num_prompts // mini
    for e in range(epochs):
        rows = sorted(r for mb in seen[e * per_epoch:(e + 1) * per_epoch] for r in mb)
        assert rows == list(range(num_prompts * group))  # every row once per epoch
    for mb in seen:  # whole groups: rows 2i, 2i + 1 together
        assert len(mb) == mini * group
        assert all(mb[k] // group == mb[k + 1] // group for k in range(0, len(mb), group))
    # Each epoch's whole group order (its mini-batches in turn): seed 7 gives three distinct
    # orders, none of them 0, 1, ..., 5 (deterministic: the same seed, the same orders below).
    orders = [[r // group for mb in seen[e * per_epoch:(e + 1) * per_epoch] for r in mb[::group]]
              for e in range(epochs)]
    assert all(sorted(order) == list(range(num_prompts)) for order in orders)
    assert len({tuple(order) for order in orders}) == epochs, orders  # reshuffled every epoch
    assert all(order != list(range(num_prompts)) for order in orders), orders  # not the identity
    # Same seed, same order.
    again = []
    phases.update_policy(lambda s, mb: (again.append(np.asarray(mb["row"]).tolist()) or s, {}),
                         0, batch, num_prompts=num_prompts, group_size=group,
                         mini_batch_prompts=mini, epochs=epochs, seed=7)
    assert again == seen


def test_old_policy_features_stops_between_chunks_when_told():
    """should_stop is asked after every chunk but the last: true after the first of three
    raises PassStopped with the second never run; never true, the features are those of a pass
    without it."""
    import jax.numpy as jnp
    calls = []

    def old_pass(params, ids, attn, response_len):
        calls.append(ids.shape[0])
        x = ids.astype(jnp.float32)[:, -response_len:]
        return x, -x, None

    ids = jnp.arange(6 * 5, dtype=jnp.int32).reshape(6, 5)
    attn = jnp.ones_like(ids)
    with pytest.raises(phases.PassStopped, match="after 2 of 6 rows"):
        phases.old_policy_features(old_pass, None, ids, attn, 3, row_chunk=2, keep_hidden="drop",
                                   should_stop=lambda: True)
    assert calls == [2]
    asked = []
    full = phases.old_policy_features(old_pass, None, ids, attn, 3, row_chunk=2,
                                      keep_hidden="drop",
                                      should_stop=lambda: asked.append(1) or False)
    plain = phases.old_policy_features(old_pass, None, ids, attn, 3, row_chunk=2,
                                       keep_hidden="drop")
    assert len(asked) == 2  # after chunks 1 and 2 of 3
    np.testing.assert_array_equal(np.asarray(full.logp), np.asarray(plain.logp))
