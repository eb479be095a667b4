"""DelTA feature-cache modes: host and recompute give the device mode's weights."""
import types

import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import config_dict

from delta_jax import models
from delta_jax.train import features, loop, state as state_lib


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
        w, diag = loop.compute_delta_weights(run, params, batch, logp, h, adv, mask)
        out[mode] = np.asarray(w)
        # Recompute streams the trunk once per chunk per pass: K + 3 passes over ceil(8 / 3)
        # chunks, plus the first chunk once more where the driver peeks at the hidden size.
        assert counters.get("trunk_forward", 0) == (1 + 3 * (2 + 3) if mode == "recompute"
                                                    else 0)
    np.testing.assert_allclose(out["host"], out["device"], atol=1e-5)
    np.testing.assert_allclose(out["recompute"], out["device"], atol=1e-5)
    valid = np.asarray(mask) > 0
    np.testing.assert_allclose(out["device"][valid].mean(), 1.0, atol=1e-5)
