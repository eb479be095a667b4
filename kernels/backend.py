"""Choosing between a Pallas kernel and its plain-jnp reference.

The kernels in this package are written for the Pallas Triton backend (GPU). Elsewhere (CPU, TPU)
the `*_auto` entry points fall back to the jnp reference, which XLA compiles well enough. The
choice can be forced with the environment variable DELTA_JAX_KERNELS or the `impl=` argument:

    auto       (default) Pallas on GPU, the jnp reference elsewhere
    pallas     the Pallas kernel; compiled on GPU, in interpret mode on other backends (slow)
    interpret  the Pallas kernel in interpret mode on any backend (for debugging/tests)
    reference  the jnp reference everywhere
"""
from __future__ import annotations

import os

import jax

ENV_VAR = "DELTA_JAX_KERNELS"
IMPLS = ("auto", "pallas", "interpret", "reference")


def on_gpu() -> bool:
    """True when the default JAX backend is a GPU (CUDA or ROCm)."""
    return jax.default_backend() == "gpu"


def resolve_impl(impl: str | None = None) -> str:
    """Returns "pallas", "interpret" or "reference" for an `impl` request (None: read the env)."""
    requested = impl if impl is not None else os.environ.get(ENV_VAR, "auto")
    requested = requested.strip().lower()
    if requested not in IMPLS:
        source = "impl argument" if impl is not None else f"environment variable {ENV_VAR}"
        raise ValueError(f"{source}={requested!r}; expected one of {IMPLS}")
    if requested == "auto":
        return "pallas" if on_gpu() else "reference"
    if requested == "pallas" and not on_gpu():
        return "interpret"
    return requested


def default_interpret(interpret: bool | None) -> bool:
    """Interpret mode unless asked otherwise and the backend can compile the Triton kernel."""
    return (not on_gpu()) if interpret is None else bool(interpret)


def default_num_programs(num_tiles: int, programs_per_core: int = 4) -> int:
    """A persistent-grid size: a few programs per streaming multiprocessor, at most one per tile.

    On GPU the device's core (SM) count is used; elsewhere (interpret mode) a small grid keeps the
    interpreter's loop short.
    """
    cores = getattr(jax.devices()[0], "core_count", None) if on_gpu() else None
    target = (cores or 132) * programs_per_core if on_gpu() else 4
    return max(1, min(num_tiles, target))
