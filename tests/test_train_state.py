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


def test_the_state_keeps_its_dtypes_through_an_update():
    """A bfloat16 model's state after one update has the dtypes it had (so a jitted step takes
    its own output without compiling again), with float32 gradients (as the train step's are,
    divided by a float32 token count): optax's AdamW alone returns its first moment in float32
    then; the moments stay in the parameters' dtype, rounded from the float32 update."""
    params = {"w": jnp.asarray([1.0, -2.0, 3.0], jnp.bfloat16)}
    opt = state_lib.make_optimizer(lambda _: 0.1)
    st = state_lib.init_train_state(params, opt)
    grads = {"w": jnp.asarray([0.3, -0.1, 0.2], jnp.float32)}
    _, reference = opt.update(grads, st.opt_state, st.params)
    assert {x.dtype for x in jax.tree.leaves(reference) if x.ndim} == {jnp.dtype(jnp.float32),
                                                                       jnp.dtype(jnp.bfloat16)}

    step = jax.jit(lambda s, g: state_lib.apply_if_finite(
        s, g, opt, loss=jnp.float32(1.0), grad_norm=optax.tree.norm(g))[0])
    new = step(st, grads)
    assert jax.tree.map(lambda x: x.dtype, new) == jax.tree.map(lambda x: x.dtype, st)
    for got, want in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(got.dtype)))
    step(new, grads)
    assert step._cache_size() == 1   # the second update ran the first's executable
