"""benchmarks/hlo_fusions.py: the fusions of a compiled program's HLO, their ops and bytes, joined
with a profile's kernel times by the trace's kernel names."""
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import hlo_fusions  # noqa: E402


def _program_text():
    """XLA:CPU's optimized HLO of a norm, a matmul and an in-place write of a [1, 4, 32] float32
    row into a donated [16, 4, 32] buffer."""
    def f(x, w, pool, idx):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        y = h @ w
        return y * 2, pool.at[idx].set(jnp.tanh(y))
    args = (jnp.ones((4, 64)), jnp.ones((64, 32)), jnp.zeros((16, 4, 32)), jnp.int32(3))
    return jax.jit(f, donate_argnums=2).lower(*args).compile().as_text()


def test_shape_bytes_and_kernel_names():
    assert hlo_fusions.shape_bytes("bf16[64,1024]{1,0}") == 64 * 1024 * 2
    assert hlo_fusions.shape_bytes("(f32[4,32]{1,0}, s32[])") == 4 * 32 * 4 + 4
    assert hlo_fusions.shape_bytes("pred[]") == 1
    assert hlo_fusions.kernel_name("select_dynamic-update-slice_fusion.3") == \
        "select_dynamic_update_slice_fusion_3"


def test_fusions_list_ops_and_the_bytes_they_move(on_cpu):
    found = hlo_fusions.fusions(_program_text())
    assert found
    update = [f for f in found if "dynamic-update-slice" in f["ops"]]
    assert len(update) == 1
    # the trace's kernel name: the instruction's name with "-" and "." as "_"
    kernels = {f["name"]: f["kernel"] for f in found}
    assert update[0]["name"] == "select_dynamic-update-slice_fusion"
    assert kernels["select_dynamic-update-slice_fusion"] == "select_dynamic_update_slice_fusion"
    assert kernels["broadcast_multiply_fusion.1"] == "broadcast_multiply_fusion_1"
    # the [16, 4, 32] buffer is updated in place: neither read nor written; the row written
    assert update[0]["write_bytes"] == 4 * 32 * 4
    assert update[0]["read_bytes"] < 16 * 4 * 32 * 4
    norm = [f for f in found if "rsqrt" in f["ops"]]
    assert norm, [f["ops"] for f in found]
    dots = [f for f in found if "dot" in f["ops"]]
    assert dots  # XLA:CPU wraps the matmul in a fusion of its own
    for f in dots:  # the matmul's operands: x (or its normalised copy) and w
        assert f["read_bytes"] == 4 * 64 * 4 + 64 * 32 * 4 and f["write_bytes"] == 4 * 32 * 4


def test_profile_rows_join_by_kernel_name(tmp_path, on_cpu, capsys):
    text = _program_text()
    found = hlo_fusions.fusions(text)
    a, b = found[0], found[-1]
    hlo = tmp_path / "m.txt"
    hlo.write_text(text)
    profile = {"results": [{"batch": 64, "fixed": {"profile": {"decode_steps": 10, "kernels": [
        {"name": a["kernel"], "total_us": 500.0, "count": 20},
        {"name": b["kernel"], "total_us": 1000.0, "count": 10},
        {"name": "memcpy128", "total_us": 50.0, "count": 10}]}}}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    rows = hlo_fusions.main([str(hlo), "--profile", str(path), "--out", str(tmp_path / "o.json")])
    assert [r["kernel"] for r in rows] == [b["kernel"], a["kernel"], "memcpy128"]
    assert rows[0]["us_per_step"] == 100.0 and rows[0]["calls_per_step"] == 1.0
    moved = (b["read_bytes"] + b["write_bytes"]) * 1.0
    assert rows[0]["gb_s"] == pytest.approx(moved / (100.0 * 1e3))
    assert rows[2]["kind"] == "-" and rows[2]["gb_s"] is None  # timed, but no fusion here
    assert "profile: fixed, batch 64, 10 decode steps" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "o.json").read_text())["rows"]) == 3
    with pytest.raises(ValueError, match="no profile with kernels for workload 'longtail'"):
        hlo_fusions.profile_rows(str(path), "longtail")


def test_profile_rows_keep_the_kernels_of_the_programs_module(tmp_path, on_cpu):
    """A kernel name two programs share (the trace's "module" of each row) counts for the HLO
    module's program alone; rows the trace places in no program count; main takes the module's
    name from the HLO text's header."""
    text = _program_text()
    name = text.split()[1].rstrip(",")                         # HloModule <name>, ...
    kernel = hlo_fusions.fusions(text)[0]["kernel"]
    profile = {"results": [{"batch": 8, "fixed": {"profile": {"decode_steps": 10, "kernels": [
        {"module": name, "name": kernel, "total_us": 40.0, "count": 10},
        {"module": "jit_prefill", "name": kernel, "total_us": 900.0, "count": 1},
        {"module": "", "name": "memcpy128", "total_us": 50.0, "count": 10}]}}}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    rows, _ = hlo_fusions.profile_rows(str(path), module=name)
    assert rows == {kernel: (4.0, 1.0), "memcpy128": (5.0, 1.0)}
    everything, _ = hlo_fusions.profile_rows(str(path))        # no module: summed by name
    assert everything[kernel] == (94.0, 1.1)
    hlo = tmp_path / "m.txt"
    hlo.write_text(text)
    joined = {r["kernel"]: r["us_per_step"] for r in hlo_fusions.main([str(hlo), "--profile",
                                                                       str(path)])}
    assert joined == {kernel: 4.0, "memcpy128": 5.0}


def test_nested_fusions_are_followed_and_reducers_are_not():
    """A fusion's ops count a nested fusion's body in its place, and a reduce as one op (its
    reducer's add is the reduce, not an op of the kernel); GPU dumps name instructions without
    "%" too."""
    text = """HloModule m

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

inner {
  p = f32[8,4]{1,0} parameter(0)
  ROOT t = f32[8,4]{1,0} tanh(p)
}

outer {
  p0 = f32[8,4]{1,0} parameter(0)
  z = f32[] constant(0)
  n = f32[8,4]{1,0} fusion(p0), kind=kLoop, calls=inner
  m = f32[8,4]{1,0} multiply(n, n)
  ROOT r = f32[8]{0} reduce(m, z), dimensions={1}, to_apply=add
}

ENTRY main {
  x = f32[8,4]{1,0} parameter(0)
  ROOT f = f32[8]{0} fusion(x), kind=kInput, calls=outer
}
"""
    (f,) = [f for f in hlo_fusions.fusions(text) if f["name"] == "f"]
    assert f["ops"] == {"tanh": 1, "multiply": 1, "reduce": 1}
    assert (f["kind"], f["read_bytes"], f["write_bytes"]) == ("kInput", 8 * 4 * 4, 8 * 4)


def test_a_file_without_fusions_is_refused(tmp_path):
    empty = tmp_path / "e.txt"
    empty.write_text("HloModule m\n\nENTRY %main (p: f32[2]) -> f32[2] {\n"
                     "  ROOT %p = f32[2]{0} parameter(0)\n}\n")
    with pytest.raises(SystemExit):
        hlo_fusions.main([str(empty)])


def _row_norm(x):  # the source the test below expects a fusion to name
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def _scaled_norm(x):
    return _row_norm(x) * 3.0


def test_each_fusion_names_its_python_source(on_cpu):
    """The module's StackFrames table: a fusion of the norm names _row_norm at its line, called
    from _scaled_norm at its line (innermost first, two deep)."""
    import inspect
    text = jax.jit(_scaled_norm).lower(jnp.ones((4, 64))).compile().as_text()
    here = pathlib.Path(__file__).name
    inner = inspect.getsourcelines(_row_norm)[1] + 1
    outer = inspect.getsourcelines(_scaled_norm)[1] + 1
    sources = {f["source"] for f in hlo_fusions.fusions(text) if "rsqrt" in f["ops"]}
    assert f"{here}:{inner} _row_norm < {here}:{outer} _scaled_norm" in sources, sources
    frames = hlo_fusions.stack_frames(text)
    assert frames and all(parent in frames or parent == 0 for *_, parent in frames.values())
    assert hlo_fusions.source(0, frames) == ""
