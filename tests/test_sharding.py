"""delta_jax.sharding: mesh sizes, the rules table with its divisibility fallback, tree and batch
shardings, the KV cache, multi-host settings. (The full RL step on meshes is in
test_sharded_rl_step.py; two processes in test_multihost.py.)"""
import logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from delta_jax import models, sharding


def test_resolve_mesh_shape():
    assert sharding.resolve_mesh_shape(-1, 1, 1, num_devices=8) == (8, 1, 1)
    assert sharding.resolve_mesh_shape(2, -1, 2, num_devices=8) == (2, 2, 2)
    assert sharding.resolve_mesh_shape(1, 4, 2, num_devices=8) == (1, 4, 2)
    with pytest.raises(ValueError, match="mesh.fsdp: only one"):
        sharding.resolve_mesh_shape(-1, -1, 1, num_devices=8)
    with pytest.raises(ValueError, match="mesh.data: -1 cannot fill"):
        sharding.resolve_mesh_shape(-1, 3, 1, num_devices=8)
    with pytest.raises(ValueError, match="4 but there are 8"):
        sharding.resolve_mesh_shape(2, 2, 1, num_devices=8)
    with pytest.raises(ValueError, match="mesh.tensor"):
        sharding.resolve_mesh_shape(-1, 1, 0, num_devices=8)


@pytest.mark.devices(8)
def test_make_mesh_axes_and_types():
    mesh = sharding.make_mesh(2, -1, 2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert sharding.batch_axes(mesh) == ("data", "fsdp")
    mesh = sharding.make_mesh(4, 2, 1)
    assert sharding.axes_size(mesh, ("data", "fsdp")) == 8
    assert sharding.axes_size(mesh, ("fsdp", "expert")) == 2  # axes the mesh lacks count 1
    assert sharding.axes_size(None, ("data",)) == sharding.axes_size(mesh, ()) == 1


@pytest.mark.devices(8)
def test_rules_and_divisibility_fallback(caplog):
    mesh = sharding.make_mesh(2, 2, 2)
    spec = sharding.logical_to_spec
    assert spec(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
    assert spec(("layers", "embed", "q_heads", "head_dim"), (2, 64, 4, 8), mesh) == \
        P(None, "fsdp", "tensor")
    assert spec(("batch", "sequence"), (8, 5), mesh) == P(("data", "fsdp"))
    # 6 rows: data (2) divides, data x fsdp (4) does not -> rows over data only, with a note.
    with caplog.at_level(logging.INFO, logger="delta_jax.sharding"):
        assert spec(("batch",), (6,), mesh) == P("data")
        assert spec(("vocab", "embed"), (99, 64), mesh) == P(None, "fsdp")
    assert "not divisible" in caplog.text
    # A mesh axis is used once per array: the second "tensor" dimension is replicated.
    assert spec(("mlp", "vocab"), (8, 8), mesh) == P("tensor")
    # Size-1 mesh axes are left out.
    assert spec(("embed", "mlp"), (64, 128), sharding.make_mesh(-1, 1, 1)) == P()
    with pytest.raises(KeyError, match="no entry for the logical axis 'nope'"):
        spec(("nope",), (4,), mesh)
    with pytest.raises(ValueError, match="do not match the shape"):
        spec(("embed",), (4, 4), mesh)


@pytest.mark.devices(8)
def test_tree_shardings_place_params_and_replicate_the_rest():
    cfg = models.get_preset("tiny")
    mesh = sharding.make_mesh(1, 4, 2)
    model = sharding.shard_model(models.Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    state = nnx.state(model, nnx.Param)
    q = state["layers"]["q_proj"][...]
    assert q.sharding.shard_shape(q.shape) == (2, 64 // 4, 4 // 2, 32)
    emb = state["embed"][...]
    assert emb.sharding.shard_shape(emb.shape) == (256 // 2, 64 // 4)
    tree = {"params": state, "step": jnp.zeros((), jnp.int32)}
    sh = sharding.tree_shardings(tree, mesh)
    assert sh["step"].spec == P()
    assert sh["params"]["lm_head"].get_value().spec == P("fsdp", "tensor")
    # The model still computes the same function once sharded.
    ids = jnp.asarray(np.arange(16).reshape(2, 8) % 256, jnp.int32)
    ref = models.Transformer(cfg, rngs=nnx.Rngs(0))(ids).logits
    np.testing.assert_allclose(model(ids).logits, ref, atol=1e-5)


@pytest.mark.devices(8)
def test_put_batch_and_constraint():
    mesh = sharding.make_mesh(2, 4, 1)
    batch = {"input_ids": np.arange(8 * 3).reshape(8, 3).astype(np.int32),
             "advantages": np.arange(8, dtype=np.float32)}
    placed = sharding.put_batch(batch, mesh)
    assert placed["input_ids"].sharding.shard_shape((8, 3)) == (1, 3)
    assert placed["advantages"].sharding.shard_shape((8,)) == (1,)
    np.testing.assert_array_equal(placed["input_ids"], batch["input_ids"])

    @jax.jit
    def f(x):
        return sharding.constrain_batch(x * 2, mesh, axis=1)

    out = f(jnp.ones((3, 8, 2)))
    assert out.sharding.shard_shape((3, 8, 2)) == (3, 1, 2)
    unplaced = sharding.put_batch(batch, None)
    assert len(unplaced["input_ids"].sharding.device_set) == 1


@pytest.mark.devices(8)
def test_explicit_batch_axes_and_unconstrained_others():
    """batch_axes= overrides rules["batch"] (the sampler's own axes); others= leaves the other
    dimensions to the compiler."""
    mesh = sharding.make_mesh(2, 4, 1)
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    assert sharding.put_rows(x, mesh, batch_axes=("data",)).sharding.shard_shape((8, 3)) == (4, 3)
    assert sharding.put_rows(x, mesh, batch_axes=()).sharding.shard_shape((8, 3)) == (8, 3)
    assert sharding.put_rows(x, None).sharding.device_set == {jax.devices()[0]}

    jaxpr = jax.make_jaxpr(lambda y: sharding.constrain_batch(
        y, mesh, axis=1, batch_axes=("fsdp",), others=P.UNCONSTRAINED))(jnp.ones((3, 8, 2)))
    (eqn,) = jaxpr.eqns
    assert eqn.params["sharding"].spec == P(P.UNCONSTRAINED, "fsdp", P.UNCONSTRAINED)
    out = jax.jit(lambda y: sharding.constrain_batch(y, mesh, axis=1, batch_axes=("fsdp",)))(
        jnp.ones((3, 8, 2)))
    assert out.sharding.spec == P(None, "fsdp")


@pytest.mark.devices(4)
def test_rows_over_batch_constrains_only_inside_with_several_batch_shards():
    """constrain_rows is the identity outside rows_over_batch, inside it for a mesh of one batch
    shard and for rows the batch shards do not divide; inside it on a 4-device mesh it puts
    dim 0 over (data, fsdp) (read from the traced program's sharding annotation)."""
    x = jnp.zeros((8, 3))
    assert sharding.constrain_rows(x) is x
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    with sharding.rows_over_batch(one):
        assert sharding.constrain_rows(x) is x
    four = sharding.make_mesh(2, 2, 1, devices=jax.devices()[:4])
    with sharding.rows_over_batch(four):
        odd = jnp.zeros((6, 3))
        assert sharding.constrain_rows(odd) is odd
        text = jax.jit(sharding.constrain_rows).lower(x).as_text()
    assert "sharding_constraint" in text and '"data", "fsdp"' in text, text


def _fsdp_collectives(rows: int, micro: int, seq: int) -> set:
    """{(op, result shape)} of the collectives in the trainer's train step, old-policy pass and
    SFT step of the tiny model (full remat) over a 4-device fsdp mesh, rows of `seq` tokens
    (the train step's in micro-batches of `micro`), compiled from abstract shapes."""
    from jax.sharding import Mesh
    from delta_jax.train import state as state_lib
    from delta_jax.train.config import default_config, resolve_method
    from delta_jax.train.features import make_old_policy_pass
    from delta_jax.train.run import make_loss_fn
    from delta_jax.train.sft import make_sft_step
    from delta_jax.train.step import make_train_step

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4, 1), ("data", "fsdp", "tensor"))
    mc = models.get_preset("tiny", remat="full")
    graphdef, params, rest = state_lib.split_model(
        nnx.eval_shape(lambda: models.Transformer(mc, rngs=nnx.Rngs(0))))
    optimizer = state_lib.make_optimizer(lambda _: 1e-6)
    state, shardings = state_lib.abstract_train_state(params, optimizer, mesh)
    step = make_train_step(graphdef, rest, optimizer, make_loss_fn(resolve_method(
        default_config())), temperature=1.0, chunk_size=4096, micro_batch_size=micro,
        mesh=mesh, state_shardings=shardings)

    def rows_of(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(shape, mesh))
    response = seq // 2
    batch = {"input_ids": rows_of((rows, seq), jnp.int32),
             "attention_mask": rows_of((rows, seq), jnp.int32),
             "advantages": rows_of((rows,), jnp.float32),
             **{k: rows_of((rows, response), jnp.float32)
                for k in ("old_logp", "response_mask", "token_weights")}}
    old_pass = make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=4096, mesh=mesh)
    sft_step = make_sft_step(graphdef, rest, optimizer, chunk_size=4096, mesh=mesh,
                             state_shardings=shardings)
    sft_batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                 "loss_mask": rows_of((rows, seq), jnp.float32)}
    texts = [step.lower(state, batch).compile().as_text(),
             old_pass.lower(state.params, batch["input_ids"], batch["attention_mask"],
                            response).compile().as_text(),
             sft_step.lower(state, sft_batch).compile().as_text()]
    ops = "all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    return {(m.group(2), m.group(1)) for text in texts
            for m in re.finditer(rf"= (\w+\[[\d,]*\])\S* ({ops})(?:-start)?\(", text)}


@pytest.mark.devices(4)
def test_fsdp_passes_gather_weights_not_activations(monkeypatch):
    """Over a 4-device fsdp mesh the train step, the old-policy pass and the SFT step keep each
    row's activations on its device and gather the layers' weights (FSDP): no collective moves a
    [micro-batch rows, seq, ...] activation. Without sharding.rows_over_batch's constraints
    (constrain_rows made the identity) XLA's partitioner moves activations instead, which
    the same check sees."""
    rows, micro, seq = 16, 8, 256

    def activations(found):  # float [micro-batch or pass rows, seq, features...] results
        return sorted(c for c in found if re.fullmatch(rf"(f32|bf16)\[({micro}|{rows}),{seq},"
                                                        r"[\d,]+\]", c[1]))
    found = _fsdp_collectives(rows, micro, seq)
    assert activations(found) == [], activations(found)
    tiny = models.get_preset("tiny")
    hidden, mlp = tiny.hidden_size, tiny.intermediate_size
    assert any(op == "all-gather" and shape.endswith((f"[{hidden},{mlp}]", f"[{mlp},{hidden}]"))
               for op, shape in found), sorted(found)       # an MLP weight gathered
    monkeypatch.setattr(sharding, "constrain_rows", lambda x: x)
    unconstrained = activations(_fsdp_collectives(rows, micro, seq))
    # both passes: the step's micro-batch and the old pass's rows
    assert {shape.split(",")[0] for _, shape in unconstrained} == {f"f32[{micro}", f"f32[{rows}"}


def test_sharding_is_the_bottom_layer():
    """delta_jax.sharding imports no delta_jax module (the models import it, not the reverse),
    also when its sharding and batch helpers run."""
    code = (
        "import sys, jax, numpy as np\n"
        "import delta_jax.sharding as s\n"
        "mesh = s.make_mesh(-1, 1, 1)\n"
        "s.logical_sharding(('batch', 'kv_heads', 'head_dim'), (4, 8, 16), mesh)\n"
        "s.put_batch({'x': np.zeros((4, 2))}, mesh)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('delta_jax.'))\n"
        "assert loaded == ['delta_jax.sharding'], loaded\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, cwd=pathlib.Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_distributed_settings():
    assert sharding.distributed_settings(env={}) == {}
    got = sharding.distributed_settings(env={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
                                             "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"})
    assert got == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    got = sharding.distributed_settings("h:1", 2, 0, env={"JAX_COORDINATOR_ADDRESS": "x:2"})
    assert got["coordinator_address"] == "h:1"
    with pytest.raises(ValueError, match="distributed.num_processes"):
        sharding.distributed_settings("h:1", env={})
    with pytest.raises(ValueError, match="distributed.process_id"):
        sharding.distributed_settings("h:1", 2, 5, env={})
    # No coordinator and no cluster: a single-process run, nothing is initialised.
    assert sharding.initialize_distributed(env={}) == (0, 1)


def test_a_partner_gone_at_start_up_is_one_clear_error(monkeypatch):
    """The start-up barrier's reply lost because process 0 (the coordination service) left right
    after it (gRPC UNAVAILABLE) is PartnerGone, which delta_jax.main reports in one line; any
    other failure of the barrier (a timeout: DEADLINE_EXCEEDED) stays what it is."""
    import jax
    from jax._src import distributed as _dist

    class Client:
        def __init__(self, message):
            self.message = message

        def wait_at_barrier(self, name, timeout_in_ms):
            raise jax.errors.JaxRuntimeError(self.message)

    monkeypatch.setattr(_dist.global_state, "client", Client(
        "UNAVAILABLE: Failed to send RPC to coordination service. Socket closed"))
    with pytest.raises(sharding.PartnerGone, match="another process of the run stopped"):
        sharding._backends_up_barrier()
    monkeypatch.setattr(_dist.global_state, "client", Client("DEADLINE_EXCEEDED: barrier"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="DEADLINE_EXCEEDED"):
        sharding._backends_up_barrier()


@pytest.mark.parametrize("env,started", [
    ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, True),        # a multi-host TPU pod slice
    ({"TPU_WORKER_HOSTNAMES": "t0"}, False),                # one TPU host
    ({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "42"}, True),    # a SLURM job of 8 tasks
    ({"SLURM_NTASKS": "1", "SLURM_JOB_ID": "42"}, False),   # a one-task SLURM job
    ({"SLURM_NTASKS": "8"}, False),                         # not inside a job
])
def test_a_pod_slice_or_slurm_job_starts_jax_distributed_with_its_own_settings(
        env, started, monkeypatch):
    """Without explicit settings, jax.distributed.initialize is called (with no address, so JAX
    reads the cluster's) exactly on a multi-host TPU slice or a multi-task SLURM job."""
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    assert sharding.initialize_distributed(env=env) == (0, 1)  # the patched call starts nothing
    assert calls == ([{"local_device_ids": None, "heartbeat_timeout_seconds": 100}] if started
                     else [])


def test_host_memory_kind_is_found_where_a_device_has_one():
    """The CPU backend has a pinned_host memory space (as GPUs and TPUs do); a device without
    memory spaces, or one that raises when asked, has none."""
    class NoSpaces:
        def addressable_memories(self):
            raise NotImplementedError

    class DeviceOnly:
        def addressable_memories(self):
            return [type("M", (), {"kind": "device"})()]

    assert sharding.host_memory_kind_available()
    assert not sharding.host_memory_kind_available(NoSpaces())
    assert not sharding.host_memory_kind_available(DeviceOnly())
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    tree = {"a": sharding.replicated(mesh)}
    assert sharding.in_memory(tree, "pinned_host")["a"].memory_kind == "pinned_host"
