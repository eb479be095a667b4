"""DelTA feature-cache modes: host and recompute give the device mode's weights; per-shard
statistics over the run's mesh."""
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import config_dict

from delta_jax import models
from delta_jax.train import features, state as state_lib
from delta_jax.train import rl_step as rl_step_lib


def test_feature_cache_modes_agree():
    cfg = models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_layers=1, num_heads=2, num_kv_heads=1,
                                            head_dim=16)
    graphdef, params, rest = state_lib.split_model(models.Transformer(cfg, rngs=nnx.Rngs(1)))
    rng = np.random.default_rng(0)
    n, P, R = 8, 4, 8
    ids = jnp.asarray(rng.integers(3, 64, (n, P + R)), jnp.int32)
    attn = jnp.ones((n, P + R), jnp.int32)
    mask = jnp.asarray(rng.uniform(size=(n, R)) > 0.2, jnp.float32)
    adv = jnp.asarray([1.0, 1.0, -1.0, 0.0, -0.5, 0.5, 2.0, -2.0])
    old_pass = features.make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=8)
    logp, _, hidden = old_pass(params, ids, attn, R)
    batch = {"input_ids": ids, "attention_mask": attn}
    out = {}
    for mode in ("device", "host", "recompute"):
        counters = {}
        run = types.SimpleNamespace(
            cfg=config_dict.ConfigDict({"delta": {
                "feature_cache": mode, "num_refine": 2, "lam_min": 0.8, "lam_max": 1.2,
                "recompute_chunk": 3}}),
            hidden_pass=features.make_hidden_pass(graphdef, rest),
            count=lambda name, k=1, c=counters: c.__setitem__(name, c.get(name, 0) + k))
        h = np.asarray(hidden) if mode == "host" else hidden
        w, diag = rl_step_lib.compute_delta_weights(run, params, batch, logp, h, adv, mask)
        out[mode] = np.asarray(w)
        # Recompute streams the trunk once per chunk per pass: K + 3 passes over ceil(8 / 3)
        # chunks and nothing more (the hidden size comes from the first pass, not a peek).
        assert counters.get("trunk_forward", 0) == (3 * (2 + 3) if mode == "recompute" else 0)
    np.testing.assert_allclose(out["host"], out["device"], atol=1e-5)
    np.testing.assert_allclose(out["recompute"], out["device"], atol=1e-5)
    valid = np.asarray(mask) > 0
    np.testing.assert_allclose(out["device"][valid].mean(), 1.0, atol=1e-5)


def test_per_shard_stats_on_eight_devices():
    """delta.stats_mode=per_shard reaches delta_coefficients with the run's mesh and batch axes:
    on 8 devices (2 rows each) the weights equal delta_coefficients(stats_mode="per_shard"), equal
    the global coefficients of each shard's rows taken alone, and differ from global statistics."""
    import jax

    from delta_jax import sharding
    from delta_jax.rl.delta import delta_coefficients
    from delta_jax.train.config import ConfigError, default_config, validate_config

    mesh = sharding.make_mesh(4, 2, 1)  # rows over ("data", "fsdp"): 8 shards
    assert len(jax.devices()) == 8
    cfg = models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_layers=1, num_heads=2, num_kv_heads=1,
                                            head_dim=16)
    graphdef, params, rest = state_lib.split_model(models.Transformer(cfg, rngs=nnx.Rngs(2)))
    rng = np.random.default_rng(1)
    n, P, R = 16, 4, 6
    batch = sharding.put_batch({
        "input_ids": rng.integers(3, 64, (n, P + R)).astype(np.int32),
        "attention_mask": np.ones((n, P + R), np.int32),
        "response_mask": (rng.uniform(size=(n, R)) > 0.2).astype(np.float32),
        "advantages": rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], n).astype(np.float32)}, mesh)
    old_pass = features.make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=8,
                                             mesh=mesh)
    logp, _, hidden = old_pass(params, batch["input_ids"], batch["attention_mask"], R)
    adv, mask = batch["advantages"], batch["response_mask"]
    run = types.SimpleNamespace(
        cfg=config_dict.ConfigDict({"delta": {
            "feature_cache": "device", "num_refine": 1, "lam_min": 0.8, "lam_max": 1.2,
            "recompute_chunk": 4, "proxy": "last_layer", "stats_mode": "per_shard"}}),
        mesh=mesh, count=lambda name, k=1: None)
    w, diag = rl_step_lib.compute_delta_weights(run, params, batch, logp, hidden, adv, mask)
    p = jnp.exp(logp)
    ref, _ = delta_coefficients(hidden, p, adv, mask, stats_mode="per_shard", mesh=mesh,
                                data_axes=("data", "fsdp"))
    np.testing.assert_allclose(np.asarray(w), np.asarray(ref), atol=1e-6)
    # Independent: each 2-row shard on its own, global statistics.
    h_np, p_np = np.asarray(hidden), np.asarray(p)
    a_np, m_np = np.asarray(adv), np.asarray(mask)
    own = np.concatenate([np.asarray(delta_coefficients(
        jnp.asarray(h_np[s:s + 2]), jnp.asarray(p_np[s:s + 2]), jnp.asarray(a_np[s:s + 2]),
        jnp.asarray(m_np[s:s + 2]))[0]) for s in range(0, n, 2)])
    np.testing.assert_allclose(np.asarray(w), own, atol=1e-5)
    glob, _ = delta_coefficients(hidden, p, adv, mask)
    assert np.max(np.abs(np.asarray(w) - np.asarray(glob))) > 1e-2
    run.cfg.delta.stats_mode = "global"
    w_glob, _ = rl_step_lib.compute_delta_weights(run, params, batch, logp, hidden, adv, mask)
    np.testing.assert_allclose(np.asarray(w_glob), np.asarray(glob), atol=1e-6)
    # The streaming caches compute global statistics only: refused at config time.
    c = default_config()
    c.model.random_init, c.model.preset, c.data.train = True, "tiny", "synthetic"
    c.delta.stats_mode, c.delta.feature_cache = "per_shard", "recompute"
    with pytest.raises(ConfigError, match="delta.stats_mode"):
        validate_config(c)


def test_old_policy_pass_fused_matches_chunked():
    """make_old_policy_pass(logprob_impl="fused") returns the chunked pass's log-probs, entropies
    and hidden states."""
    cfg = models.get_preset("tiny").replace(vocab_size=96, hidden_size=16, intermediate_size=32,
                                            num_layers=1, num_heads=2, num_kv_heads=1,
                                            head_dim=8)
    graphdef, params, rest = state_lib.split_model(models.Transformer(cfg, rngs=nnx.Rngs(1)))
    ids = jnp.asarray(np.random.default_rng(2).integers(3, 96, (3, 9)), jnp.int32)
    attn = jnp.ones_like(ids).at[0, :2].set(0)
    outs = [features.make_old_policy_pass(graphdef, rest, temperature=0.9, chunk_size=2,
                                          logprob_impl=impl)(params, ids, attn, 5)
            for impl in ("chunked", "fused")]
    for a, b in zip(outs[1], outs[0]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-6)
