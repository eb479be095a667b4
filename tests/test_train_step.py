"""The pure train step and the old-policy feature pass, against independent references."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from delta_jax import models
from delta_jax.rl import losses
from delta_jax.train import features, phases, state as state_lib
from delta_jax.train.step import make_train_step

N, P, R, T = 4, 5, 7, 1.3


@pytest.fixture(scope="module")
def setup():
    cfg = models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_layers=2, num_heads=2, num_kv_heads=1,
                                            head_dim=16)
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = state_lib.split_model(model)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 64, (N, P + R)).astype(np.int32)
    attn = np.ones((N, P + R), np.int32)
    attn[0, :2] = 0                      # left padding of a short prompt
    resp = np.ones((N, R), np.float32)
    resp[1, 4:] = 0                      # a short response, right padded
    attn[1, P + 4:] = 0
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(attn),
             "response_mask": jnp.asarray(resp),
             "advantages": jnp.asarray([1.0, -0.5, 0.25, -1.0], jnp.float32),
             "token_weights": jnp.asarray(rng.uniform(0.8, 1.2, (N, R)), jnp.float32)}
    return graphdef, params, rest, batch


def reference_logp(graphdef, params, rest, batch):
    """log softmax(logits / T)[y] from the full logits, response columns only (independent of
    the chunked path and of features.py's slicing)."""
    model = nnx.merge(graphdef, params, rest)
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp_all = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / T, axis=-1)
    labels = batch["input_ids"][:, 1:]
    logp = jnp.take_along_axis(logp_all, labels[..., None], axis=-1)[..., 0]
    return logp[:, P - 1:]


def on_policy_loss(graphdef, rest, batch):
    """params -> the token-mean surrogate at ratio 1 (old_logp = current logp: nothing clipped),
    whose gradient is -sum(A w grad log p) / num_tokens, from full logits."""
    def loss(p):
        logp = reference_logp(graphdef, p, rest, batch)
        m = batch["response_mask"]
        return -jnp.sum(batch["advantages"][:, None] * batch["token_weights"] * logp * m) / jnp.sum(m)
    return loss


def test_old_policy_pass_matches_full_logits(setup):
    graphdef, params, rest, batch = setup
    fn = features.make_old_policy_pass(graphdef, rest, temperature=T, chunk_size=3)
    old = phases.old_policy_features(fn, params, batch["input_ids"], batch["attention_mask"], R,
                                     row_chunk=3)  # chunks of 3 + 1 rows
    logp, ent, hidden = old.logp, old.entropy, old.hidden
    ref = reference_logp(graphdef, params, rest, batch)
    mask = np.asarray(batch["response_mask"]) > 0
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(ref)[mask], atol=1e-5)
    model = nnx.merge(graphdef, params, rest)
    h = model(batch["input_ids"], attention_mask=batch["attention_mask"]).hidden
    assert hidden.dtype == jnp.bfloat16 and hidden.shape == (N, R, 32)
    np.testing.assert_allclose(np.asarray(hidden, np.float32)[mask],
                               np.asarray(h[:, P - 1:-1])[mask], rtol=1e-2, atol=1e-2)
    assert np.all(np.asarray(ent)[mask] > 0)


def _loss_fn(logp, old_logp, adv, mask, w, ent):
    return losses.policy_loss(logp, old_logp, adv, mask, token_weights=w,
                              cfg=losses.PolicyLossConfig(), entropy=ent)


@pytest.fixture(scope="module")
def sgd_steps(setup):
    """SGD(lr=1) with a (zero-)momentum trace, so the optimizer has state that changes. One
    compiled step per micro-batch setting, shared by the tests."""
    graphdef, _, rest, _ = setup
    opt = optax.sgd(1.0, momentum=0.0)
    return opt, {micro: make_train_step(graphdef, rest, opt, _loss_fn, temperature=T,
                                        chunk_size=4, micro_batch_size=micro)
                 for micro in (0, 2)}


def test_step_gradient_and_micro_batches(setup, sgd_steps):
    """With old_logp = current logp (ratio 1, no clipping) the token-mean surrogate's gradient is
    -sum(A w grad log p) / num_tokens; SGD(lr=1) makes the update equal to minus that."""
    graphdef, params, rest, batch = setup
    batch = dict(batch, old_logp=reference_logp(graphdef, params, rest, batch))
    ref_loss = on_policy_loss(graphdef, rest, batch)

    ref_grads = jax.grad(ref_loss)(params)
    opt, steps = sgd_steps
    results = []
    for micro in (0, 2):
        step = steps[micro]
        st = state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt)
        new, metrics = step(st, batch)
        assert int(new.step) == 1 and int(metrics["skipped"]) == 0
        assert float(metrics["tokens"]) == float(jnp.sum(batch["response_mask"]))
        delta = jax.tree.map(lambda a, b: a - b, new.params, params)
        for d, g in zip(jax.tree.leaves(delta), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(np.asarray(d), -np.asarray(g), atol=2e-5, rtol=1e-3)
        np.testing.assert_allclose(float(metrics["grad_norm"]),
                                   float(optax.tree.norm(ref_grads)), rtol=1e-4)
        results.append(new.params)
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_non_finite_update_is_skipped(setup, sgd_steps):
    graphdef, params, rest, batch = setup
    old = reference_logp(graphdef, params, rest, batch)
    bad = dict(batch, old_logp=old, advantages=batch["advantages"].at[2].set(jnp.nan))
    opt, steps = sgd_steps
    step = steps[2]
    st = state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt)
    before = jax.device_get(st)
    new, metrics = step(st, bad)
    assert int(metrics["skipped"]) == 1 and int(new.step) == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(new))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The same state then takes a good step.
    new, metrics = step(new, dict(bad, advantages=batch["advantages"]))
    assert int(metrics["skipped"]) == 0 and int(new.step) == 1


def test_learning_rate_schedules():
    s = state_lib.learning_rate_schedule(1.0, "cosine", warmup_steps=2, total_steps=6,
                                         min_lr_ratio=0.1)
    np.testing.assert_allclose([float(s(i)) for i in (0, 1, 2, 6)], [0.0, 0.5, 1.0, 0.1],
                               atol=1e-6)
    c = state_lib.learning_rate_schedule(1e-6, "constant")
    assert float(c(0)) == float(c(1000)) == pytest.approx(1e-6)


def test_fused_logprob_step_matches_chunked(setup, sgd_steps):
    """model.logprob_impl = "fused" gives the chunked step's parameters, optimizer state and
    metrics, with micro-batches."""
    graphdef, params, rest, batch = setup
    old = reference_logp(graphdef, params, rest, batch)
    batch = dict(batch, old_logp=old - 0.05)  # ratio != 1: the clipped branch is in play
    opt, steps = sgd_steps
    fused_step = make_train_step(graphdef, rest, opt, _loss_fn, temperature=T, chunk_size=4,
                                 micro_batch_size=2, logprob_impl="fused")
    results = []
    for step in (steps[2], fused_step):
        st = state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt)
        results.append(step(st, batch))
    (chunked, m_c), (fused, m_f) = results
    for a, b in zip(jax.tree.leaves(fused.params), jax.tree.leaves(chunked.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(m_f[name]), float(m_c[name]), rtol=1e-5)
    # The update is not trivially zero (the comparison above could not pass by accident).
    moved = max(float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(jax.tree.leaves(fused.params), jax.tree.leaves(params)))
    assert moved > 1e-3


def _sgd_step_follows(cfg, graphdef, params, rest, batch, ref_loss):
    """One train step of the run's loss (run.make_loss_fn of the validated config `cfg`) in two
    micro-batches with SGD(lr=1): its loss is ref_loss(params) and it moves the parameters by
    minus ref_loss's gradient. Returns (the step's metrics, that gradient)."""
    from delta_jax.train import run as run_lib

    ref_grads = jax.jit(jax.grad(ref_loss))(params)
    opt = optax.sgd(1.0)
    step = make_train_step(graphdef, rest, opt, run_lib.make_loss_fn(cfg), temperature=T,
                           chunk_size=4, micro_batch_size=2)
    new, metrics = step(state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(jax.jit(ref_loss)(params)), rtol=1e-4)
    for a, b, g in zip(jax.tree.leaves(new.params), jax.tree.leaves(params),
                       jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a) - np.asarray(b), -np.asarray(g), atol=2e-5,
                                   rtol=1e-3)
    return metrics, ref_grads


def test_sequence_ratio_step_follows_gspo(setup):
    """rl.ratio_level=sequence through the run's loss (run.make_loss_fn of a validated config)
    and the train step, in two micro-batches: SGD(lr=1) moves the parameters by minus the
    gradient of GSPO's sequence objective computed from full logits, with one response clipped
    (its mean log-ratio beyond the range) and the others inside it."""
    from tests.rl_fixtures import tiny_rl_config
    from tests.test_losses import _gspo_reference

    graphdef, params, rest, batch = setup
    cfg = tiny_rl_config("dapo", rl=dict(ratio_level="sequence", eps_low=3e-3, eps_high=4e-3,
                                         agg="seq-mean-token-mean"))
    mask = batch["response_mask"]
    # Token log-ratios of +-0.02 around each response's mean (far outside the clip range token
    # by token, so a token-level ratio would clip most of them); row 0's mean (A > 0) is past
    # 1 + eps_high: clipped, no gradient.
    noise = 0.02 * np.where(np.arange(R) % 2, 1.0, -1.0)[None] * np.asarray(mask)
    noise -= (noise.sum(-1) / np.asarray(mask).sum(-1))[:, None] * np.asarray(mask)
    shift = np.asarray([[-0.01], [0.001], [-0.002], [0.0015]])
    old = reference_logp(graphdef, params, rest, batch) + jnp.asarray(shift - noise, jnp.float32)
    batch = dict(batch, old_logp=old, token_weights=mask)

    def ref_loss(p):
        return _gspo_reference(reference_logp(graphdef, p, rest, batch), old,
                               batch["advantages"], mask, 3e-3, 4e-3)

    metrics, ref_grads = _sgd_step_follows(cfg, graphdef, params, rest, batch, ref_loss)
    assert float(metrics["clip_frac_high"]) == float(jnp.sum(mask[0]))  # row 0's tokens
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads)) > 1e-3


def test_sapo_step_follows_the_soft_gate(setup):
    """rl.surrogate=sapo through the run's loss (run.make_loss_fn of a validated config) and the
    train step, in two micro-batches: SGD(lr=1) moves the parameters by minus the gradient of
    SAPO's token-mean objective written out from full logits, with ratios off 1 both ways."""
    from tests.rl_fixtures import tiny_rl_config

    graphdef, params, rest, batch = setup
    cfg = tiny_rl_config("dapo", rl=dict(surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=3.0))
    mask = batch["response_mask"]
    shift = 0.3 * np.where(np.arange(R) % 3, 1.0, -1.0)[None] * np.asarray(mask)
    old = reference_logp(graphdef, params, rest, batch) + jnp.asarray(shift, jnp.float32)
    batch = dict(batch, old_logp=old, token_weights=mask)

    def ref_loss(p):
        ratio = jnp.exp(reference_logp(graphdef, p, rest, batch) - old)
        adv = jnp.broadcast_to(batch["advantages"][:, None], ratio.shape)
        tau = jnp.where(adv > 0, 1.0, 3.0)
        per_token = -(4.0 / tau) * jax.nn.sigmoid(tau * (ratio - 1.0)) * adv
        return jnp.sum(jnp.where(mask > 0, per_token, 0.0)) / jnp.sum(mask)

    metrics, ref_grads = _sgd_step_follows(cfg, graphdef, params, rest, batch, ref_loss)
    # Metric sums over the micro-batches: the gate's mean is under 1 (off policy), no clipping.
    assert 0 < float(metrics["sapo_gate"]) / float(metrics["tokens"]) < 1
    assert float(metrics["clip_frac_high"]) == float(metrics["clip_frac_low"]) == 0
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads)) > 1e-3


def test_fipo_step_follows_the_future_kl_weights(setup):
    """rl.fipo through the run's loss (run.make_loss_fn of a validated config) and the train
    step, in two micro-batches: SGD(lr=1) moves the parameters by minus the gradient of DAPO's
    clipped surrogate with each token's loss times clip(exp(sum_{k >= t} gamma^(k - t) d_k),
    1, 1.2), written out from full logits with a [R, R] matrix of discounts (the weights held
    constant), the policy moved away from the rollout's by +-0.3 a token."""
    from tests.rl_fixtures import tiny_rl_config

    graphdef, params, rest, batch = setup
    cfg = tiny_rl_config("dapo", rl=dict(fipo=True, fipo_decay_rate=2.0, mini_batch_prompts=2))
    mask = batch["response_mask"]
    shift = 0.3 * np.where(np.arange(R) % 3, 1.0, -1.0)[None] * np.asarray(mask)
    old = reference_logp(graphdef, params, rest, batch) - jnp.asarray(shift, jnp.float32)
    batch = dict(batch, old_logp=old, token_weights=mask)
    distance = np.arange(R)[None, :] - np.arange(R)[:, None]  # [t, k]: k - t
    discounts = jnp.asarray(np.where(distance >= 0, 0.5 ** (distance / 2.0), 0.0), jnp.float32)

    def ref_loss(p):
        logp = reference_logp(graphdef, p, rest, batch)
        d = jnp.where(mask > 0, logp - old, 0.0)
        weight = jax.lax.stop_gradient(jnp.clip(jnp.exp(d @ discounts.T), 1.0, 1.2))
        ratio = jnp.exp(logp - old)
        adv = batch["advantages"][:, None]
        per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.28))
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, -adv * 10.0), per_token)
        return jnp.sum(jnp.where(mask > 0, per_token * weight, 0.0)) / jnp.sum(mask)

    metrics, ref_grads = _sgd_step_follows(cfg, graphdef, params, rest, batch, ref_loss)
    # Metric sums over the micro-batches: some tokens amplified, none above 1.2.
    mean_weight = float(metrics["fipo_weight"]) / float(metrics["tokens"])
    assert 1.0 < mean_weight < 1.2
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads)) > 1e-3


def test_lora_step_trains_the_adapters_only(setup):
    """With LoRA adapters, in two micro-batches: the base weights come back bit for bit, the
    optimizer state mirrors the adapters alone, and SGD(lr=1) moves each factor by minus the
    gradient of the reference loss (full logits) with respect to it; the base weights' own
    gradient is not zero (freezing them is a real difference)."""
    graphdef0, params0, rest0, batch = setup
    model = nnx.merge(graphdef0, jax.tree.map(jnp.copy, params0), rest0).add_lora(2, 4.0, seed=1)
    for name in model.layers.lora_names():  # B = 0 would leave A without gradient
        if name.endswith("_lora_b"):
            var = getattr(model.layers, name)
            var.set_value(0.3 * jax.random.normal(jax.random.key(len(name)), var.shape))
    graphdef, params, rest = state_lib.split_model(model)
    batch = dict(batch, old_logp=reference_logp(graphdef, params, rest, batch))
    ref_loss = on_policy_loss(graphdef, rest, batch)

    ref_grads = jax.jit(jax.grad(ref_loss))(params)
    opt = optax.sgd(1.0, momentum=0.5)
    step = make_train_step(graphdef, rest, opt, _loss_fn, temperature=T, chunk_size=4,
                           micro_batch_size=2)
    st = state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt)
    lora_count = len(model.layers.lora_names())
    assert len(jax.tree.leaves(st.opt_state)) == lora_count  # one momentum trace per factor
    new, metrics = step(st, batch)
    assert int(metrics["skipped"]) == 0
    new_t, new_f = state_lib.split_trainable(new.params)
    old_t, old_f = state_lib.split_trainable(params)
    grad_t, grad_f = state_lib.split_trainable(ref_grads)
    assert len(jax.tree.leaves(new_t)) == lora_count
    for a, b in zip(jax.tree.leaves(new_f), jax.tree.leaves(old_f)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b, g in zip(jax.tree.leaves(new_t), jax.tree.leaves(old_t), jax.tree.leaves(grad_t)):
        np.testing.assert_allclose(np.asarray(a) - np.asarray(b), -np.asarray(g), atol=2e-5,
                                   rtol=1e-3)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grad_t)),
                               rtol=1e-4)
    assert min(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grad_t)) > 1e-4
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grad_f)) > 1e-3


def test_sft_loss_fused_matches_chunked(setup):
    from delta_jax.train import sft

    graphdef, params, rest, batch = setup
    sft_batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                 "loss_mask": batch["attention_mask"].astype(jnp.float32)}

    def loss_and_grad(impl):
        fn = jax.value_and_grad(
            lambda p: sft.sft_loss(nnx.merge(graphdef, p, rest), sft_batch, 4, impl)[0])
        return jax.jit(fn)(params)

    (loss_c, g_c), (loss_f, g_f) = loss_and_grad("chunked"), loss_and_grad("fused")
    np.testing.assert_allclose(float(loss_f), float(loss_c), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(g_c)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_run_sft_follows_model_logprob_impl(tmp_path, monkeypatch):
    """loop.run_sft builds its step with cfg.model.logprob_impl: the fused path calls the LM-head
    kernel, the chunked one does not, and both warm starts end at the same parameters."""
    from delta_jax import kernels
    from delta_jax.train import loop
    from tests.rl_fixtures import build_scored_run, tiny_rl_config, tree_max_abs_diff

    calls = []
    real = kernels.lm_head_logprob

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "lm_head_logprob", counting)
    out = {}
    for impl in ("chunked", "fused"):
        cfg = tiny_rl_config("dapo", model=dict(logprob_impl=impl),
                             sft=dict(steps=2, batch_size=4, max_len=32, warmup_steps=0))
        run = build_scored_run(cfg, tmp_path / impl)
        try:
            calls.clear()
            out[impl] = loop.run_sft(run, run.take_initial_params())
            assert bool(calls) == (impl == "fused"), impl
        finally:
            run.close()
    assert tree_max_abs_diff(out["fused"], out["chunked"]) < 1e-5
    fresh = build_scored_run(tiny_rl_config("dapo"), tmp_path / "fresh")
    try:
        assert tree_max_abs_diff(out["chunked"], fresh.take_initial_params()) > 1e-4   # SFT moved it
    finally:
        fresh.close()


def _gradient_recorder():
    """An optax transformation that applies nothing and keeps, as its state, the gradients the
    step hands it (float32)."""
    def init(params):
        return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def update(grads, state, params=None):
        return jax.tree.map(jnp.zeros_like, grads), jax.tree.map(
            lambda g: g.astype(jnp.float32), grads)

    return optax.GradientTransformation(init, update)


def test_micro_batch_gradients_are_summed_in_float32(setup):
    """A bfloat16 model, micro-batches of one row, every row the same: the step's gradient of 2
    rows and of 64 rows must be the same. A micro-batch's gradient g holds 8 significant bits;
    k * g (k <= 64) is exact in float32, and so is the division by the 2x / 64x larger token
    count, but a bfloat16 running sum rounds 3g, 5g, ... to 8 bits."""
    batch = setup[3]
    cfg = models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_layers=2, num_heads=2, num_kv_heads=1,
                                            head_dim=16, dtype=jnp.bfloat16,
                                            param_dtype=jnp.bfloat16)
    graphdef, params, rest = state_lib.split_model(models.Transformer(cfg, rngs=nnx.Rngs(0)))
    row = {k: v[2:3] for k, v in batch.items()}
    row["old_logp"] = jnp.zeros_like(row["response_mask"]) - 1.0
    opt = _gradient_recorder()
    step = make_train_step(graphdef, rest, opt, _loss_fn, temperature=T, chunk_size=4,
                           micro_batch_size=1)
    got = {}
    for rows in (2, 64):
        rep = jax.tree.map(lambda x: jnp.repeat(x, rows, axis=0), row)
        st = state_lib.init_train_state(jax.tree.map(jnp.copy, params), opt)
        new, metrics = step(st, rep)
        assert int(metrics["skipped"]) == 0
        got[rows] = jax.device_get(new.opt_state)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(got[64])):
        assert a.dtype == np.float32 and np.any(a != 0)
        np.testing.assert_array_equal(a, b)
