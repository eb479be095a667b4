"""Orbax checkpoints: round trip of params + optimizer state + data state, keep-M, latest step."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from delta_jax.train.checkpoint import Checkpointer
from delta_jax.train.state import init_train_state, make_optimizer, split_model


def _state(seed):
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(seed))
    _, params, _ = split_model(model)
    opt = make_optimizer(optax.constant_schedule(1e-2))
    state = init_train_state(params, opt)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = opt.update(grads, state.opt_state, params)
    return state.replace(params=optax.apply_updates(params, updates), opt_state=opt_state,
                         step=jnp.asarray(seed, jnp.int32))


def test_round_trip_keep_and_latest(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), save_every=2, keep=2)
    assert ckpt.latest_step() is None
    saved = {}
    for step in range(1, 7):
        state = _state(step)
        did = ckpt.save(step, state, {"iter": step, "epoch": 0}, {"seed": 7, "step": step})
        assert did == (step % 2 == 0)
        if did:
            saved[step] = state
    assert ckpt.all_steps() == [4, 6]          # keep = 2
    assert ckpt.latest_step() == 6
    assert ckpt.save(5, _state(5), None, {}, force=True)
    ckpt.close()

    # A fresh manager (a resumed process) finds the same checkpoints.
    ckpt = Checkpointer(str(tmp_path / "ckpt"), save_every=2, keep=2)
    assert ckpt.latest_step() == 6
    target = _state(0)
    state, data, meta = ckpt.restore(6, target)
    assert data == {"iter": 6, "epoch": 0} and meta == {"seed": 7, "step": 6}
    want = jax.tree.leaves(saved[6])
    got = jax.tree.leaves(state)
    assert len(want) == len(got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(state) == jax.tree.structure(target)
    ckpt.close()
