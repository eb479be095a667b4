"""Device mesh, the logical-axis rules table, and the shardings of everything that lives on device.

One mesh with axes ("data", "fsdp", "tensor") serves the sampler, the old-policy pass, DelTA and
the train step (co-located: parameters never leave the devices between rollout and update).
Placement is by JAX's own SPMD partitioning: arrays carry NamedShardings derived from LOGICAL
axis names through one rules table, and jit/GSPMD partitions the programs.

    mesh = make_mesh(data=-1, fsdp=1, tensor=1)          # -1 = the remaining devices
    rules = DEFAULT_RULES                                 # logical name -> mesh axes
    spec = logical_to_spec(("embed", "mlp"), (4096, 12288), mesh)   # P("fsdp", "tensor")
    model = shard_model(model, mesh)                      # parameters placed by their names
    state_sh = tree_shardings(train_state, mesh)          # params + optimizer state + step
    batch = put_batch({"input_ids": ids, ...}, mesh)      # rows over ("data", "fsdp")

Logical names: the parameters' names come from the model (models.transformer LAYER_AXES, the
`out_sharding` metadata of each nnx.Param); batch arrays split
their rows by the "batch" name (put_batch, constrain_batch). A mesh axis that does not divide an array
dimension is dropped for that dimension (replicated there) with a logged note, so one rules table
works for every model size and mesh. A mesh axis is used at most once per array.

Multi-host: `initialize_distributed` calls jax.distributed.initialize from explicit settings
(config.distributed.* or the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
environment), or lets JAX detect a TPU pod / SLURM job; on one process it does nothing.
`put_global` places host values that every process holds identically onto a mesh that spans
processes; `host_local_batch` does the same for per-host data shards.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

log = logging.getLogger("delta_jax.sharding")

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis name -> mesh axis (str), axes (tuple, outermost first) or None (replicated).
# Parameters are split over "fsdp" along their hidden ("embed") side and over "tensor" along the
# heads / MLP / vocabulary side (Megatron style); batches over ("data", "fsdp").
DEFAULT_RULES: dict[str, Any] = {
    # parameters (models.transformer LAYER_AXES)
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
    # activations, rollout batches
    "batch": ("data", "fsdp"),
    "sequence": None,
    "response": None,
    "hidden": None,
}

_noted: set = set()


# ----------------------------------------------------------------------------- mesh


def resolve_mesh_shape(data: int = -1, fsdp: int = 1, tensor: int = 1, *,
                       num_devices: int) -> tuple[int, int, int]:
    """The (data, fsdp, tensor) sizes for `num_devices` devices; one size may be -1 (the rest).

    Raises ValueError naming config.mesh.<axis> for sizes that are not -1 or >= 1, more than one
    -1, or a product that is not the number of devices.
    """
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not (
                size == -1 or size >= 1):
            raise ValueError(f"mesh.{name}: must be -1 (the remaining devices) or >= 1, "
                             f"got {size!r}")
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh.{free[1]}: only one mesh axis may be -1 (got {sizes})")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh.{free[0]}: -1 cannot fill {num_devices} devices with the "
                             f"other axes' product {fixed} (sizes {sizes})")
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(f"mesh.data: data x fsdp x tensor = {fixed} but there are "
                         f"{num_devices} devices (sizes {sizes}; use -1 for one axis)")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *,
              devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: all, every process's).

    Axis types are Auto (GSPMD propagation), which the model's embedding gather needs.
    jax.make_mesh orders the devices for the physical topology (ICI rings on TPU).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(data, fsdp, tensor, num_devices=len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_from_config(mesh_cfg, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """make_mesh from a config block with fields data, fsdp, tensor (config.mesh)."""
    return make_mesh(int(mesh_cfg.data), int(mesh_cfg.fsdp), int(mesh_cfg.tensor),
                     devices=devices)


def batch_axes(mesh: Mesh, rules: Mapping[str, Any] = DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes the batch is split over (for the sampler's batch_axes)."""
    return tuple(a for a in _as_tuple(rules.get("batch")) if a in mesh.axis_names)


# ----------------------------------------------------------------------------- rules


def _as_tuple(mesh_axes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return tuple(mesh_axes)


def _note(key, message):
    if key not in _noted:
        _noted.add(key)
        log.info(message)


def logical_to_spec(logical_axes: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, Any] = DEFAULT_RULES) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axis names and this shape.

    logical_axes: one name (or None) per dimension; names missing from `rules` raise KeyError.
    For each dimension the rule's mesh axes are kept left to right while their size product
    divides the dimension; a mesh axis that does not divide it (or was already used by an earlier
    dimension) is dropped there, i.e. the array is replicated over it (logged once). Size-1 mesh
    axes are left out of the spec.
    """
    if logical_axes is None:
        return PartitionSpec()
    logical_axes = tuple(logical_axes)
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {logical_axes} do not match the shape {tuple(shape)}")
    used: set = set()
    spec = []
    for name, dim in zip(logical_axes, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"sharding rules have no entry for the logical axis {name!r} "
                           f"(known: {sorted(rules)})")
        kept, size = [], 1
        for axis in _as_tuple(rules[name]):
            if axis not in mesh.shape:
                raise ValueError(f"sharding rule {name!r} -> {rules[name]!r}: {axis!r} is not a "
                                 f"mesh axis {tuple(mesh.axis_names)}")
            n = mesh.shape[axis]
            if n == 1:
                continue
            if axis in used:
                _note(("used", name, axis), f"sharding: {name!r} cannot also use mesh axis "
                      f"{axis!r} (used by an earlier dimension); replicated over it")
                continue
            if dim % (size * n):
                _note(("div", name, dim, axis), f"sharding: dimension {name!r} of size {dim} "
                      f"is not divisible by mesh axis {axis!r} ({n}) on top of {kept or 'none'};"
                      f" replicated over {axis!r}")
                continue
            kept.append(axis)
            size *= n
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def logical_sharding(logical_axes, shape, mesh: Mesh,
                     rules: Mapping[str, Any] = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _is_variable(x) -> bool:
    from flax import nnx
    return isinstance(x, nnx.Variable)


def _var_axes(var):
    axes = var.get_metadata().get("out_sharding")
    return None if axes is None else tuple(axes)


def tree_shardings(tree, mesh: Mesh, rules: Mapping[str, Any] = DEFAULT_RULES):
    """NamedShardings for every array in `tree` (same structure).

    nnx Variables (model parameters, and the Optax moments that mirror them) are placed by their
    `out_sharding` logical names; every other array (step counters, scalars) is replicated.
    Works on real arrays and on jax.eval_shape results alike.
    """
    def one(x):
        if _is_variable(x):
            axes = _var_axes(x)
            value = x.get_value() if hasattr(x, "get_value") else x.value
            spec = (PartitionSpec() if axes is None
                    else logical_to_spec(axes, value.shape, mesh, rules))
            return x.replace(NamedSharding(mesh, spec))
        if hasattr(x, "shape"):
            return replicated(mesh)
        return x

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def host_memory_kind_available(device=None) -> bool:
    """Whether `device` (default: the first local one) has a "pinned_host" memory space, where
    arrays can rest off the accelerator (GPUs and TPUs have one, and so has jax 0.10's CPU)."""
    device = jax.local_devices()[0] if device is None else device
    try:
        return "pinned_host" in {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001  (a backend without memory spaces)
        return False


def in_memory(shardings, kind: str):
    """The same shardings in memory space `kind` ("device" or "pinned_host")."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def put_global(x, sharding: NamedSharding):
    """Place `x` with `sharding`. On one process this is jax.device_put; when the mesh spans
    processes, every process must hold the same global value of x (a host array or a fully
    addressable jax.Array) and contributes only its own devices' shards (no cross-host copy)."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)  # already global: a resharding
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_tree(tree, shardings):
    """put_global over a pytree (shardings: the same structure, e.g. from tree_shardings)."""
    return jax.tree.map(put_global, tree, shardings)


def shard_model(model, mesh: Mesh, rules: Mapping[str, Any] = DEFAULT_RULES):
    """Places every variable of an nnx model by its logical names (in place; returns it)."""
    from flax import nnx
    state = nnx.state(model)
    nnx.update(model, shard_tree(state, tree_shardings(state, mesh, rules)))
    return model


def param_sharding_fn(mesh: Mesh, rules: Mapping[str, Any] = DEFAULT_RULES):
    """(path, logical axes, shape) -> NamedSharding, for models.from_pretrained(shardings=...),
    so each checkpoint tensor goes straight to its shards."""
    def fn(path, axes, shape):
        return logical_sharding(axes, shape, mesh, rules) if axes else replicated(mesh)
    return fn


# ----------------------------------------------------------------------------- batches


def _with_batch_axes(rules: Mapping[str, Any], batch_axes: Optional[Sequence[str]]):
    """`rules` with the "batch" rule replaced by explicit mesh axes (None: unchanged)."""
    return rules if batch_axes is None else {**rules, "batch": tuple(batch_axes)}


def axes_size(mesh: Optional[Mesh], axes: Sequence[str]) -> int:
    """Devices along `axes` of the mesh (the axes it has; 1 without a mesh): e.g. the number of
    batch shards over the batch axes."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in axes if a in mesh.axis_names)


def batch_sharding(shape, mesh: Mesh, rules: Mapping[str, Any] = DEFAULT_RULES, *,
                   batch_axes: Optional[Sequence[str]] = None) -> NamedSharding:
    """Rows (dim 0) over the batch axes, the other dimensions replicated. batch_axes: mesh axes
    to use instead of rules["batch"] (e.g. a sampler's own batch_axes)."""
    return logical_sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh,
                            _with_batch_axes(rules, batch_axes))


def put_rows(x, mesh: Optional[Mesh], rules: Mapping[str, Any] = DEFAULT_RULES, *,
             batch_axes: Optional[Sequence[str]] = None):
    """Places one global host array row-sharded on the mesh (put_global of batch_sharding);
    jnp.asarray without a mesh."""
    if mesh is None:
        import jax.numpy as jnp
        return jnp.asarray(x)
    return put_global(x, batch_sharding(np.shape(x), mesh, rules, batch_axes=batch_axes))


def put_batch(batch: Mapping[str, Any], mesh: Optional[Mesh],
              rules: Mapping[str, Any] = DEFAULT_RULES, *,
              batch_axes: Optional[Sequence[str]] = None) -> dict:
    """Places a dict of global host arrays row-sharded on the mesh (jnp.asarray without one)."""
    return {k: put_rows(v, mesh, rules, batch_axes=batch_axes) for k, v in batch.items()}


def constrain_batch(tree, mesh: Optional[Mesh], rules: Mapping[str, Any] = DEFAULT_RULES,
                    axis: int = 0, *, batch_axes: Optional[Sequence[str]] = None,
                    others=None):
    """with_sharding_constraint: dim `axis` of every array over the batch axes (inside jit).
    No-op without a mesh. batch_axes: mesh axes instead of rules["batch"]. others: the spec of
    the other dimensions, None (replicated) or PartitionSpec.UNCONSTRAINED (left to the
    compiler)."""
    if mesh is None:
        return tree
    rules = _with_batch_axes(rules, batch_axes)

    def one(x):
        axes = [None] * x.ndim
        axes[axis] = "batch"
        spec = logical_to_spec(axes, x.shape, mesh, rules)
        if others is not None:
            entries = tuple(spec) + (None,) * (x.ndim - len(spec))
            spec = PartitionSpec(*(e if d == axis else others for d, e in enumerate(entries)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return jax.tree.map(one, tree)


# The mesh and batch axes a model pass keeps its rows over (rows_over_batch), read where the
# model is traced.
_ROWS = contextvars.ContextVar("delta_jax_rows_over_batch", default=None)


@contextlib.contextmanager
def rows_over_batch(mesh: Optional[Mesh], rules: Mapping[str, Any] = DEFAULT_RULES):
    """Within it (entered where a jitted pass traces the model), models.Transformer keeps the
    rows of its residual stream over the mesh's batch axes at every layer's input and output
    (constrain_rows). Left to itself, XLA's partitioner served FSDP-sharded layer weights by
    gathering a micro-batch's activations onto every device instead of the weights: in the
    Qwen3-1.7B train step over 4 devices (fsdp=4, micro-batches of 8 x 4,096), all-gathers of
    [8, 4,096, 2,048] hidden states and all-reduces of [8, 4,096, 6,144] MLP activations in
    every layer, where FSDP gathers each layer's weights (tests/test_sharding.py). No-op
    without a mesh or with one batch shard (a one-device program is left as it was)."""
    axes = () if mesh is None else tuple(a for a in batch_axes(mesh, rules) if mesh.shape[a] > 1)
    token = _ROWS.set((mesh, axes) if axes else None)
    try:
        yield
    finally:
        _ROWS.reset(token)


def constrain_rows(x):
    """x with dim 0 over the batch axes of the enclosing rows_over_batch (its other dimensions
    left to the compiler); x itself outside one, or where those axes do not divide dim 0."""
    held = _ROWS.get()
    if held is None:
        return x
    mesh, axes = held
    if x.shape[0] % axes_size(mesh, axes):
        return x
    spec = PartitionSpec(axes, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ----------------------------------------------------------------------------- multi-host


def distributed_settings(coordinator_address: str = "", num_processes: int = 0,
                         process_id: int = -1, env: Optional[Mapping[str, str]] = None) -> dict:
    """Explicit jax.distributed settings from arguments, else the environment
    (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); {} when none are given."""
    env = os.environ if env is None else env
    address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS", "")
    if not address:
        return {}
    n = num_processes or int(env.get("JAX_NUM_PROCESSES", "0") or 0)
    pid = process_id if process_id >= 0 else int(env.get("JAX_PROCESS_ID", "-1") or -1)
    if n < 1:
        raise ValueError("distributed.num_processes: needed with a coordinator address "
                         "(or set JAX_NUM_PROCESSES)")
    if not 0 <= pid < n:
        raise ValueError(f"distributed.process_id: must be in [0, {n}) with a coordinator "
                         f"address (or set JAX_PROCESS_ID), got {pid}")
    return {"coordinator_address": address, "num_processes": n, "process_id": pid}


def _cluster_detected(env: Mapping[str, str]) -> bool:
    """A multi-process TPU pod slice or SLURM job, where jax.distributed finds its settings."""
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    if hosts and len([h for h in hosts.split(",") if h.strip()]) > 1:
        return True
    return int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env


def distributed_started() -> bool:
    """Whether jax.distributed has been started in this process (a multi-process run)."""
    from jax._src import distributed as _dist  # is_initialized is not public in jax 0.10
    return getattr(_dist.global_state, "client", None) is not None


def from_process_0(value):
    """Process 0's `value` (a numpy scalar) on every process of a multi-process run: what process
    0 alone read (a file of the run directory) becomes every process's answer, to the bit (a
    float64 or int64 travels as its bytes: jax without x64 would narrow it to 32 bits). A
    collective; with one process the value itself."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    value = np.asarray(value)
    words = value.reshape(1).view(np.uint8).astype(np.int32)  # bytes as int32: no dtype narrows
    got = np.asarray(multihost_utils.broadcast_one_to_all(words)).astype(np.uint8)
    return got.view(value.dtype)[0].item()


def initialize_distributed(coordinator_address: str = "", num_processes: int = 0,
                           process_id: int = -1, *, local_device_ids=None,
                           heartbeat_timeout_s: int = 100,
                           env: Optional[Mapping[str, str]] = None) -> tuple[int, int]:
    """Starts jax.distributed when the run has several processes; returns
    (process_index, process_count). Call before anything touches the devices.

    Explicit settings (arguments or JAX_* env) win; otherwise a TPU pod slice or a SLURM job
    with several tasks is detected by JAX itself; otherwise this is a single-process run.
    On CPU the cross-process collectives use gloo.
    """
    env = os.environ if env is None else env
    settings = distributed_settings(coordinator_address, num_processes, process_id, env)
    if not settings and not _cluster_detected(env):
        return 0, 1
    if not distributed_started():
        if "cpu" in str(env.get("JAX_PLATFORMS", "")).lower():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(local_device_ids=local_device_ids,
                                   heartbeat_timeout_seconds=int(heartbeat_timeout_s), **settings)
        if jax.process_count() > 1:  # creates the backend
            _backends_up_barrier()
    return jax.process_index(), jax.process_count()


class PartnerGone(RuntimeError):
    """The coordination service (process 0's) went away while this process started: another
    process of the run stopped (its own log says why)."""


def _backends_up_barrier(timeout_s: int = 300) -> None:
    """Waits until every process has created its backend. Creating it takes more than one
    exchange with the coordination service (process 0's), so without this a process that fails
    at once after its own (its workdir held by another run, a bad file) can take the service
    down while another is still mid-way, which then dies of a gRPC error in start-up ("Socket
    closed") instead of being stopped by the distributed runtime as a partner's failure.
    Process 0 can still leave right after the barrier, before another's reply from it arrives:
    that reply's UNAVAILABLE is raised as PartnerGone (delta_jax.main: one line, no
    traceback), as the distributed runtime would stop this process anyway."""
    from jax._src import distributed as _dist
    try:
        _dist.global_state.client.wait_at_barrier("delta_jax_backends_up",
                                                  timeout_in_ms=timeout_s * 1000)
    except jax.errors.JaxRuntimeError as e:
        if "UNAVAILABLE" not in str(e):
            raise
        cause = (str(e).strip().splitlines() or [""])[0][:300]
        raise PartnerGone("jax.distributed: the coordination service (process 0's) went away "
                          "while this process started: another process of the run stopped; "
                          f"its log says why ({cause})") from None
