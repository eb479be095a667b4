"""The old-policy pass (train/features.py): the fused LM-head path equals the chunked one.
(The feature-cache modes and per-shard statistics are tested on the phases: test_phases.py.)"""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax import models
from delta_jax.models import logprobs
from delta_jax.train import features, state as state_lib


def test_old_policy_pass_fused_matches_chunked():
    """make_old_policy_pass(logprob_impl="fused") returns the chunked pass's log-probs and
    entropies (only those: the hidden states are computed before the logprob_impl branch), with a
    vocabulary of 320 that the fused path covers in several tiles (128 + 128 + a 64 remainder by
    models.logprobs.fused_vocab_chunk), so its online log-sum-exp across tiles is exercised."""
    vocab, rows, response_len, chunk_size = 320, 3, 5, 2
    tile = logprobs.fused_vocab_chunk(chunk_size, rows * response_len, vocab)
    assert -(-vocab // tile) > 1, "the fused path would run as one vocabulary tile"
    cfg = models.get_preset("tiny").replace(vocab_size=vocab, hidden_size=16,
                                            intermediate_size=32, num_layers=1, num_heads=2,
                                            num_kv_heads=1, head_dim=8)
    graphdef, params, rest = state_lib.split_model(models.Transformer(cfg, rngs=nnx.Rngs(1)))
    ids = jnp.asarray(np.random.default_rng(2).integers(3, vocab, (rows, 9)), jnp.int32)
    attn = jnp.ones_like(ids).at[0, :2].set(0)
    outs = [features.make_old_policy_pass(graphdef, rest, temperature=0.9,
                                          chunk_size=chunk_size,
                                          logprob_impl=impl)(params, ids, attn, response_len)
            for impl in ("chunked", "fused")]
    for name, a, b in zip(("logp", "entropy"), outs[1][:2], outs[0][:2]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
