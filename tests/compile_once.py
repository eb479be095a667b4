"""The suite's in-memory executable cache: a program XLA already compiled in this process, for
the same devices and compile options, is not compiled again.

Many tests build a run of their own (train.run.build_run) whose jitted programs (the train step,
the old-policy pass, the SFT step) are new Python functions each time, so JAX's jit caches miss
and XLA compiles the same program again: in tests/test_loop.py and test_sampling.py, 70 of 581
backend compiles, 19 s of their 59 s (2026-12-02). install() wraps jax's backend compile so
that a program whose cache key (jax._src.cache_key.get: the module's canonical IR, the compile
options, the backend and device kinds, the jax and XLA versions, as the persistent compilation
cache keys it) and device assignment match one compiled before gets that executable back: what
the persistent cache would load from disk, without its serialization (which crashed workers;
see conftest.py). Programs with host callbacks are always compiled (their callbacks are this
lowering's own), and so is everything when jax lacks the private pieces used here.

LRU-bounded (MAX_ENTRIES executables); clear() drops them all (conftest's few_executables).
SUITE_COMPILE_ONCE=0 turns it off.
"""
from __future__ import annotations

import collections
import threading

MAX_ENTRIES = 256

_cache: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()
stats = {"hits": 0, "misses": 0, "uncached": 0}


def install() -> bool:
  """Wraps jax._src.compiler.backend_compile_and_load; False if this jax lacks it."""
  try:
    import numpy as np
    from jax._src import cache_key, compiler
  except ImportError:
    return False
  original = getattr(compiler, "backend_compile_and_load", None)
  if original is None or not hasattr(cache_key, "get"):
    return False
  if getattr(original, "_compile_once", False):
    return True

  def compile_once(backend, module, executable_devices, options, host_callbacks):
    if host_callbacks:
      stats["uncached"] += 1
      return original(backend, module, executable_devices, options, host_callbacks)
    devices = list(executable_devices)
    try:
      key = (cache_key.get(module, np.asarray(devices, dtype=object), options, backend),
             tuple(d.id for d in devices))
    except Exception:  # noqa: BLE001  (a key this jax cannot make: compile as usual)
      stats["uncached"] += 1
      return original(backend, module, executable_devices, options, host_callbacks)
    with _lock:
      hit = _cache.get(key)
      if hit is not None:
        _cache.move_to_end(key)
        stats["hits"] += 1
        return hit
    executable = original(backend, module, executable_devices, options, host_callbacks)
    with _lock:
      stats["misses"] += 1
      _cache[key] = executable
      while len(_cache) > MAX_ENTRIES:
        _cache.popitem(last=False)
    return executable

  compile_once._compile_once = True
  compiler.backend_compile_and_load = compile_once
  return True


def clear() -> None:
  with _lock:
    _cache.clear()
