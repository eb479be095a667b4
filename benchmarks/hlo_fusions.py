"""What each kernel of a profiled program is: the fusions of XLA's optimized HLO, joined with the
device time by kernel of a benchmarks/decode_throughput.py profile, so a GPU trace's kernel names
(gemm_fusion_dot_340, loop_pad_fusion_27, ...) can be read op by op, with the bytes each call
reads and writes and the rate that makes, off the GPU (issue #15's batch-64 gap).

    # after `bash scripts/gpu_bench.sh decode_anatomy` (the HLO dump and the profile JSON):
    python benchmarks/hlo_fusions.py gpu_out/hlo/*jit_decode*after_optimizations.txt \
        --profile gpu_out/decode_anatomy.json
    # any compiled program's text works too: jax.jit(f).lower(*args).compile().as_text()

Input: one optimized HLO module as text (XLA's --xla_dump_to *after_optimizations.txt, or a
compiled program's as_text()). Every fusion instruction of every computation (a while loop's body
included) is listed with its kind (kLoop, kInput, kCustom: Triton GEMMs, ...), its output shape,
the ops of the computation it calls (nested fusions followed, a reduce's reducer not;
parameters, constants, bitcasts and tuples left out) and its bytes: the shapes of its operands read (the fused computation's
parameters) and of its output written. For a fusion whose root updates a buffer in place
(dynamic-update-slice, scatter) the buffer it updates counts neither as read nor as written, the
update as written: what the kernel moves, not the size of the buffer it is given.
The trace names a fusion's kernel after the instruction with "." and "-" as "_"; with --profile
(decode_throughput.py's JSON, its "profile" of one workload: us and calls per decode step) each
fusion gets its time per step and calls per step, and the rate (bytes x calls / time): the
profile's kernels of this module's program (the trace names each kernel's program since
2026-11-27; a kernel another program of the run shares the name with is left out). Rows are
the profile's kernels, largest time first, then (--all) the fusions it did not time.
Each fusion also names the Python source it came from ("source": the innermost frames of the
stack XLA records for the fusion, its root or else its first op that has one, in the module's
StackFrames table, e.g.
"sampling_utils.py:181 categorical < sampling_utils.py:222 sample_tokens").
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import re
import sys

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
SKIPPED_OPS = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element"}
IN_PLACE_ROOTS = {"dynamic-update-slice", "scatter"}
HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*(?:->\s*.*)?\{\s*$")
ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")


def kernel_name(instruction: str) -> str:
    """The name a profiler trace gives the kernel of an HLO instruction."""
    return re.sub(r"[.\-]", "_", instruction)


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape ("bf16[64,1024]{1,0}", a tuple of them, "s32[]")."""
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _split_shape(rest: str) -> tuple[str, str]:
    """(shape, the text after it) of an instruction's right-hand side."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, after = rest.partition(" ")
    return shape, after


def parse_module(text: str) -> dict:
    """{computation name: [instruction dicts (name, shape, opcode, text, root)]} of an HLO
    module's text."""
    computations, current = {}, None
    for line in text.splitlines():
        if current is None:
            header = HEADER.match(line)
            if header and not line.startswith((" ", "\t")):
                current = computations.setdefault(header.group(1), [])
            continue
        if line.strip() == "}":
            current = None
            continue
        body = line.strip()
        root = body.startswith("ROOT ")
        body = body[5:] if root else body
        name, eq, rest = body.partition(" = ")
        if not eq:
            continue
        shape, after = _split_shape(rest)
        opcode = after.split("(", 1)[0].strip()
        current.append({"name": name.lstrip("%"), "shape": shape, "opcode": opcode,
                        "text": after, "root": root})
    return computations


SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _fields(body: str) -> dict[str, str]:
    """'{file_name_id=1 line=4 ...}' -> {"file_name_id": "1", "line": "4", ...}"""
    return dict(re.findall(r"(\w+)=(\d+)", body))


def stack_frames(text: str) -> dict[int, tuple[str, str, int, int]]:
    """{frame id: (file base name, function, line, parent frame id or 0)} from the tables an HLO
    module's text opens with. A frame's printed parent_frame_id p is the frame listed as p - 1
    (0: none): checked on the decode program's dump, where the frame of categorical's max lists
    p = its own id and the frame before it is sample_tokens' call of categorical."""
    tables, current = {name: {} for name in SECTIONS}, None
    for line in text.splitlines():
        if line.strip() in SECTIONS:
            current = tables[line.strip()]
            continue
        entry = re.match(r"^(\d+)\s+(.*)$", line.strip()) if current is not None else None
        if entry is None:  # a table ends at its first line that is no entry
            current = None
            continue
        current[int(entry.group(1))] = entry.group(2)
    files = {k: v.strip('"').rsplit("/", 1)[-1] for k, v in tables["FileNames"].items()}
    functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    locations = {k: _fields(v) for k, v in tables["FileLocations"].items()}
    frames = {}
    for frame, body in tables["StackFrames"].items():
        f = _fields(body)
        loc = locations.get(int(f.get("file_location_id", 0)), {})
        frames[frame] = (files.get(int(loc.get("file_name_id", 0)), "?"),
                         functions.get(int(loc.get("function_name_id", 0)), "?"),
                         int(loc.get("line", 0)), max(0, int(f.get("parent_frame_id", 1)) - 1))
    return frames


def source(frame: int, frames: dict, depth: int = 2) -> str:
    """"file:line function < file:line caller" of a stack frame, innermost first, `depth` deep."""
    parts, seen = [], set()
    while frame in frames and frame not in seen and len(parts) < depth:
        seen.add(frame)
        file, function, line, parent = frames[frame]
        parts.append(f"{file}:{line} {function}")
        frame = parent
    return " < ".join(parts)


def _frame_of(instruction: dict, body: list) -> int:
    """The stack frame XLA recorded for a fusion instruction, else for its fused root, else for
    the first op of its body that has one (a cumulative sum's reduce-window root has none)."""
    texts = [i["text"] for i in body if i["root"]] + [i["text"] for i in body if not i["root"]]
    for text in [instruction["text"]] + texts:
        found = re.search(r"\bstack_frame_id=(\d+)", text)
        if found:
            return int(found.group(1))
    return 0


def _called(instruction: dict) -> list[str]:
    """The computations an instruction calls with calls= (a fusion's body, a nested fusion's);
    a reduce's to_apply is not followed: the reduce is the op."""
    found = re.search(r"\bcalls=\{?([%\w.\-, ]+)\}?", instruction["text"])
    return [c.strip().lstrip("%") for c in found.group(1).split(",")] if found else []


def _ops(computations: dict, name: str, seen=None) -> collections.Counter:
    """Opcode counts of a computation, nested fusions' bodies counted in place of them."""
    seen = set() if seen is None else seen
    counts = collections.Counter()
    if name in seen or name not in computations:
        return counts
    seen.add(name)
    for ins in computations[name]:
        if ins["opcode"] == "fusion":
            for sub in _called(ins):
                counts += _ops(computations, sub, seen)
        elif ins["opcode"] not in SKIPPED_OPS:
            counts[ins["opcode"]] += 1
    return counts


def fusions(text: str) -> list[dict]:
    """Every fusion instruction of the module: {"name", "kernel", "kind", "shape", "ops" (opcode
    counts of what it calls), "read_bytes", "write_bytes", "source" (stack_frames; "" if none)}."""
    computations = parse_module(text)
    frames = stack_frames(text)
    out = []
    for instructions in computations.values():
        for ins in instructions:
            if ins["opcode"] != "fusion":
                continue
            called = [c for c in _called(ins) if c in computations]
            body = computations[called[0]] if called else []
            params = sorted((i for i in body if i["opcode"] == "parameter"),
                            key=lambda i: int(re.search(r"parameter\((\d+)\)", i["text"]).group(1)))
            root = next((i for i in body if i["root"]), None)
            read = sum(shape_bytes(p["shape"]) for p in params)
            write = shape_bytes(ins["shape"])
            if root is not None and root["opcode"] in IN_PLACE_ROOTS and params:
                # operand 0 is the buffer updated in place; the update is what is written
                read -= shape_bytes(params[0]["shape"])
                write = _update_bytes(root, body)
            kind = re.search(r"kind=(\w+)", ins["text"])
            custom = re.search(r'"kind":\s*"(__[\w]+)"', ins["text"])
            out.append({"name": ins["name"], "kernel": kernel_name(ins["name"]),
                        "kind": (custom or kind).group(1) if (custom or kind) else "?",
                        "shape": ins["shape"], "ops": dict(_ops(computations, called[0]))
                        if called else {}, "read_bytes": read, "write_bytes": write,
                        "source": source(_frame_of(ins, body), frames)})
    return out


def _update_bytes(root: dict, body: list) -> int:
    """Bytes a dynamic-update-slice / scatter root writes: its update operand's shape."""
    operands = re.findall(r"%?([\w.\-]+)", root["text"].split("(", 1)[1].split(")", 1)[0])
    shapes = {i["name"]: i["shape"] for i in body}
    index = 1 if root["opcode"] == "dynamic-update-slice" else -1
    update = operands[index] if operands else None
    return shape_bytes(shapes.get(update, ""))


def profile_rows(path: str, workload: str | None = None,
                 module: str | None = None) -> tuple[dict, str]:
    """{kernel name: (us per step, calls per step)} from a decode_throughput.py JSON's first
    result with a profile (of `workload`, or the first that has one), and its label. module:
    keep only the kernels the trace places in that program (its "module"; kernels the trace
    places in none are kept), so a kernel of another program with the same name (XLA names
    fusions per module: a prefill's loop_select_fusion_1 and a decode's are two kernels) is not
    counted as this one's."""
    with open(path) as f:
        record = json.load(f)
    for result in record.get("results", []):
        for name, part in result.items():
            if not isinstance(part, dict) or (workload and name != workload):
                continue
            profile = part.get("profile")
            if profile and profile.get("kernels"):
                steps = max(1, profile.get("decode_steps", 1))
                rows = {}
                for r in profile["kernels"]:
                    if module and r.get("module") not in ("", None, module):
                        continue
                    us, calls = rows.get(r["name"], (0.0, 0.0))
                    rows[r["name"]] = (us + r["total_us"] / steps, calls + r["count"] / steps)
                return rows, f"{name}, batch {result.get('batch')}, {steps} decode steps"
    raise ValueError(f"{path}: no profile with kernels"
                     + (f" for workload {workload!r}" if workload else ""))


def table(found: list[dict], timed: dict | None, show_all: bool) -> list[dict]:
    """Rows to print: the timed kernels matched to fusions (largest time first), then the rest
    (with show_all); kernels of the profile that are no fusion of this module are kept, named."""
    by_kernel = {f["kernel"]: f for f in found}
    rows = []
    for name, (us, calls) in sorted((timed or {}).items(), key=lambda kv: -kv[1][0]):
        f = by_kernel.pop(name, None)
        row = dict(f or {"kernel": name, "kind": "-", "ops": {}, "read_bytes": 0,
                         "write_bytes": 0, "shape": ""})
        row.update(us_per_step=us, calls_per_step=calls)
        moved = (row["read_bytes"] + row["write_bytes"]) * calls
        row["gb_s"] = moved / (us * 1e3) if f and us > 0 else None
        rows.append(row)
    if show_all or not timed:
        rows += sorted(by_kernel.values(), key=lambda f: -(f["read_bytes"] + f["write_bytes"]))
    return rows


def format_ops(ops: dict, limit: int = 6) -> str:
    items = sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in items[:limit])
    return text + (f", +{len(items) - limit} more" if len(items) > limit else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("hlo", help="an optimized HLO module's text (a dump's after_optimizations.txt)")
    p.add_argument("--profile", default="", help="decode_throughput.py's JSON with a profile")
    p.add_argument("--workload", default=None, help="the profile's workload (default: the first)")
    p.add_argument("--all", action="store_true", help="also the fusions the profile did not time")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    args = p.parse_args(argv)
    with open(args.hlo) as f:
        text = f.read()
    found = fusions(text)
    if not found:
        p.error(f"{args.hlo}: no fusion instruction found (is it an optimized HLO module?)")
    header = re.match(r"HloModule\s+([\w.\-]+)", text)
    timed, label = (profile_rows(args.profile, args.workload, header and header.group(1))
                    if args.profile else (None, ""))
    rows = table(found, timed, args.all)
    print(f"{len(found)} fusions in {args.hlo}" + (f"; profile: {label}" if label else ""))
    header = f"{'kernel':34s} {'kind':20s} {'us/step':>8s} {'calls':>6s} {'read MB':>8s} " \
             f"{'write MB':>8s} {'GB/s':>7s}  ops"
    print(header)
    for r in rows:
        us, calls, rate = r.get("us_per_step"), r.get("calls_per_step"), r.get("gb_s")
        timed_cols = ("" if us is None else f"{us:8.1f}", "" if calls is None else f"{calls:6.1f}",
                      "" if rate is None else f"{rate:7.1f}")
        print(f"{r['kernel'][:34]:34s} {r['kind'][:20]:20s} {timed_cols[0]:>8s} "
              f"{timed_cols[1]:>6s} {r['read_bytes'] / 1e6:8.3f} {r['write_bytes'] / 1e6:8.3f} "
              f"{timed_cols[2]:>7s}  {format_ops(r['ops'])}"
              + (f"  @ {r['source']}" if r.get("source") else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"hlo": args.hlo, "profile": args.profile, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
