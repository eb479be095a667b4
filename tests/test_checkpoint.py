"""Orbax checkpoints: round trip of params + optimizer state + data state, keep-M, latest step."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import logging
import pathlib

import pytest

from delta_jax.train.checkpoint import Checkpointer, CheckpointError
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


def _largest_file(directory: pathlib.Path) -> pathlib.Path:
    files = [p for p in directory.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(step_dir):
    f = _largest_file(step_dir / "state")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _scramble(step_dir):
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 16:
            data = bytearray(f.read_bytes())
            data[8:] = bytes(255 - b for b in data[8:])
            f.write_bytes(bytes(data))


def _drop_metadata(step_dir):
    for f in step_dir.rglob("*"):
        if f.is_file() and "metadata" in f.name.lower():
            f.unlink()


def _garbage_meta(step_dir):
    for f in (step_dir / "meta").rglob("*"):
        if f.is_file():
            f.write_text("{not json")


def _saved_steps(directory, steps):
    """`directory` with a checkpoint of _state(step) (data {"iter": step}) at each step."""
    ckpt = Checkpointer(str(directory), keep=3)
    for step in steps:
        ckpt.save(step, _state(step), {"iter": step}, {"step": step}, force=True)
    ckpt.close()
    return directory


@pytest.mark.parametrize("corrupt", [_truncate, _scramble, _drop_metadata, _garbage_meta],
                         ids=["truncated", "scrambled", "no-metadata", "garbage-meta"])
def test_restore_latest_falls_back_past_an_unreadable_checkpoint(tmp_path, corrupt, caplog):
    directory = _saved_steps(tmp_path / "ckpt", (1, 2))
    corrupt(directory / "2")
    ckpt = Checkpointer(str(directory), keep=3)
    with caplog.at_level(logging.WARNING, logger="delta_jax.train"):
        found = ckpt.restore_latest(_state(0))
    assert found is not None
    step, state, data, meta = found
    assert step == 1 and data == {"iter": 1} and meta == {"step": 1}
    np.testing.assert_array_equal(np.asarray(state.params["kernel"][...]),
                                  np.asarray(_state(1).params["kernel"][...]))
    text = caplog.text
    assert "skipping checkpoint 2" in text and str(directory / "2") in text
    # Set aside, not deleted: the resumed run saves step 2 again.
    assert ckpt.all_steps() == [1] and (directory / "unreadable-2").is_dir()
    assert ckpt.save(2, _state(2), {"iter": 2}, {"step": 2})
    ckpt.close()


def test_a_read_only_checkpointer_reads_and_changes_nothing(tmp_path, caplog):
    """read_only (mode=eval): no directory made where there is none; past an unreadable newest
    checkpoint it reads the older one and leaves the newer where it is; it refuses to save."""
    missing = tmp_path / "none"
    reader = Checkpointer(str(missing), read_only=True)
    assert reader.restore_latest(_state(0)) is None and not missing.exists()
    reader.close()
    directory = _saved_steps(tmp_path / "ckpt", (1, 2))
    _truncate(directory / "2")
    before = sorted(p.relative_to(directory) for p in directory.rglob("*"))
    reader = Checkpointer(str(directory), read_only=True)
    with caplog.at_level(logging.WARNING, logger="delta_jax.train"):
        step, _, data, _ = reader.restore_latest(_state(0))
    assert step == 1 and data == {"iter": 1}
    assert "left as they are" in caplog.text
    with pytest.raises(RuntimeError, match="read-only"):
        reader.save(3, _state(3), {}, {}, force=True)
    reader.close()
    assert sorted(p.relative_to(directory) for p in directory.rglob("*")) == before


def test_restore_latest_skips_a_checkpoint_another_process_cannot_read(tmp_path, monkeypatch,
                                                                      caplog):
    """Multi-process resume: when another process fails to read checkpoint 2 (a damaged shard
    only it reads), this one, which reads 2 fine, skips it too and resumes from 1 with it.
    The other process stands in as readable_everywhere's answer (its real all-gather runs in
    tests/test_multihost.py's two-process resume)."""
    from delta_jax.train import checkpoint as checkpoint_lib

    directory = _saved_steps(tmp_path / "ckpt", (1, 2))
    ckpt = Checkpointer(str(directory), keep=3)
    asked = []

    def other_process_fails_on_2(ok):
        asked.append(ok)
        return ok and len(asked) > 1  # the first candidate (2) fails on the other process

    monkeypatch.setattr(checkpoint_lib, "readable_everywhere", other_process_fails_on_2)
    with caplog.at_level(logging.WARNING, logger="delta_jax.train"):
        step, state, data, _ = ckpt.restore_latest(_state(0))
    assert asked == [True, True]  # this process read both
    assert step == 1 and data == {"iter": 1}
    np.testing.assert_array_equal(np.asarray(state.params["kernel"][...]),
                                  np.asarray(_state(1).params["kernel"][...]))
    assert "skipping checkpoint 2" in caplog.text and "another process" in caplog.text
    ckpt.close()


def test_restore_errors_name_the_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(str(directory))
    ckpt.save(1, _state(1), {"iter": 1}, {"step": 1}, force=True)
    ckpt.close()
    _garbage_meta(directory / "1")
    ckpt = Checkpointer(str(directory))
    with pytest.raises(CheckpointError, match=str(directory / "1")):
        ckpt.restore(1, _state(0))
    with pytest.raises(CheckpointError, match="no checkpoint in .* reads back"):
        ckpt.restore_latest(_state(0))
    ckpt.close()


def test_a_checkpointer_logs_no_warning_of_its_own_array_handler(tmp_path, caplog):
    """Replacing orbax's jax.Array handler (MIN_REPLICA_SLICE_BYTES) is deliberate: orbax's
    warning about it is not shown at every run's start, and other absl warnings still are."""
    import absl.logging
    with caplog.at_level(logging.WARNING):
        Checkpointer(str(tmp_path / "a"))
        Checkpointer(str(tmp_path / "b"))
        absl.logging.warning("still shown")
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "overriding" in m], messages
    assert "still shown" in messages


@pytest.mark.devices(8)
def test_replicated_arrays_are_sliced_per_replica_only_when_big(tmp_path, monkeypatch):
    """An array that all 8 devices hold: under MIN_REPLICA_SLICE_BYTES a replica, one replica
    writes it whole (no device slice dispatched); at the threshold, orbax still splits it over
    the replicas (one slice each). Both read back exactly, beside an array sharded over the
    devices."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from delta_jax.train.checkpoint import MIN_REPLICA_SLICE_BYTES

    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    big_rows = 8 * MIN_REPLICA_SLICE_BYTES // (4 * 64)   # 8 replicas x the threshold each
    rng = np.random.default_rng(0)
    state = {"small": jax.device_put(rng.normal(size=(16, 64)).astype(np.float32), replicated),
             "big": jax.device_put(rng.normal(size=(big_rows, 64)).astype(np.float32),
                                   replicated),
             "sharded": jax.device_put(rng.normal(size=(64, 8)).astype(np.float32), split)}
    sliced = []
    real = jax.lax.slice_in_dim

    def counting(operand, *args, **kwargs):
        sliced.append(operand.shape)
        return real(operand, *args, **kwargs)

    monkeypatch.setattr(jax.lax, "slice_in_dim", counting)
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    assert ckpt.save(0, state, None, {}, force=True)
    assert sliced == [(big_rows, 64)] * 8, sliced
    got, _, _ = ckpt.restore(0, state)
    ckpt.close()
    for name in state:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(state[name]))
        assert got[name].sharding.is_equivalent_to(state[name].sharding, 2), name


def _bf16_state(master_weights):
    _, params, _ = split_model(nnx.Linear(4, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    opt = make_optimizer(optax.constant_schedule(1e-2), master_weights=master_weights)
    state = init_train_state(params, opt)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.3, jnp.float32), params)
    updates, opt_state = opt.update(grads, state.opt_state, params)
    return state.replace(params=optax.apply_updates(params, updates), opt_state=opt_state)


def test_a_bfloat16_state_round_trips_with_its_float32_master_copy(tmp_path):
    saved = _bf16_state(True)
    assert {x.dtype for x in jax.tree.leaves(saved.opt_state.master)} == {jnp.dtype(jnp.float32)}
    ckpt = Checkpointer(str(tmp_path / "ckpt"), save_every=1, keep=1)
    ckpt.save(1, saved, {}, {}, force=True)
    state, _, _ = ckpt.restore(1, _bf16_state(True))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()


def test_a_state_of_another_layout_names_the_settings(tmp_path):
    """A bfloat16 run's checkpoint without the master copy (optim.master_weights=False, or
    written before it existed) does not read into a state that has one: the error says which
    settings change the layout."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"), save_every=1, keep=1)
    ckpt.save(1, _bf16_state(False), {}, {}, force=True)
    with pytest.raises(CheckpointError, match=r"holds 9 arrays .* has 11: .*optim.master_weights"):
        ckpt.restore(1, _bf16_state(True))
    state, _, _ = ckpt.restore(1, _bf16_state(False))  # the setting it was written with
    assert int(state.step) == 0
    ckpt.close()


def test_a_partial_restore_reads_the_parameters_alone(tmp_path):
    """restore(partial=True) with {"params": ...} (what mode=eval reads): the saved parameters
    bit for bit, with the target's structure, dtypes and shardings, whichever optimizer layout
    the checkpoint holds (here a bfloat16 one with its float32 master copy), and nothing else;
    restore_latest passes it on."""
    saved = _bf16_state(True)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), save_every=1, keep=1)
    ckpt.save(3, saved, {"iter": 3}, {"seed": 1}, force=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree.map(lambda p: jax.device_put(jnp.zeros_like(p), spec), saved.params)
    for state, meta in (ckpt.restore(3, {"params": target}, partial=True)[::2],
                        ckpt.restore_latest({"params": target}, partial=True)[1::2]):
        assert set(state) == {"params"} and meta == {"seed": 1}
        assert jax.tree.structure(state["params"]) == jax.tree.structure(saved.params)
        for a, b in zip(jax.tree.leaves(saved.params), jax.tree.leaves(state["params"])):
            assert a.dtype == b.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                          np.asarray(b.astype(jnp.float32)))
            assert b.sharding.is_equivalent_to(spec, b.ndim)
    ckpt.close()
