"""Small timing / memory / reporting helpers shared by the benchmarks (benchmarks/*.py)."""
from __future__ import annotations

import datetime
import gzip
import json
import math
import os
import pathlib
import statistics
import sys
import time

import jax

# Auto mode of median_seconds / copy_bandwidth: a timed sample spans at least this long (so a
# call's ~50-150 us of GPU dispatch + sync latency is under 1% of it) in at most MAX_CALLS calls.
TARGET_SAMPLE_S = 0.02
MAX_CALLS = 256


def calls_for(one_call_s: float, target_sample_s: float = TARGET_SAMPLE_S,
              max_calls: int = MAX_CALLS) -> int:
    """Calls per timed sample for a program whose single call (latency included) took one_call_s:
    ceil(target_sample_s / one_call_s) clamped to [1, max_calls] (max_calls where it took no
    measurable time)."""
    if one_call_s <= 0:
        return max_calls
    return max(1, min(max_calls, math.ceil(target_sample_s / one_call_s)))


def calls_per_sample(fn, *args, target_sample_s: float = TARGET_SAMPLE_S,
                     max_calls: int = MAX_CALLS) -> int:
    """Calls per timed sample for fn(*args): calls_for(the time of one call waited for), timed
    after one untimed call (which compiles); fn is called twice."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return calls_for(time.perf_counter() - start, target_sample_s, max_calls)


def median_seconds(fn, *args, warmup: int = 2, iters: int = 5, calls: int | None = 1,
                   target_sample_s: float = TARGET_SAMPLE_S,
                   max_calls: int = MAX_CALLS) -> tuple[float, list[float]]:
    """(median, per-sample list) of the wall time per call of fn(*args) (a jitted function), after
    `warmup` untimed calls: each of `iters` samples dispatches `calls` calls back to back and waits
    once, for the last result, and is divided by `calls`.

    Why several calls: one call waited for also times the host's dispatch and the wait for the
    device, ~50-150 us per call on a GPU, which is large beside a program of ~0.1-2 ms (on an
    H200 a paged-attention call the profiler put at ~80 us read 186 us; an 8192^3 bf16 matmul
    read 530 TFLOP/s against cuBLAS's ~790). JAX dispatches asynchronously, so back-to-back
    calls queue on the device and run one after another; a sample carries that latency once,
    over `calls` calls (where the host cannot dispatch a call as fast as the device runs it, the
    figure is the dispatch rate instead).
    calls=1 (the default) is one call per sample, as for a program of ~1 s; calls=None picks
    them (calls_per_sample, 2 more untimed calls) for a sample of about target_sample_s, at most
    max_calls. Keep calls=1 for a program that donates its arguments (a second call on the same
    arrays would get deleted buffers) or whose outputs are too big to hold two of at once.
    fn is called warmup + iters * calls times (+ 2 with calls=None).
    """
    if calls is not None and calls < 1:
        raise ValueError(f"median_seconds: calls must be >= 1 (or None for automatic), got {calls}")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if calls is None:
        calls = calls_per_sample(fn, *args, target_sample_s=target_sample_s, max_calls=max_calls)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(calls - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times), times


def copy_bandwidth(num_mib: int, repeats: int = 5, *, calls: int | None = None,
                   target_sample_s: float = TARGET_SAMPLE_S, max_calls: int = MAX_CALLS) -> float:
    """Device-to-device copy bandwidth in bytes/s: read + write of a float32 array of `num_mib` MiB
    through a jitted a + 1, the best of `repeats` samples (median_seconds' per-call times).

    Each sample is a chain of `calls` copies (each copies the previous one's result, so they run
    one after another and two arrays are live) waited for once; calls=None (the default) picks
    enough for a sample of about target_sample_s. Why: one copy of 1 GiB takes ~0.5 ms on an
    H200, and the ~50-150 us latency of a call waited for made it read 2.6-3.4 TB/s against the
    device's ~4.3 (and a decode at "111% of the bandwidth limit")."""
    import jax.numpy as jnp
    n = num_mib * 2**20 // 4
    copy = jax.jit(lambda a: a + 1.0)  # one read + one write of every element
    chain = [jnp.arange(n, dtype=jnp.float32)]

    def copy_next():
        chain[0] = copy(chain[0])
        return chain[0]

    _, times = median_seconds(copy_next, warmup=1, iters=repeats, calls=calls,
                              target_sample_s=target_sample_s, max_calls=max_calls)
    return 2 * n * 4 / min(times)


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
    backend = compiled_backend(compiled)
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


def compiled_backend(compiled) -> str:
    """The platform a compiled program is for: its inputs' devices' (a program compiled for a
    GPU described without one, benchmarks/gpu_program.py, says "gpu (<kind>, compile only)");
    jax.default_backend() where it has no inputs to tell."""
    try:
        sharding = next(s for s in jax.tree.leaves(compiled.input_shardings)
                        if hasattr(s, "device_set"))
        device = next(iter(sharding.device_set))
    except (StopIteration, AttributeError, TypeError):
        return jax.default_backend()
    if type(device.client).__name__ == "CompileOnlyPyClient":
        return f"{device.platform} ({device.device_kind}, compile only)"
    return device.platform


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


def abstract_like(tree, sharding=None):
    """`tree` with every jax.Array replaced by a ShapeDtypeStruct of the same shape, dtype and
    sharding (what a program can be lowered for again once donated buffers are gone); with
    `sharding`, every array and ShapeDtypeStruct by one placed by it instead (abstract
    arguments for another device, e.g. a compile-only GPU's: benchmarks/gpu_program.py)."""
    def one(x):
        if sharding is not None and isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x
    return jax.tree.map(one, tree)


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
    create_perfetto_trace=True) writes it) summed by event: [{"process", "module", "name",
    "total_us", "count", "share"}] for the complete ("X") events of the device processes (those
    named "/device:..."; every process where none is), largest total first, `top` rows; share =
    the fraction of those processes' summed time (top=None: every row). module: the event's
    "hlo_module" argument, the program it ran in ("" where the event has none): two programs'
    kernels of the same name are two rows."""
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
        key = (names.get(e.get("pid"), str(e.get("pid"))),
               str(e.get("args", {}).get("hlo_module", "")), e.get("name", "?"))
        total, count = sums.get(key, (0.0, 0))
        sums[key] = (total + float(e.get("dur", 0.0)), count + 1)
    whole = sum(total for total, _ in sums.values()) or 1.0
    rows = [{"process": proc, "module": module, "name": name, "total_us": total, "count": count,
             "share": total / whole} for (proc, module, name), (total, count) in sums.items()]
    return sorted(rows, key=lambda r: -r["total_us"])[:top]


def traced_kernels(folder, fn) -> tuple:
    """fn() run (and waited for) under jax.profiler.trace into `folder`: (its result, every row
    of trace_summary, the summed time of the device processes' events in seconds, or None where
    the trace has no device process, as on XLA:CPU, whose host events nest and do not sum)."""
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        result = jax.block_until_ready(fn())
    every = trace_summary(folder, top=None)
    device = [r for r in every if r["process"].startswith("/device:")]
    return result, every, (sum(r["total_us"] for r in device) / 1e6 if device else None)


def device_seconds_per_call(folder, program, operands, calls: int):
    """The device time of one call of program(*operands): `calls` calls dispatched back to back
    under the profiler, the trace's device events summed (traced_kernels) and divided by
    `calls`. None where the trace has no device events (XLA:CPU). For programs of a few
    microseconds, whose wall time is the host's dispatch rate."""
    _, _, device_s = traced_kernels(folder, lambda: [program(*operands) for _ in range(calls)])
    return None if device_s is None else device_s / calls


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
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if args is not None:
        record["args"] = vars(args) if hasattr(args, "__dict__") else dict(args)
    record.update(payload)
    out.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {out}")
    return out
