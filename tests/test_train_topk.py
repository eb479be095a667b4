"""delta.proxy = "hidden_topk": the top-K hidden-gradient proxy wired through the RL loop.

* Unit: the old-policy pass's chunked log p / top-K ids / top-K probabilities at T, and the
  chunked proxy v = W_y - sum_{j in topK} p~_j W_j, against NumPy on full logits.
* Loop: one RL step (tiny model on one device, deterministic stand-in scorer) with the top-K
  proxy. The token weights it uses equal delta_coefficients on v built independently from a
  separate full-logits forward pass (NumPy softmax / argsort / gather); they differ from the
  last-layer proxy's weights; there is still exactly one old-policy forward pass and no trunk
  pass; the streaming (recompute) feature cache gives the same weights.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax.rl.delta import delta_coefficients
from delta_jax.train import features, phases
from delta_jax.train import rl_step as rl_step_lib
from tests.rl_fixtures import build_scored_run, count_calls, initial_state, tiny_rl_config

TOPK = 8


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _numpy_topk_proxy(head_t, labels, probs_full, k):
    """v = W_y - sum_{j in topK} p~_j W_j from full probabilities [.., V]; head_t [V, H]."""
    top_ids = np.argsort(-probs_full, axis=-1, kind="stable")[..., :k]
    top_p = np.take_along_axis(probs_full, top_ids, -1)
    top_p = top_p / top_p.sum(-1, keepdims=True)
    return head_t[labels] - np.einsum("btk,btkh->bth", top_p, head_t[top_ids])


def test_topk_pieces_match_numpy():
    rng = np.random.default_rng(0)
    B, T, H, V, K, temp = 3, 7, 8, 40, 5, 1.3
    h = rng.normal(size=(B, T, H)).astype(np.float32)
    w = rng.normal(size=(H, V)).astype(np.float32)
    y = rng.integers(0, V, (B, T)).astype(np.int32)
    logp, ent, ids, probs = features.logprobs_and_topk(
        jnp.asarray(w), jnp.asarray(h), jnp.asarray(y), temperature=temp, chunk_size=3, topk=K)
    p = _softmax(h.astype(np.float64) @ w / temp)
    np.testing.assert_allclose(np.asarray(logp), np.log(np.take_along_axis(
        p, y[..., None], -1)[..., 0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), -(p * np.log(p)).sum(-1), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-p, -1)[..., :K])
    np.testing.assert_allclose(np.asarray(probs), -np.sort(-p, -1)[..., :K], atol=1e-6)
    v = features.topk_proxy_features(jnp.asarray(w), jnp.asarray(y), ids, probs, chunk_size=2)
    np.testing.assert_allclose(np.asarray(v), _numpy_topk_proxy(w.T, y, p, K), atol=1e-5)
    # K = V: the exact gradient of log p(y) w.r.t. h (at T = 1): W_y - E_p[W].
    _, _, ids_all, probs_all = features.logprobs_and_topk(
        jnp.asarray(w), jnp.asarray(h), jnp.asarray(y), temperature=1.0, chunk_size=4, topk=V)
    v_all = features.topk_proxy_features(jnp.asarray(w), jnp.asarray(y), ids_all, probs_all,
                                         chunk_size=4)

    def logp_y(hh):
        return jax.nn.log_softmax(hh @ jnp.asarray(w))[jnp.arange(T), jnp.asarray(y[0])].sum()
    grad = jax.grad(logp_y)(jnp.asarray(h[0]))
    np.testing.assert_allclose(np.asarray(v_all[0]), np.asarray(grad), atol=1e-5)
    with pytest.raises(ValueError, match="delta.topk"):
        features.logprobs_and_topk(jnp.asarray(w), jnp.asarray(h), jnp.asarray(y),
                                   temperature=1.0, chunk_size=4, topk=V + 1)


def make_config(**delta):
    return tiny_rl_config(
        "delta",
        rollout=dict(temperature=1.5),  # a rollout temperature != 1 reaches the top-K probs
        delta=delta)


@pytest.fixture(scope="module")
def topk_run(tmp_path_factory):
    cfg = make_config(proxy="hidden_topk", topk=TOPK)
    run = build_scored_run(cfg, tmp_path_factory.mktemp("topk"))
    calls = count_calls(run)
    state = initial_state(run)
    params = jax.device_get(state.params)  # the step donates the state
    out = rl_step_lib.rl_step(run, state, 1)
    yield cfg, run, out.metrics, {"batch": jax.device_get(out.batch), "params": params}, calls
    run.close()


def test_loop_weights_equal_independent_topk_proxy(topk_run):
    cfg, run, metrics, rec, _ = topk_run
    b = rec["batch"]
    params = jax.tree.map(jnp.asarray, rec["params"])
    model = nnx.merge(run.graphdef, params, run.rest)
    out = model(jnp.asarray(b["input_ids"]), attention_mask=jnp.asarray(b["attention_mask"]))
    R = b["response_mask"].shape[1]
    logits = np.asarray(out.logits[:, -R - 1:-1], np.float64)
    probs_full = _softmax(logits / cfg.rollout.temperature)
    labels = np.asarray(b["input_ids"])[:, -R:]
    head_t = np.asarray(model.lm_head_weight(), np.float64).T  # [V, H]
    v = _numpy_topk_proxy(head_t, labels, probs_full, TOPK).astype(np.float32)
    mask, adv = jnp.asarray(b["response_mask"]), jnp.asarray(b["advantages"])
    d = cfg.delta
    kw = dict(num_refine=d.num_refine, lam_min=d.lam_min, lam_max=d.lam_max)
    # The loop keeps v in bf16, like the h cache.
    ref, _ = delta_coefficients(None, None, adv, mask, features=jnp.asarray(
        v, jnp.bfloat16), **kw)
    valid = np.asarray(mask) > 0
    assert np.std(b["token_weights"][valid]) > 1e-3
    np.testing.assert_allclose(b["token_weights"], np.asarray(ref), atol=2e-3)
    np.testing.assert_allclose(b["token_weights"][valid].mean(), 1.0, atol=1e-5)
    # Not the last-layer proxy's weights on the same rollout.
    p_y = np.take_along_axis(probs_full, labels[..., None], -1)[..., 0]
    last, _ = delta_coefficients(out.hidden[:, -R - 1:-1], jnp.asarray(p_y, jnp.float32), adv,
                                 mask, **kw)
    assert np.max(np.abs(np.asarray(last) - b["token_weights"])[valid]) > 2e-2
    # old_logp still comes from the same pass (log p of the sampled token at T).
    np.testing.assert_allclose(b["old_logp"] * valid, np.log(p_y) * valid, atol=1e-4)
    assert np.isfinite(metrics["delta/disc_accuracy"])


def test_topk_adds_no_forward_pass(topk_run):
    calls = topk_run[4]
    assert calls["old_pass"] == 1
    assert calls["topk_proxy_pass"] == 1  # v from the head: gathers, not a trunk pass
    assert "hidden_pass" not in calls and "ref_pass" not in calls


def test_topk_streaming_cache_modes_agree(topk_run):
    cfg, run, _, rec, _ = topk_run
    b = jax.tree.map(jnp.asarray, rec["batch"])
    params = jax.tree.map(jnp.asarray, rec["params"])
    R = b["response_mask"].shape[1]
    old = phases.old_policy_features(run.old_pass, params, b["input_ids"], b["attention_mask"],
                                     R, row_chunk=16, keep_hidden="drop")
    assert old.hidden is None
    assert old.topk_ids.shape == old.topk_probs.shape == (b["input_ids"].shape[0], R, TOPK)
    for mode in ("host", "recompute"):  # both rebuild v per chunk from the top-K arrays
        calls = {}

        def proxy_pass(*args):
            calls["topk_proxy_pass"] = calls.get("topk_proxy_pass", 0) + 1
            return run.topk_proxy_pass(*args)
        settings = phases.DeltaSettings.from_config(cfg.delta)
        settings = phases.dataclasses.replace(settings, feature_cache=mode, recompute_chunk=8)
        source = phases.delta_feature_source(old, settings, params=params,
                                             input_ids=b["input_ids"],
                                             attention_mask=b["attention_mask"],
                                             topk_proxy_pass=proxy_pass)
        w, _ = phases.delta_weights(source, b["advantages"], b["response_mask"], settings)
        np.testing.assert_allclose(np.asarray(w), np.asarray(b["token_weights"]), atol=1e-5)
        # 16 rows in chunks of 8, read K + 3 times.
        assert calls["topk_proxy_pass"] == 2 * (cfg.delta.num_refine + 3)
