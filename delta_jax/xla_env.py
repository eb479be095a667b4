"""Process-wide XLA / JAX settings made before anything compiles: the XLA flags delta_jax runs
with unless the user's XLA_FLAGS names them, and JAX's persistent compilation cache.

XLA reads XLA_FLAGS once, when the first backend starts, so `apply_default_flags` has to run
before anything touches a device: `delta_jax.main.run` and the benchmarks that measure the
product call it first. A flag the user sets in XLA_FLAGS (to any value) wins over the default
of the same name, so `XLA_FLAGS=--xla_gpu_graph_enable_concurrent_region=false` turns one off.
`enable_compilation_cache` (delta_jax.main.run, config train.compilation_cache_dir) points JAX's
persistent cache at a directory on an accelerator unless JAX_COMPILATION_CACHE_DIR says where
(or "": off).
"""
from __future__ import annotations

import logging
import os
from typing import MutableMapping, Optional

log = logging.getLogger(__name__)

DEFAULT_XLA_FLAGS = (
    # CUDA graphs (XLA's command buffers) run the independent kernels of a graph side by side:
    # in a decode layer q's norm, k's norm + RoPE + page write and v's page write all follow the
    # qkv matmul alone. One H200, 2026-11-27 (BENCHMARKS.md, eighth GPU run): batch-64 decode
    # 19,992 / 20,136 / 20,150 tokens/s with it against 19,422 / 19,503 / 19,677 without, batch 256
    # 28,625 against 28,263. The train step with it: not measured. The CPU and TPU backends
    # accept the flag and do nothing with it.
    "--xla_gpu_graph_enable_concurrent_region=true",
)


def flag_name(flag: str) -> str:
    """'--xla_foo=1' -> 'xla_foo'."""
    return flag.lstrip("-").split("=", 1)[0]


def missing_flags(current: str, defaults=DEFAULT_XLA_FLAGS) -> list[str]:
    """The defaults whose names `current` (an XLA_FLAGS value) does not set."""
    named = {flag_name(f) for f in current.split() if f.startswith("--")}
    return [f for f in defaults if flag_name(f) not in named]


def merged_flags(current: str, defaults=DEFAULT_XLA_FLAGS) -> str:
    """`current` with `missing_flags` appended."""
    return " ".join(current.split() + missing_flags(current, defaults))


def backends_started() -> bool:
    """Whether a jax backend has started in this process (XLA_FLAGS is read by then)."""
    from jax._src import xla_bridge  # not public API in jax 0.10 / 0.11
    return xla_bridge.backends_are_initialized()


def apply_default_flags(env: Optional[MutableMapping[str, str]] = None,
                        defaults=DEFAULT_XLA_FLAGS) -> tuple[str, ...]:
    """Appends the missing defaults to env["XLA_FLAGS"] (env: default os.environ) before the
    backend starts; returns the flags added. When a backend has started already (an in-process
    caller such as a test) XLA would not read them: os.environ is left alone, and the return is
    (). So is an XLA_FLAGS that names a flag file (a value not starting with "--")."""
    env = os.environ if env is None else env
    current = env.get("XLA_FLAGS", "")
    if current.strip() and not current.strip().startswith("--"):
        return ()  # XLA reads a value that does not start with "--" as a flag file's name
    added = missing_flags(current, defaults)
    if not added:
        return ()
    if env is os.environ and backends_started():
        log.debug("XLA_FLAGS: %s not applied, the backend has started", " ".join(added))
        return ()
    env["XLA_FLAGS"] = merged_flags(current, defaults)
    log.debug("XLA_FLAGS += %s", " ".join(added))
    return tuple(added)


def enable_compilation_cache(cache_dir: str, backend: str) -> Optional[str]:
    """Points JAX's persistent compilation cache at `cache_dir` ("~" expanded, created), so that
    programs compiled once (above JAX's minimum compile time) load from there in later runs of
    the same shapes, flags and jax version (JAX keys its entries by all of them). The user's
    JAX_COMPILATION_CACHE_DIR environment variable, when set, wins and is left to JAX ("" there:
    no cache); so does a `cache_dir` of "". On the CPU `backend` (JAX's default backend's
    platform name) it stays off: XLA:CPU's executable serialization, which every cache write
    runs, crashed the process (SIGSEGV) twice in about ten test-suite runs of jax 0.10.2, and
    the CPU default job gains 3% from a warm cache. Call before the first compile. Returns the
    directory in use, or None."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return os.environ["JAX_COMPILATION_CACHE_DIR"] or None
    if not cache_dir:
        return None
    if backend == "cpu":
        log.debug("JAX compilation cache: off on the CPU backend (JAX_COMPILATION_CACHE_DIR "
                  "turns it on there)")
        return None
    path = os.path.abspath(os.path.expanduser(cache_dir))
    os.makedirs(path, exist_ok=True)
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
    log.debug("JAX compilation cache: %s", path)
    return path
