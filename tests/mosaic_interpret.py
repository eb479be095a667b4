"""Run Mosaic GPU kernels on the CPU: Mosaic GPU's own interpreter (jax's private
jax._src.pallas.mosaic_gpu.interpret: simulated shared memory, barriers, TMA copies), completed
for what a flash-attention kernel uses and it lacks. jax 0.10 (the CPU venv's) lacks:

  * layout casts (register layouts do not exist in the interpreter: identity);
  * a WGMMA whose B operand is a transposed view of a shared-memory buffer (ref.transpose);
  * a WGMMA whose A operand is a register array (the probabilities of P V);
  * the race detector's check of WGMMA operands read from shared memory, like any other read
    (the interpreter's own WGMMA skips it);
  * griddepcontrol.wait / .launch_dependents (programmatic dependent launch; nothing to order
    in an interpreter that runs one kernel at a time: no-ops, here and under jax 0.11).

What catches a skipped barrier wait: the race detector sees a TMA copy into a buffer that is
then stored to or loaded from without the wait (tests/test_paged_decode.py's positive control);
a WGMMA operand read that skips the wait it does not flag, but the interpreter refuses a barrier
that completes again before a thread observed its previous completion, so a skipped K or V wait
in the kernel's pipelined loop fails the interpreted cases that reuse barriers (checked by hand
on 2026-11-24 under jax 0.10.2 and 0.11.2: removing either wait fails the stages=1 case).

jax 0.11 (the GPU image's) and 0.12 reworked the interpreter and handle the first two and the
operand reads themselves; only the register A operand is added there.

The kernel's own code runs unchanged (plgpu.kernel under force_gpu_interpret_mode); only the
interpreter is extended, here, for tests. `available()` says whether this jax has the pieces
(the module is private: a jax without them skips the tests that use it, with that reason).

    with mosaic_interpret.interpreting():
        out = kernel(*args)        # numpy on the CPU, barrier and copy semantics simulated
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect

import numpy as np


def _modules():
  from jax._src.interpreters import mlir
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret, params
  from jax._src.state import types as state_types
  return mlir, gpu_core, gpu_callbacks, jaxpr_interpret, params, state_types


@functools.lru_cache(maxsize=None)
def available() -> str | None:
  """None if this jax's interpreter, extended here, runs a probe kernel right (TMA copies, a
  transposed and a register WGMMA operand, layout casts); else why not. The interpreter is
  private and changes between jax versions: a version this module does not fit is skipped with
  this reason rather than failing."""
  try:
    mlir, gpu_core, gpu_callbacks, jaxpr_interpret, params, _ = _modules()
  except (ImportError, AttributeError) as e:
    return f"no Mosaic GPU interpreter in this jax ({e})"
  for owner, name in ((gpu_callbacks, "wgmma"), (gpu_callbacks, "_get_shared_memory"),
                      (gpu_callbacks, "HostAllocationKey"), (gpu_core, "layout_cast_p"),
                      (jaxpr_interpret.JaxprInterpreter, "_interpret_wgmma_ref_p"),
                      (params, "force_gpu_interpret_mode")):
    if not hasattr(owner, name):
      return f"this jax's Mosaic GPU interpreter lacks {name}"
  try:
    error = _probe()
  except Exception as e:  # noqa: BLE001  (any failure means: not usable here)
    error = f"{type(e).__name__}: {str(e)[:200]}"
  return None if error is None else f"the extended Mosaic GPU interpreter fails a probe: {error}"


def _probe() -> str | None:
  """(a b^T) c on 64 x 64 bf16 tiles, a, b, c copied to shared memory by TMA, the first product
  read back to registers and fed to the second WGMMA as its A operand; None if numpy agrees."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  n = 64
  rng = np.random.default_rng(0)
  a, b, c = (jnp.asarray(rng.standard_normal((n, n)) / 8, jnp.bfloat16) for _ in range(3))
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def kernel(a_ref, b_ref, c_ref, o_ref, a_s, b_s, c_s, o_s, bar):
    for i, (src, dst) in enumerate(((a_ref, a_s), (b_ref, b_s), (c_ref, c_s))):
      plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
    for i in range(3):
      plgpu.barrier_wait(bar.at[i])

    def ab(acc):
      plgpu.wgmma(acc, a_s, b_s.transpose((1, 0)))
      return acc[...]
    s = pl.run_scoped(ab, plgpu.ACC((n, n), jnp.float32))

    def sc(acc):
      plgpu.wgmma(acc, s.astype(jnp.bfloat16), c_s)
      return acc[...]
    o_s[...] = plgpu.layout_cast(pl.run_scoped(sc, plgpu.ACC((n, n), jnp.float32)),
                                 plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref)
    plgpu.wait_smem_to_gmem(0)

  call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((n, n), jnp.float32),
                      scratch_types=[plgpu.SMEM((n, n), jnp.bfloat16, transforms=swizzled)] * 3
                      + [plgpu.SMEM((n, n), jnp.float32), plgpu.Barrier(num_barriers=3)])
  with interpreting():
    got = np.asarray(call(a, b, c), np.float32)
  f = lambda x: np.asarray(x, np.float32)  # noqa: E731
  s = (f(a) @ f(b).T).astype(jnp.bfloat16).astype(np.float32)
  want = s @ f(c)
  err = float(np.max(np.abs(got - want)))
  return None if err < 1e-2 else f"max abs error {err:.3g}"


def _wgmma_transforms(eqn, leaves):
  """The (acc, a, b) ref transforms of a wgmma_ref_p equation, from its flattened operands."""
  import jax
  empty = jax.tree.structure([])
  return jax.tree.unflatten(
      jax.tree_util.treedef_tuple((eqn.params["acc_transforms_tree"] or empty,
                                   eqn.params["a_transforms_tree"] or empty,
                                   eqn.params["b_transforms_tree"] or empty)), leaves)


_installed = False


def _install():
  """Register the extensions once per process (they only add what the interpreter refused)."""
  global _installed
  if _installed:
    return
  mlir, gpu_core, gpu_callbacks, jaxpr_interpret, _, state_types = _modules()
  # Programmatic dependent launch (griddepcontrol.wait / .launch_dependents): the interpreter runs
  # one kernel at a time, so both order nothing there; neither version has a rule for them.
  from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
  for name in ("griddepcontrol_wait_p", "griddepcontrol_launch_dependents_p"):
    if hasattr(gpu_primitives, name):
      mlir.register_lowering(getattr(gpu_primitives, name), lambda ctx: [], platform="cpu")
  if "mesh_location" in inspect.signature(gpu_callbacks.wgmma).parameters:
    _install_register_operand_wgmma(gpu_callbacks, jaxpr_interpret, state_types)
    _installed = True
    return
  import jax
  from jax._src import callback
  from jax._src.pallas.mosaic import interpret as _  # noqa: F401  (utils below)
  from jax._src.pallas.mosaic.interpret import utils as interpret_utils

  mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")

  def split_transpose(transforms):
    if transforms and isinstance(transforms[-1], state_types.TransposeTransform):
      return transforms[:-1], tuple(transforms[-1].permutation)
    return transforms, None

  def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array,
            acc_transforms, acc_dtype, a_value, a_allocation_key_as_array, a_transforms,
            b_allocation_key_as_array, b_transforms, source_info=None):
    del grid_point_coords
    memory = gpu_callbacks._get_shared_memory()
    tid = memory.get_global_thread_id(int(device_id), int(thread_id))
    key = gpu_callbacks.HostAllocationKey.from_array
    clean = lambda t: jax.tree.map(int, gpu_callbacks._remove_noop_transforms(t))  # noqa: E731

    def read(allocation, transforms):
      # an operand read from shared memory, checked by the race detector like any other read
      transforms, perm = split_transpose(tuple(transforms))
      rng = interpret_utils.to_range(clean(transforms))
      value, _, clock = memory.get_buffer_content(key(allocation), rng, tid)
      if memory.detect_races:
        gpu_callbacks.get_races().check_read(int(device_id), int(thread_id), clock,
                                             key(allocation), rng, source_info=source_info)
      return np.transpose(value, perm) if perm else value

    a = np.asarray(a_value) if a_allocation_key_as_array is None else read(
        a_allocation_key_as_array, a_transforms)
    b = read(b_allocation_key_as_array, b_transforms)
    acc_range = interpret_utils.to_range(clean(acc_transforms))
    acc, _, _ = memory.get_buffer_content(key(acc_allocation_key_as_array), acc_range, tid)
    out = acc + np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(acc_dtype)
    memory.store_buffer_content(key(acc_allocation_key_as_array), acc_range, out, tid)
    return token

  def interpret_wgmma(self, eqn, token, get_invals):
    acc, a, b, *leaves = get_invals()
    acc_t, a_t, b_t = _wgmma_transforms(eqn, leaves)
    a_is_ref = isinstance(eqn.invars[1].aval, state_types.AbstractRef)
    return callback.io_callback(
        functools.partial(wgmma, acc_dtype=eqn.invars[0].aval.dtype,
                          source_info=eqn.source_info),
        gpu_callbacks.TOKEN_SHAPE_DTYPE, token=token, device_id=self.device_info.device_id,
        grid_point_coords=self.grid_point_coords, thread_id=self.thread_id,
        acc_allocation_key_as_array=acc, acc_transforms=acc_t,
        a_value=None if a_is_ref else a, a_allocation_key_as_array=a if a_is_ref else None,
        a_transforms=a_t, b_allocation_key_as_array=b, b_transforms=b_t, ordered=True), []

  jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p = interpret_wgmma
  _installed = True


def _install_register_operand_wgmma(gpu_callbacks, jaxpr_interpret, state_types):
  """jax 0.11 / 0.12's reworked interpreter (threads and mesh locations; transposed views and layout
  casts handled by it) still reads a WGMMA's A operand from shared memory only: a register A
  operand is added here, its shared-memory reads going through the interpreter's own accessors,
  as its own WGMMA's do."""
  import jax
  from jax._src import callback
  memory = gpu_callbacks.memory
  original = jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p

  def wgmma(*, token, mesh_location, thread, acc_allocation_key_as_array, acc_transforms,
            a_value, b_allocation_key_as_array, b_transforms, source_info=None):
    shared = gpu_callbacks._get_shared_memory()
    info = memory.GPULoggingInfo(mesh_location, thread, source_info)
    clean = lambda t: jax.tree.map(int, gpu_callbacks._remove_noop_transforms(t))  # noqa: E731
    b_key = gpu_callbacks.HostAllocationKey.from_array(b_allocation_key_as_array)
    acc_key = gpu_callbacks.HostAllocationKey.from_array(acc_allocation_key_as_array)
    b, _, _ = shared.get_buffer_content(b_key, shared.access(b_key, clean(b_transforms)), thread,
                                        logging_info=info)
    acc_access = shared.access(acc_key, clean(acc_transforms))
    acc, _, _ = shared.get_buffer_content(acc_key, acc_access, thread, logging_info=info)
    out = acc + np.matmul(np.asarray(a_value, np.float32), b.astype(np.float32)).astype(acc.dtype)
    shared.store_buffer_content(acc_key, acc_access, out, thread, logging_info=info)
    return token

  def interpret_wgmma(self, eqn, token, get_invals):
    if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
      return original(self, eqn, token, get_invals)
    acc, a, b, *leaves = get_invals()
    acc_t, _, b_t = _wgmma_transforms(eqn, leaves)
    acc, acc_t = jaxpr_interpret.resolve_ref(eqn.invars[0].aval, acc, acc_t)
    b, b_t = jaxpr_interpret.resolve_ref(eqn.invars[2].aval, b, b_t)
    return callback.io_callback(
        functools.partial(wgmma, source_info=eqn.source_info), gpu_callbacks.TOKEN_SHAPE_DTYPE,
        token=token, mesh_location=self.mesh_location, thread=self.thread,
        acc_allocation_key_as_array=acc, acc_transforms=acc_t, a_value=a,
        b_allocation_key_as_array=b, b_transforms=b_t), []

  jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p = interpret_wgmma


@contextlib.contextmanager
def interpreting(detect_races: bool = False):
  """plgpu.kernel calls traced inside run in Mosaic GPU's interpreter (extended as above), on
  shared memory that starts as NaN, raising on out-of-bounds reads; detect_races: its
  happens-before race detector over the simulated copies and barriers (see races_found)."""
  import jax
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  _install()
  _, _, _, _, params, _ = _modules()
  # Fresh interpreter state for each block: after a kernel that raised it must be reset (its
  # docs), and jax 0.11's keeps it between kernels, set up for the first one's number of devices.
  # The race detector's findings of the block stay readable after it (races_found).
  interpret_pallas_call.reset_gpu_interpret_mode_state()
  # A simulation on the host: on a GPU machine (JAX_PLATFORMS=cuda,cpu) it runs on the CPU too.
  options = dict(detect_races=detect_races, out_of_bounds_reads="raise",
                 uninitialized_memory="nan")
  if "on_race" in {f.name for f in dataclasses.fields(params.InterpretGPUParams)}:
    options["on_race"] = "warn"  # jax 0.12 raises by default; races_found() reports instead
  with params.force_gpu_interpret_mode(params.InterpretGPUParams(**options)), \
      jax.default_device(jax.devices("cpu")[0]):
    yield


def races_found() -> bool:
  """Whether the last interpreted kernel run with detect_races=True found a data race."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  return bool(interpret_pallas_call.get_races().races_found)
