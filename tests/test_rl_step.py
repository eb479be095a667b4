"""delta_jax/train/rl_step.py: what prepare_batch derives from (seed, step).

delta.random_lambda draws its lambdas with a key derived from (seed, step): the same step gives
the same draws (a resumed run redoes a step exactly), the next step new ones. Checked on the keys
prepare_batch hands to phases.delta_weights (phases' own tests show equal keys give equal
weights).
"""
import logging

import jax
import numpy as np
import pytest

from delta_jax.train import phases
from delta_jax.train import rl_step as rl_step_lib
from tests.rl_fixtures import build_scored_run, initial_state, live_device_bytes, tiny_rl_config


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_rollout_holds_the_planned_pool_and_weight_copy_beside_the_state(tmp_path, dtype):
    """After a decode call (should_stop is asked) the device holds the train state and, beside it,
    what plan mode's rollout phase counts as persistent: the KV page pool and the decode weight
    copy, to the byte (a second copy of either, or the stacked weights cast again, would show);
    after the step, the state alone again."""
    from delta_jax import plan
    from delta_jax.train import run as run_lib

    cfg = tiny_rl_config("dapo", model=dict(param_dtype=dtype, dtype=dtype))
    run = build_scored_run(cfg, tmp_path)
    device = jax.devices()[0]
    try:
        model_cfg = run.model(run.initial_params).cfg
        state = initial_state(run)
        before = live_device_bytes(device)
        during = []

        def should_stop():
            during.append(live_device_bytes(device))
            return False

        new_state = rl_step_lib.rl_step(run, state, 1, should_stop=should_stop).state
        del state  # (its arrays were donated: the step's batch and outputs go with the rest)
        after = live_device_bytes(device)
        del new_state
    finally:
        run.close()
    p = plan.plan_from_config(cfg, mesh_shape=run_lib._mesh_shape(run.mesh), model_cfg=model_cfg)
    assert before == p.params + p.optimizer + 4  # (the step counter)
    # (one decode call here: 8 new tokens; the later asks come after the generation)
    assert during[0] - before == p.kv_cache + p.decode_weight_copy == max(during) - before, (
        during, before, p.kv_cache, p.decode_weight_copy)
    assert after == before


def test_random_lambda_draws_follow_the_step(tmp_path, monkeypatch):
    keys = []
    weights = phases.delta_weights

    def recording(*args, key=None, **kwargs):
        keys.append(np.asarray(jax.random.key_data(key)))
        return weights(*args, key=key, **kwargs)

    monkeypatch.setattr(phases, "delta_weights", recording)
    run = build_scored_run(tiny_rl_config("delta", delta=dict(random_lambda=True)), tmp_path)
    try:
        params = initial_state(run).params
        # Three batches (the data iterator moves on): step 1, step 1 again, step 2.
        preps = [rl_step_lib.prepare_batch(run, params, step) for step in (1, 1, 2)]
    finally:
        run.close()
    assert len(keys) == 3
    np.testing.assert_array_equal(keys[0], keys[1])
    assert not np.array_equal(keys[0], keys[2])
    w = np.asarray(jax.device_get(preps[0].batch["token_weights"]))
    valid = np.asarray(jax.device_get(preps[0].batch["response_mask"])) > 0
    assert np.std(w[valid]) > 0.01  # the draws do weight the tokens


class AllCorrect:
    """A scorer that gives every response reward 1: no group has reward variance."""

    def score(self, texts, golds, response_lengths=None, truncated=None, problems=None,
              data_sources=None, extra_infos=None, response_ids=None, trainer_state=None,
              solutions=None, columns=None):
        rewards = np.ones(len(texts), np.float32)
        return rewards, {"accuracy": rewards, "num_timeouts": 0, "num_no_box": 0,
                         "num_errors": 0}

    def close(self):
        pass


def test_dynamic_sampling_settings_reach_the_rollout(tmp_path, monkeypatch):
    """rl.dynamic_sampling_prompts_per_round = 2 batches: one round generates 8 prompts' groups;
    with every reward equal no group has signal, and rl.dynamic_sampling_on_max_rounds = "pad"
    fills the batch of 4 with zero-signal groups after the one round allowed (zero advantages),
    which the step's metrics report."""
    rounds = []
    collect = phases.collect_rollout

    def recording(generate_and_score, record_batches, **kwargs):
        def counted(records, round_index):
            rounds.append(len(records))
            return generate_and_score(records, round_index)
        return collect(counted, record_batches, **kwargs)

    monkeypatch.setattr(phases, "collect_rollout", recording)
    cfg = tiny_rl_config("grpo", rl=dict(dynamic_sampling=True, dynamic_sampling_max_rounds=1,
                                         dynamic_sampling_prompts_per_round=8,
                                         dynamic_sampling_on_max_rounds="pad"))
    run = build_scored_run(cfg, tmp_path)
    run.scorer = AllCorrect()
    try:
        with pytest.warns(RuntimeWarning, match="only 0 of 4 groups.*Padded with 4"):
            prep = rl_step_lib.prepare_batch(run, initial_state(run).params, 1)
    finally:
        run.close()
    assert rounds == [8]
    m = prep.metrics
    assert (m["rollout/sampling_rounds"], m["rollout/dropped_groups"]) == (1, 8)
    assert (m["rollout/padded_groups"], m["rollout/keep_rate"]) == (4, 0.0)
    assert m["rollout/dropped_mean_reward"] == 1.0
    assert len(prep.rollout.records) == 4 and not np.any(prep.packed.advantages)


@pytest.mark.parametrize("old_pass_rows, want", [(0, 16), (5, 5)])
def test_old_pass_chunks_follow_rl_old_pass_rows(tmp_path, monkeypatch, old_pass_rows, want):
    """The old-policy pass runs over chunks of rl.old_pass_rows sequences, or of
    rollout.max_batch_size (the fixture's 16 = the whole rollout of 4 x 4) where it is 0: the
    rows its plan counts (plan.plan_memory's old_pass_rows)."""
    chunks = []
    features = phases.old_policy_features

    def recording(*args, row_chunk, **kwargs):
        chunks.append(row_chunk)
        return features(*args, row_chunk=row_chunk, **kwargs)

    monkeypatch.setattr(phases, "old_policy_features", recording)
    cfg = tiny_rl_config("dapo", rl=dict(old_pass_rows=old_pass_rows))
    run = build_scored_run(cfg, tmp_path)
    try:
        rl_step_lib.prepare_batch(run, initial_state(run).params, 1)
    finally:
        run.close()
    assert chunks == [want]


def test_the_steps_sampler_metrics(tmp_path, caplog):
    """prepare_batch reports the sampler's side of the rollout: the tokens it generated (the
    packed batch's response tokens), decode steps (at least the longest response), slot
    utilization (tokens / (steps x slots)) and preemptions: none with the default worst-case
    pool; some in a page pool of little more than one sample (rollout.kv_budget_gb), whose
    samples are the same token for token, resumed with their tokens (rollout.resume_preempted)
    or, with that off, restarted."""
    from delta_jax import models
    from delta_jax.sampling.kv_cache import sample_pages

    def prepared(train=None, **rollout):
        cfg = tiny_rl_config("dapo", rollout=dict(page_size=4, max_new_tokens=16, **rollout),
                             **({"train": train} if train else {}))
        run = build_scored_run(cfg, tmp_path / str(len(list(tmp_path.iterdir()))))
        try:
            return rl_step_lib.prepare_batch(run, initial_state(run).params, 1), run
        finally:
            run.close()

    # train.progress_every_s: here a progress line after every decode call of the rollout.
    with caplog.at_level(logging.INFO, logger="delta_jax.sampling"):
        wide, run = prepared(train=dict(progress_every_s=1e-9))
    m = wide.metrics
    lines = [r.getMessage() for r in caplog.records if r.name == "delta_jax.sampling"]
    assert lines and all(line.startswith("rollout step 1: ") for line in lines), lines
    samples = run.cfg.rollout.batch_prompts * run.cfg.rollout.group_size
    assert lines[-1].startswith(f"rollout step 1: {samples} / {samples} samples done, ")
    lengths = np.asarray(wide.packed.response_mask).sum(axis=1)
    assert m["rollout/generated_tokens"] == lengths.sum()
    assert m["rollout/decode_steps"] >= lengths.max()
    slots = run.cfg.rollout.max_batch_size
    assert m["rollout/slot_utilization"] == pytest.approx(
        lengths.sum() / (m["rollout/decode_steps"] * slots))
    assert 0 < m["rollout/slot_utilization"] <= 1 and m["rollout/preemptions"] == 0
    assert m["rollout/tokens_per_s"] > 0 and m["rollout/decode_s"] > 0
    assert m["rollout/prefill_s"] > 0
    # Room for one sample of the longest prompt at full length and 4 pages more.
    prompt_len = run.cfg.data.max_prompt_len
    shared, own = sample_pages(prompt_len, 16, 4)
    page = models.page_bytes(run.model(run.initial_params).cfg, 4)
    tight, _ = prepared(kv_budget_gb=(1 + shared + own + 4) * page / 2**30,
                        decode_steps_per_call=2)  # samples grow between calls
    assert 0 < tight.metrics["rollout/resumed"] <= tight.metrics["rollout/preemptions"]
    assert tight.metrics["rollout/generated_tokens"] == m["rollout/generated_tokens"]
    np.testing.assert_array_equal(np.asarray(tight.packed.input_ids),
                                  np.asarray(wide.packed.input_ids))
    restarted, _ = prepared(kv_budget_gb=(1 + shared + own + 4) * page / 2**30,
                            decode_steps_per_call=2, resume_preempted=False)
    assert restarted.metrics["rollout/preemptions"] > 0
    assert restarted.metrics["rollout/resumed"] == 0
    np.testing.assert_array_equal(np.asarray(restarted.packed.input_ids),
                                  np.asarray(wide.packed.input_ids))


def _prepared_step_1(workdir, **rl):
    """prepare_batch of RL step 1 of the tiny delta config with these rl.* fields."""
    cfg = tiny_rl_config("delta", rl=rl)
    run = build_scored_run(cfg, workdir)
    try:
        return rl_step_lib.prepare_batch(run, initial_state(run).params, 1)
    finally:
        run.close()


def test_mask_truncated_takes_truncated_responses_out_of_the_loss(tmp_path, monkeypatch):
    """rl.mask_truncated (DAPO's overlong filtering), on the same rollout (same seed) with and
    without it: the loss mask and the DelTA token weights are 0 on every token of a truncated
    response and as without the option elsewhere in the mask; the advantages (the groups'
    rewards) are the same; rollout/masked_truncated counts them. (The tiny random policy never
    stops within its limit, so every other response is marked as stopped there.)"""
    import dataclasses

    pack = rl_step_lib.rollout_lib.pack_rollout

    def pack_half_stopped(*args, **kwargs):
        rb = pack(*args, **kwargs)
        return dataclasses.replace(rb, truncated=rb.truncated & (np.arange(rb.num_rows) % 2 == 0))

    monkeypatch.setattr(rl_step_lib.rollout_lib, "pack_rollout", pack_half_stopped)

    off = _prepared_step_1(tmp_path / "off", mask_truncated=False)
    on = _prepared_step_1(tmp_path / "on", mask_truncated=True)
    truncated = on.packed.truncated
    assert 0 < truncated.sum() < truncated.size
    np.testing.assert_array_equal(on.packed.response_mask, off.packed.response_mask)
    mask_off = np.asarray(off.batch["response_mask"])
    mask_on = np.asarray(on.batch["response_mask"])
    np.testing.assert_array_equal(mask_off, off.packed.response_mask)
    np.testing.assert_array_equal(mask_on[truncated], 0.0)
    np.testing.assert_array_equal(mask_on[~truncated], mask_off[~truncated])
    assert mask_on[~truncated].sum() > 0
    weights = np.asarray(on.batch["token_weights"])
    assert np.all(weights[truncated] == 0) and np.all(weights[mask_on > 0] > 0)
    assert np.all(np.asarray(off.batch["token_weights"])[truncated][mask_off[truncated] > 0] > 0)
    np.testing.assert_array_equal(np.asarray(on.batch["advantages"]),
                                  np.asarray(off.batch["advantages"]))
    assert on.metrics["rollout/masked_truncated"] == truncated.sum()
    assert "rollout/masked_truncated" not in off.metrics


def test_entropy_top_frac_keeps_the_batchs_high_entropy_tokens(tmp_path, monkeypatch):
    """rl.entropy_top_frac=0.2 (the 80/20 rule): on the same rollout as without it, the loss mask
    is the response tokens whose old-policy entropy is at or above the batch's 0.8 quantile
    (numpy's, from the pass's own entropies), the token weights are 0 elsewhere, the host copy
    of the mask (what the credit report and the rollouts files read) is the device's, and the
    metrics give the threshold and the fraction kept."""
    recorded = []
    real = rl_step_lib.phases.old_policy_features

    def record(*args, **kwargs):
        out = real(*args, **kwargs)
        recorded.append(np.asarray(out.entropy))
        return out

    monkeypatch.setattr(rl_step_lib.phases, "old_policy_features", record)

    off = _prepared_step_1(tmp_path / "off", entropy_top_frac=0.0)
    on = _prepared_step_1(tmp_path / "on", entropy_top_frac=0.2)
    entropy = recorded[-1]
    np.testing.assert_array_equal(recorded[0], entropy)  # the same rollout and pass
    live = np.asarray(off.batch["response_mask"]) > 0
    threshold = np.quantile(entropy[live], 0.8)
    want = (live & (entropy >= threshold)).astype(np.float32)
    got = np.asarray(on.batch["response_mask"])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(on.loss_mask, got)
    np.testing.assert_array_equal(off.loss_mask, live.astype(np.float32))
    weights = np.asarray(on.batch["token_weights"])
    assert np.all(weights[got == 0] == 0) and np.all(weights[got > 0] > 0)
    assert on.metrics["rollout/entropy_threshold"] == pytest.approx(threshold, rel=1e-5)
    assert on.metrics["rollout/entropy_kept_frac"] == pytest.approx(want.sum() / live.sum())
    assert 0.1 < on.metrics["rollout/entropy_kept_frac"] <= 0.25
    assert "rollout/entropy_threshold" not in off.metrics
