"""Fused LM-head log-probs (kernels.lm_head_logprob, vocabulary tiles with a custom VJP) against a
plain full-logits computation and jax.grad of it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.kernels.lm_head_logprob import lm_head_logprob

TEMPERATURE = 0.7


def make_inputs(seed, n=100, hidden=48, vocab=700, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (n, hidden))
    w = jax.random.normal(k[1], (hidden, vocab)) * 0.4
    labels = jax.random.randint(k[2], (n,), 0, vocab)
    # Padding tokens: their outputs get zero cotangent (as a masked loss would give them).
    mask = (jax.random.uniform(k[3], (n,)) > 0.25).astype(jnp.float32)
    return h.astype(dtype), w.astype(dtype), labels, mask


def naive(h, w, labels, temperature=TEMPERATURE):
    """Full [N, V] logits, log_softmax, gather; entropy -sum p log p."""
    z = jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32), precision="highest") / temperature
    logq = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logq, labels[:, None], axis=1)[:, 0]
    return logp, -jnp.sum(jnp.exp(logq) * logq, axis=-1)


def rel_err(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert np.all(np.isfinite(x)), "non-finite values"
    return np.linalg.norm(x - y) / np.linalg.norm(y)


def masked_objective(fn, mask, seed=11):
    """A scalar using both outputs with random per-token weights, zero on padding tokens."""
    g = jax.random.normal(jax.random.key(seed), (2, mask.shape[0])) * mask

    def objective(h, w, labels):
        logp, ent = fn(h, w, labels)
        return jnp.sum(g[0] * logp) + jnp.sum(g[1] * ent)

    return objective


def fused_fn(h, w, labels, chunk_size=128):
    """Vocabulary tiles of 128: V = 700 leaves a ragged last tile of 60."""
    return lm_head_logprob(h, w, labels, TEMPERATURE, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [128, 700, 1024])
def test_forward_matches_full_logits(chunk_size):
    h, w, labels, _ = make_inputs(0)
    logp, ent = jax.jit(lambda *x: fused_fn(*x, chunk_size=chunk_size))(h, w, labels)
    want_logp, want_ent = naive(h, w, labels)
    assert logp.dtype == ent.dtype == jnp.float32
    assert rel_err(logp, want_logp) < 1e-5
    assert rel_err(ent, want_ent) < 1e-5


def test_gradient_matches_grad_of_full_logits():
    h, w, labels, mask = make_inputs(1)
    got = jax.jit(jax.grad(masked_objective(fused_fn, mask), argnums=(0, 1)))(h, w, labels)
    want = jax.grad(masked_objective(naive, mask), argnums=(0, 1))(h, w, labels)
    for g, g_ref in zip(got, want):
        assert g.shape == g_ref.shape
        assert rel_err(g, g_ref) < 1e-5


def test_single_output_gradients():
    """Each output's gradient separately (the entropy path is not stop-gradient)."""
    h, w, labels, _ = make_inputs(2, n=40, vocab=300)
    for index in (0, 1):
        loss = lambda fn: (lambda h, w: jnp.sum(fn(h, w, labels)[index]))
        got = jax.grad(loss(fused_fn), argnums=(0, 1))(h, w)
        want = jax.grad(loss(naive), argnums=(0, 1))(h, w)
        for g, g_ref in zip(got, want):
            assert rel_err(g, g_ref) < 1e-5


def test_bf16_inputs():
    """bf16 h and W: values within 1e-3 of the fp32 computation on those same bf16 values (the
    matmul accumulates in fp32); gradients come back in bf16 within 2e-2 of the fp32 gradients."""
    h, w, labels, mask = make_inputs(3, dtype=jnp.bfloat16)
    got = jax.jit(fused_fn)(h, w, labels)
    for x, e in zip(got, naive(h, w, labels)):
        assert x.dtype == jnp.float32
        assert rel_err(x, e) < 1e-3
    grads = jax.jit(jax.grad(masked_objective(fused_fn, mask), argnums=(0, 1)))(h, w, labels)
    want = jax.grad(masked_objective(naive, mask), argnums=(0, 1))(h.astype(jnp.float32),
                                                                  w.astype(jnp.float32), labels)
    for g, g_ref in zip(grads, want):
        assert g.dtype == jnp.bfloat16
        assert rel_err(g, g_ref) < 2e-2


def test_bad_inputs_are_named():
    h, w, labels, _ = make_inputs(5, n=8, vocab=50)
    with pytest.raises(ValueError, match="temperature"):
        lm_head_logprob(h, w, labels, 0.0)
    with pytest.raises(ValueError, match="labels"):
        lm_head_logprob(h, w, labels.astype(jnp.float32))
    with pytest.raises(ValueError, match="hidden size"):
        lm_head_logprob(h, w[:10], labels)


def test_suite_pins_fp32_matmuls_to_highest():
    """tests/conftest.py pins JAX's default matmul precision to "highest" (TF32 on a GPU would
    break the 1e-5 comparisons here): every dot traced under jit, forward and custom backward,
    carries HIGHEST."""
    assert jax.config.jax_default_matmul_precision == "highest"
    h, w, labels, mask = make_inputs(8, n=64, hidden=32, vocab=256)
    text = str(jax.jit(jax.grad(masked_objective(fused_fn, mask), argnums=(0, 1)))
               .trace(h, w, labels).jaxpr)
    dots = text.count("dot_general[")
    assert dots >= 3
    assert text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)") == dots, text
