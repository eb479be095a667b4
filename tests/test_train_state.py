"""Train state helpers (delta_jax/train/state.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from delta_jax.train import state as state_lib


def _setup():
    params = {"w": jnp.asarray([1.0, -2.0, 3.0]), "b": jnp.asarray(0.5)}
    opt = optax.adam(0.1)
    st = state_lib.init_train_state(params, opt)
    grads = {"w": jnp.asarray([0.3, -0.1, 0.2]), "b": jnp.asarray(1.0)}
    return opt, st, grads


def test_apply_if_finite_applies_the_optimizer_update():
    opt, st, grads = _setup()
    new, finite = jax.jit(lambda s, g: state_lib.apply_if_finite(
        s, g, opt, loss=jnp.float32(1.0), grad_norm=optax.tree.norm(g)))(st, grads)
    updates, opt_state = opt.update(grads, st.opt_state, st.params)
    expected = optax.apply_updates(st.params, updates)
    assert bool(finite) and int(new.step) == 1
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(opt_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("bad", ["loss_nan", "loss_inf", "grad_norm_nan", "grad_nan"])
def test_apply_if_finite_skips_a_non_finite_update(bad):
    opt, st, grads = _setup()
    loss = jnp.float32({"loss_nan": jnp.nan, "loss_inf": jnp.inf}.get(bad, 1.0))
    if bad == "grad_nan":
        grads = dict(grads, b=jnp.asarray(jnp.nan))
    grad_norm = jnp.float32(jnp.nan) if bad == "grad_norm_nan" else optax.tree.norm(grads)
    new, finite = jax.jit(lambda s, g, l, n: state_lib.apply_if_finite(
        s, g, opt, loss=l, grad_norm=n))(st, grads, loss, grad_norm)
    assert not bool(finite) and int(new.step) == 0
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(st)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
