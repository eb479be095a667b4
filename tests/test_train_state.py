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
    """Without master weights (optim.master_weights=False), a bfloat16 model's state after one update has the dtypes it had (so a jitted step takes
    its own output without compiling again), with float32 gradients (as the train step's are,
    divided by a float32 token count): optax's AdamW alone returns its first moment in float32
    then; the moments stay in the parameters' dtype, rounded from the float32 update."""
    params = {"w": jnp.asarray([1.0, -2.0, 3.0], jnp.bfloat16)}
    opt = state_lib.make_optimizer(lambda _: 0.1, master_weights=False)
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


def _bf16_weights_and_grads(steps):
    """Qwen3-like bfloat16 weights (N(0, 0.02)) and a norm scale (ones), and `steps` float32
    gradients of a fixed sign per element (so AdamW moves each element ~lr a step)."""
    key = jax.random.key(0)
    w = (0.02 * jax.random.normal(key, (4096,))).astype(jnp.bfloat16)
    params = {"w": w, "norm": jnp.ones((256,), jnp.bfloat16)}
    sign = {"w": jnp.sign(jax.random.normal(jax.random.key(1), (4096,))),
            "norm": jnp.ones((256,))}
    scale = jax.random.uniform(jax.random.key(2), (steps,), minval=0.5, maxval=2.0)
    grads = [jax.tree.map(lambda s, c=c: (1e-3 * c * s).astype(jnp.float32), sign)
             for c in scale]
    return params, grads


def _run(opt, params, grads):
    step = jax.jit(lambda s, g: state_lib.apply_if_finite(
        s, g, opt, loss=jnp.float32(1.0), grad_norm=optax.tree.norm(g))[0])
    st = state_lib.init_train_state(params, opt)
    for g in grads:
        st = step(st, g)
    return st


def test_master_weights_carry_the_small_updates_that_bfloat16_rounds_away():
    """The paper's lr 1e-6: AdamW in bfloat16 leaves almost every weight, and every norm scale,
    where it was after 100 steps (updates of ~1e-6 are below half a bfloat16 spacing: ~6e-5 at
    0.02, 2e-3 at 1); through a float32 master copy the parameters follow a float32
    AdamW run on float32 parameters (optax alone, the independent reference) rounded to
    bfloat16, the master copy equal to it."""
    steps, lr = 100, 1e-6
    params, grads = _bf16_weights_and_grads(steps)
    plain = _run(state_lib.make_optimizer(optax.constant_schedule(lr), master_weights=False),
                 params, grads)
    mixed = _run(state_lib.make_optimizer(optax.constant_schedule(lr)), params, grads)

    reference_opt = optax.chain(optax.clip_by_global_norm(1.0),
                                optax.adamw(lr, weight_decay=0.1))
    ref = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    ref_state = reference_opt.init(ref)
    for g in grads:
        u, ref_state = reference_opt.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)

    changed = lambda st, k: float(jnp.mean(st.params[k] != params[k]))  # noqa: E731
    assert changed(plain, "w") < 0.05 and changed(plain, "norm") == 0.0
    assert changed(mixed, "w") > 0.6
    master = mixed.opt_state.master
    # The norm scales moved 1e-4 (100 steps of ~lr), under half their bfloat16 spacing at 1
    # (2^-9): still 1 in bfloat16, held in the master copy until they cross it.
    assert np.all(np.asarray(master["norm"]) < 1 - steps * lr / 2)
    for k in params:
        assert mixed.params[k].dtype == jnp.bfloat16 and master[k].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(master[k]), np.asarray(ref[k]), rtol=1e-6,
                                   atol=0)
        np.testing.assert_array_equal(np.asarray(mixed.params[k]),
                                      np.asarray(master[k].astype(jnp.bfloat16)))
    # AdamW's moments follow the float32 master copy.
    assert {x.dtype for x in jax.tree.leaves(mixed.opt_state.inner) if x.ndim} == {
        jnp.dtype(jnp.float32)}
    assert int(mixed.step) == steps


def test_master_weights_keep_float32_parameters_as_they_were():
    """float32 parameters get no copy: the state holds the wrapped optimizer's alone and the
    updates are its own."""
    opt, st, grads = _setup()
    wrapped = state_lib.with_master_weights(opt)
    wst = state_lib.init_train_state(st.params, wrapped)
    assert jax.tree.leaves(wst.opt_state.master) == []
    new = state_lib.apply_if_finite(wst, grads, wrapped, loss=jnp.float32(1.0),
                                    grad_norm=optax.tree.norm(grads))[0]
    ref = state_lib.apply_if_finite(st, grads, opt, loss=jnp.float32(1.0),
                                    grad_norm=optax.tree.norm(grads))[0]
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_skipped_update_leaves_the_master_copy():
    params, grads = _bf16_weights_and_grads(2)
    opt = state_lib.make_optimizer(optax.constant_schedule(1e-3))
    st = _run(opt, params, grads[:1])
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads[1])
    new, finite = state_lib.apply_if_finite(st, bad, opt, loss=jnp.float32(1.0),
                                            grad_norm=optax.tree.norm(bad))
    assert not bool(finite)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(st)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
