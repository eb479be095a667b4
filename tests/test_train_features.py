"""The old-policy pass (train/features.py): the fused LM-head path equals the chunked one.
(The feature-cache modes and per-shard statistics are tested on the phases: test_phases.py.)"""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax import models
from delta_jax.train import features, state as state_lib


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
