"""Small timing / memory / reporting helpers shared by the benchmarks (benchmarks/*.py)."""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import sys
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


def print_table(title: str, columns, rows) -> None:
    """Prints a title line and a fixed-width table.

    columns: sequence of (header, key, format) with format a format spec such as "34s" or
    "10.3f"; a key may be a callable row -> value. rows: sequence of dicts. Missing keys print
    as blanks.
    """
    print(f"\n{title}")
    widths = [int("".join(ch for ch in fmt.split(".")[0] if ch.isdigit()) or 10)
              for _, _, fmt in columns]
    print(" ".join(f"{h:{'<' if fmt.endswith('s') else '>'}{w}s}"
                   for (h, _, fmt), w in zip(columns, widths)))
    for row in rows:
        cells = []
        for (_, key, fmt), width in zip(columns, widths):
            value = key(row) if callable(key) else row.get(key)
            cells.append(" " * width if value is None else f"{value:{fmt}}")
        print(" ".join(cells))


def write_json(path, payload: dict, *, args=None) -> pathlib.Path:
    """Writes {"device", "date" (UTC ISO), "command", "args", **payload} as indented JSON
    (parent folders created) and says where."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": device_description(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    if args is not None:
        record["args"] = vars(args) if hasattr(args, "__dict__") else dict(args)
    record.update(payload)
    out.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {out}")
    return out
