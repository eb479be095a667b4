"""Small timing / memory helpers shared by the kernel benchmarks (benchmarks/*.py)."""
from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, *args, warmup: int = 2, iters: int = 5) -> tuple[float, list[float]]:
    """Median wall time of fn(*args) (a jitted function), after warm-up, waiting for the results."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def compiled_memory_bytes(jitted, *args) -> dict:
    """XLA's static memory analysis of the compiled program: temporaries, arguments, outputs, and
    their sum as an estimate of the peak device memory the call needs (bytes)."""
    analysis = jitted.lower(*args).compile().memory_analysis()
    if analysis is None:
        return {}
    temp = int(getattr(analysis, "temp_size_in_bytes", 0))
    arg = int(getattr(analysis, "argument_size_in_bytes", 0))
    out = int(getattr(analysis, "output_size_in_bytes", 0))
    alias = int(getattr(analysis, "alias_size_in_bytes", 0))
    return {"temp_bytes": temp, "argument_bytes": arg, "output_bytes": out,
            "peak_estimate_bytes": temp + arg + out - alias}


def device_description() -> str:
    device = jax.devices()[0]
    return f"{jax.default_backend()}: {getattr(device, 'device_kind', str(device))}"
