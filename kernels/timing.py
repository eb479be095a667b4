"""Small timing / memory / reporting helpers shared by the benchmarks (benchmarks/*.py)."""
from __future__ import annotations

import datetime
import gzip
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


def copy_bandwidth(num_mib: int, repeats: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a float32 array of `num_mib`
    MiB through a jitted x + 1), best of `repeats` after one untimed call."""
    import jax.numpy as jnp
    n = num_mib * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # one read + one write of every element
    copy(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best


MEMORY_FIELDS = (("argument_bytes", "argument_size_in_bytes"),
                 ("output_bytes", "output_size_in_bytes"),
                 ("temp_bytes", "temp_size_in_bytes"),
                 ("alias_bytes", "alias_size_in_bytes"),
                 ("generated_code_bytes", "generated_code_size_in_bytes"))


def compiled_memory_bytes(program, *args, **kwargs) -> dict:
    """XLA's static memory analysis of a compiled program on the backend it was compiled for.

    program: a jax.stages.Compiled, or a jitted function compiled here for `args` / `kwargs`
    (arrays or jax.ShapeDtypeStructs: nothing is allocated). Returns {"backend", "argument_bytes",
    "output_bytes", "temp_bytes", "alias_bytes", "generated_code_bytes", "peak_estimate_bytes"}
    with peak_estimate = arguments + outputs + temporaries - aliased (donated arguments reused
    for outputs), an estimate of the device memory the call needs; where the backend gives no
    analysis, {"backend", "unavailable": why}.
    """
    compiled = program if hasattr(program, "memory_analysis") else (
        program.lower(*args, **kwargs).compile())
    backend = jax.default_backend()
    try:
        analysis = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError) as err:  # e.g. a backend without the analysis
        return {"backend": backend, "unavailable": f"{type(err).__name__}: {err}"}
    if analysis is None:
        return {"backend": backend, "unavailable": "memory_analysis() returned None"}
    out = {"backend": backend}
    out.update({key: int(getattr(analysis, attr, 0) or 0) for key, attr in MEMORY_FIELDS})
    out["peak_estimate_bytes"] = (out["argument_bytes"] + out["output_bytes"]
                                  + out["temp_bytes"] - out["alias_bytes"])
    return out


def format_compiled_memory(label: str, memory: dict, plan_bytes: int | None = None) -> str:
    """One line of compiled_memory_bytes' figures (MiB / GiB), with a plan's figure beside the peak
    estimate when given (plan / compiled)."""
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"  # noqa: E731
    if "unavailable" in memory:
        return f"compiled memory [{memory['backend']}] {label}: unavailable ({memory['unavailable']})"
    line = (f"compiled memory [{memory['backend']}] {label}: peak~ {gib(memory['peak_estimate_bytes'])}"
            f" = args {gib(memory['argument_bytes'])} + out {gib(memory['output_bytes'])}"
            f" + temp {gib(memory['temp_bytes'])} - alias {gib(memory['alias_bytes'])}"
            f" (code {memory['generated_code_bytes'] / 2**20:.1f} MiB)")
    if plan_bytes is not None:
        ratio = plan_bytes / max(memory["peak_estimate_bytes"], 1)
        line += f"; plan {gib(plan_bytes)} (plan / compiled {ratio:.2f})"
    return line


def print_compiled_memory(label: str, program, *args, plan_bytes: int | None = None,
                          **kwargs) -> dict:
    """compiled_memory_bytes(program, *args, **kwargs), printed as one line; returns the dict."""
    memory = compiled_memory_bytes(program, *args, **kwargs)
    print(format_compiled_memory(label, memory, plan_bytes), flush=True)
    return memory


def abstract_like(tree):
    """`tree` with every jax.Array replaced by a ShapeDtypeStruct of the same shape, dtype and
    sharding (what a program can be lowered for again once donated buffers are gone)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def recording_first_call(fn, name: str, calls: dict):
    """fn wrapped to store calls[name] = (fn, abstract args, abstract kwargs) at its first call,
    so a benchmark can print compiled_memory_bytes of the programs a run really compiled."""
    def wrapper(*args, **kwargs):
        if name not in calls:
            calls[name] = (fn, abstract_like(args), abstract_like(kwargs))
        return fn(*args, **kwargs)
    return wrapper


def print_recorded_memory(calls: dict, prefix: str = "", plan_bytes: dict | None = None) -> dict:
    """print_compiled_memory for each recorded first call ({name: memory dict}); plan_bytes:
    {name: (plan phase name, bytes)} to print beside it."""
    out = {}
    for name, (fn, args, kwargs) in calls.items():
        phase, plan = (plan_bytes or {}).get(name, (None, None))
        label = f"{prefix}{name}" + (f" (plan phase '{phase}')" if phase else "")
        out[name] = print_compiled_memory(label, fn, *args, plan_bytes=plan, **kwargs)
    return out


def trace_summary(trace_dir, top: int | None = 25) -> list[dict]:
    """The newest `*.trace.json.gz` under trace_dir (as jax.profiler.trace(trace_dir,
    create_perfetto_trace=True) writes it) summed by event: [{"process", "name", "total_us",
    "count", "share"}] for the complete ("X") events of the device processes (those named
    "/device:..."; every process where none is), largest total first, `top` rows; share = the
    fraction of those processes' summed time (top=None: every row)."""
    traces = sorted(pathlib.Path(trace_dir).rglob("*.trace.json.gz"),
                    key=lambda f: f.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"trace_summary: no *.trace.json.gz under {trace_dir}")
    with gzip.open(traces[-1], "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if name.startswith("/device:")}
    sums: dict = {}
    for e in events:
        if e.get("ph") != "X" or (device_pids and e.get("pid") not in device_pids):
            continue
        key = (names.get(e.get("pid"), str(e.get("pid"))), e.get("name", "?"))
        total, count = sums.get(key, (0.0, 0))
        sums[key] = (total + float(e.get("dur", 0.0)), count + 1)
    whole = sum(total for total, _ in sums.values()) or 1.0
    rows = [{"process": proc, "name": name, "total_us": total, "count": count,
             "share": total / whole} for (proc, name), (total, count) in sums.items()]
    return sorted(rows, key=lambda r: -r["total_us"])[:top]


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
