"""KL to a frozen reference policy (rl.kl_coef > 0, rl.kl_type).

* The train step's loss and gradient include kl_coef times the token-mean k3 estimator against
  the batch's ref_logp: checked against an independent jax.grad of that term from full logits.
* Through the loop (train(): SFT warm start, two RL steps of one update each, a resume): the
  reference is the post-SFT policy and stays frozen; the kl metric is finite, ~0 at the first step
  (policy == reference) and > 0 after an update; one reference forward pass per step besides the
  one old-policy pass; a resumed run gets the same reference back from disk.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from delta_jax import models
from delta_jax.train import loop, state as state_lib
from delta_jax.train import run as run_lib
from delta_jax.train.checkpoint import Checkpointer
from delta_jax.train.config import ConfigError
from delta_jax.train.step import make_train_step
from tests.rl_fixtures import (LOOP_WITHOUT_EVAL, build_scored_run, count_calls, tiny_rl_config,
                               tree_max_abs_diff)

N, P, R, T, KL_COEF = 4, 5, 6, 1.0, 0.5


def base_config(**rl):
    return tiny_rl_config(
        "dapo",
        rl=dict(mini_batch_prompts=4,   # one update per step: the first one sees policy == ref
                **rl),
        optim=dict(lr=3e-3, weight_decay=0.0),
        train=dict(steps=2, save_every=2, **LOOP_WITHOUT_EVAL),
        sft=dict(steps=2, batch_size=4, max_len=32, warmup_steps=0))


def full_logits_logp(graphdef, params, rest, ids, attn):
    """log softmax(logits / T)[y] of the response columns from the full logits."""
    model = nnx.merge(graphdef, params, rest)
    logits = model(ids, attention_mask=attn).logits[:, P - 1:-1].astype(jnp.float32) / T
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[:, P:, None], -1)[..., 0]


def test_kl_term_in_loss_and_gradient():
    mcfg = models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_layers=1, num_heads=2, num_kv_heads=1,
                                             head_dim=16)
    graphdef, params, rest = state_lib.split_model(models.Transformer(mcfg, rngs=nnx.Rngs(0)))
    _, ref_params, _ = state_lib.split_model(models.Transformer(mcfg, rngs=nnx.Rngs(1)))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 64, (N, P + R)), jnp.int32)
    attn = jnp.ones((N, P + R), jnp.int32)
    mask = jnp.asarray(rng.uniform(size=(N, R)) > 0.2, jnp.float32)
    old = full_logits_logp(graphdef, params, rest, ids, attn)
    ref_logp = full_logits_logp(graphdef, ref_params, rest, ids, attn)  # a different policy
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": mask, "old_logp": old,
             "advantages": jnp.asarray([1.0, -1.0, 0.5, -0.5]), "token_weights": mask}

    def kl_mean(p):  # token-mean k3 = exp(ref - logp) - (ref - logp) - 1
        d = ref_logp - full_logits_logp(graphdef, p, rest, ids, attn)
        return jnp.sum((jnp.exp(d) - d - 1.0) * mask) / jnp.sum(mask)

    def reference_loss(p):
        """At ratio 1 (old_logp = current) the clipped surrogate's value is -A and its gradient
        that of -A log p (token mean); plus kl_coef times the k3 token mean."""
        logp = full_logits_logp(graphdef, p, rest, ids, attn)
        adv = batch["advantages"][:, None]
        pg = -jnp.sum(adv * jnp.exp(logp - jax.lax.stop_gradient(logp)) * mask) / jnp.sum(mask)
        return pg + KL_COEF * kl_mean(p)

    opt = optax.sgd(1.0)
    cfg = base_config(kl_coef=KL_COEF, kl_type="k3")
    step = make_train_step(graphdef, rest, opt, run_lib.make_loss_fn(cfg), temperature=T,
                           chunk_size=4)
    st = state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt)
    new, metrics = step(st, dict(batch, ref_logp=ref_logp))
    expected_kl = float(kl_mean(params))
    assert expected_kl > 1e-3
    np.testing.assert_allclose(float(metrics["kl"]) / float(metrics["tokens"]), expected_kl,
                               rtol=1e-4)
    pg_only = -float(jnp.sum(batch["advantages"][:, None] * mask) / jnp.sum(mask))
    np.testing.assert_allclose(float(metrics["loss"]), pg_only + KL_COEF * expected_kl,
                               rtol=1e-4, atol=1e-6)
    # SGD(lr=1): the update is minus the gradient of the surrogate plus the KL term.
    ref_grad, kl_grad = jax.jit(lambda p: (jax.grad(reference_loss)(p),
                                           jax.grad(kl_mean)(p)))(params)
    for a, b, g in zip(jax.tree.leaves(new.params), jax.tree.leaves(params),
                       jax.tree.leaves(ref_grad)):
        np.testing.assert_allclose(np.asarray(a) - np.asarray(b), -np.asarray(g),
                                   atol=2e-5, rtol=1e-3)
    # ... and the KL part of that gradient is far from negligible at this tolerance.
    assert max(float(jnp.max(jnp.abs(KL_COEF * g))) for g in jax.tree.leaves(kl_grad)) > 1e-3


def test_kl_config_validation():
    with pytest.raises(ConfigError, match="rl.kl_type"):
        base_config(kl_coef=0.1, kl_type="k4")
    with pytest.raises(ConfigError, match="rl.kl_coef"):
        base_config(kl_coef=-0.1)


def test_kl_through_the_loop_with_sft_and_resume(tmp_path):
    cfg = base_config(kl_coef=0.1, kl_type="k3")
    run = build_scored_run(cfg, tmp_path)
    calls = count_calls(run)
    try:
        state, run = loop.train(cfg, str(tmp_path), run=run)
        rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        kl = {r["step"]: r["policy/kl"] for r in rows if "policy/kl" in r}
        assert sorted(kl) == [1, 2] and all(np.isfinite(list(kl.values())))
        assert abs(kl[1]) < 1e-7        # the first update: policy == reference
        assert kl[2] > 1e-6             # after one update the policy has moved away
        assert calls["old_pass"] == calls["ref_pass"] == 2
        # The reference is the post-SFT policy (checkpoint 0), still frozen after training.
        ckpt = Checkpointer(str(tmp_path / "checkpoints"))
        ckpt0, _, _ = ckpt.restore(0, state)
        ckpt.close()
        assert tree_max_abs_diff(run.ref_params, ckpt0.params) == 0.0
        assert tree_max_abs_diff(ckpt0.params, state.params) > 1e-4
        fresh = models.Transformer(run.model(state.params).cfg, rngs=nnx.Rngs(cfg.seed))
        assert tree_max_abs_diff(nnx.state(fresh, nnx.Param), ckpt0.params) > 5e-4  # SFT moved it
        # Resume (one more step): the reference comes back from workdir/reference.
        run.ref_params = jax.tree.map(jnp.zeros_like, run.ref_params)
        cfg3 = base_config(kl_coef=0.1, kl_type="k3")
        with cfg3.unlocked():
            cfg3.train.steps = 3
        run.cfg = cfg3
        state3, run = loop.train(cfg3, str(tmp_path), run=run)
        assert tree_max_abs_diff(run.ref_params, ckpt0.params) == 0.0
        rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        kl3 = [r["policy/kl"] for r in rows if r.get("step") == 3 and "policy/kl" in r]
        assert len(kl3) == 1 and kl3[0] > 1e-6
    finally:
        run.close()
