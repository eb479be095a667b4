"""benchmarks/gpu_program.py: the kernels a step of a GPU-compiled program launches, its GEMMs and
the split of their contraction, from optimized HLO text; the target description of a deviceless
GPU compile, and the message where jax's CUDA plugin is missing. (The compile itself needs the
plugin: the last test runs where it is installed, `bash scripts/gpu_jax_check.sh --compile -m
pytest tests/test_gpu_program.py`, and is skipped elsewhere.)"""
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_program  # noqa: E402

# XLA:GPU's optimized HLO as it prints a decode-like loop (names, kinds and backend configs as in
# a compiled Qwen3 decode step; operands trimmed): per step a split-K GEMM (f32[4, 8, 64]: four
# parts of the contraction) summed by the fusion after it, a GEMM without a split, a batched
# GEMM's rank-3 result that nothing sums over, a Mosaic kernel, an in-place page write and a
# copy of a whole page pool.
HLO = """HloModule jit_decode, entry_computation_layout={(bf16[2,64,16,8]{3,2,1,0})->bf16[2,64,16,8]{3,2,1,0}}

%gemm_split_computation (p0: bf16[8,4,32], p1: bf16[4,32,64]) -> f32[4,8,64] {
  %p0 = bf16[8,4,32]{2,1,0} parameter(0)
  %p1 = bf16[4,32,64]{2,1,0} parameter(1)
  ROOT %dot.1 = f32[4,8,64]{2,1,0} dot(%p0, %p1), lhs_batch_dims={1}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%add_comp (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b)
}

%fused_reduce (q0: f32[4,8,64]) -> bf16[8,64] {
  %q0 = f32[4,8,64]{2,1,0} parameter(0)
  %c0 = f32[] constant(0)
  %reduce.1 = f32[8,64]{1,0} reduce(%q0, %c0), dimensions={0}, to_apply=%add_comp
  ROOT %convert.1 = bf16[8,64]{1,0} convert(%reduce.1)
}

%gemm_plain_computation (r0: bf16[8,64], r1: bf16[64,128]) -> bf16[8,128] {
  %r0 = bf16[8,64]{1,0} parameter(0)
  %r1 = bf16[64,128]{1,0} parameter(1)
  ROOT %dot.2 = bf16[8,128]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_batched_computation (s0: bf16[2,8,64], s1: bf16[2,64,8]) -> f32[2,8,8] {
  %s0 = bf16[2,8,64]{2,1,0} parameter(0)
  %s1 = bf16[2,64,8]{2,1,0} parameter(1)
  ROOT %dot.3 = f32[2,8,8]{2,1,0} dot(%s0, %s1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%fused_tanh (t0: f32[2,8,8]) -> f32[2,8,8] {
  %t0 = f32[2,8,8]{2,1,0} parameter(0)
  ROOT %tanh.1 = f32[2,8,8]{2,1,0} tanh(%t0)
}

%fused_scatter (u0: bf16[2,64,16,8], u1: s32[8,1], u2: bf16[8,2,8]) -> bf16[2,64,16,8] {
  %u0 = bf16[2,64,16,8]{3,2,1,0} parameter(0)
  %u1 = s32[8,1]{1,0} parameter(1)
  %u2 = bf16[8,2,8]{2,1,0} parameter(2)
  ROOT %scatter.1 = bf16[2,64,16,8]{3,2,1,0} scatter(%u0, %u1, %u2), update_window_dims={1,2}, inserted_window_dims={1}, scatter_dims_to_operand_dims={1}, index_vector_dim=1, to_apply=%add_comp
}

%body.7 (carry: (s32[], bf16[2,64,16,8])) -> (s32[], bf16[2,64,16,8]) {
  %carry = (s32[], bf16[2,64,16,8]{3,2,1,0}) parameter(0)
  %step = s32[] get-tuple-element(%carry), index=0
  %pool = bf16[2,64,16,8]{3,2,1,0} get-tuple-element(%carry), index=1
  %x = bf16[8,4,32]{2,1,0} bitcast(%pool)
  %w = bf16[4,32,64]{2,1,0} bitcast(%pool)
  %gemm_fusion_dot.1 = f32[4,8,64]{2,1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_split_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %loop_reduce_fusion = bf16[8,64]{1,0} fusion(%gemm_fusion_dot.1), kind=kLoop, calls=%fused_reduce
  %w2 = bf16[64,128]{1,0} bitcast(%pool)
  %gemm_fusion_dot.2 = bf16[8,128]{1,0} fusion(%loop_reduce_fusion, %w2), kind=kCustom, calls=%gemm_plain_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %y = bf16[2,8,64]{2,1,0} bitcast(%gemm_fusion_dot.2)
  %z = bf16[2,64,8]{2,1,0} bitcast(%gemm_fusion_dot.2)
  %gemm_fusion_dot.3 = f32[2,8,8]{2,1,0} fusion(%y, %z), kind=kCustom, calls=%gemm_batched_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %loop_tanh_fusion = f32[2,8,8]{2,1,0} fusion(%gemm_fusion_dot.3), kind=kLoop, calls=%fused_tanh
  %custom-call.1 = bf16[8,2,8]{2,1,0} custom-call(%gemm_fusion_dot.2, %pool), custom_call_target="mosaic_gpu_v2"
  %idx = s32[8,1]{1,0} bitcast(%gemm_fusion_dot.2)
  %input_scatter_fusion = bf16[2,64,16,8]{3,2,1,0} fusion(%pool, %idx, %custom-call.1), kind=kInput, calls=%fused_scatter
  %copy.1 = bf16[2,64,16,8]{3,2,1,0} copy(%input_scatter_fusion)
  ROOT %tuple.1 = (s32[], bf16[2,64,16,8]{3,2,1,0}) tuple(%step, %copy.1)
}

%cond.7 (c: (s32[], bf16[2,64,16,8])) -> pred[] {
  %c = (s32[], bf16[2,64,16,8]{3,2,1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main.9 (pool.1: bf16[2,64,16,8]) -> bf16[2,64,16,8] {
  %pool.1 = bf16[2,64,16,8]{3,2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,64,16,8]{3,2,1,0}) tuple(%zero, %pool.1)
  %while.1 = (s32[], bf16[2,64,16,8]{3,2,1,0}) while(%init), condition=%cond.7, body=%body.7
  ROOT %out = bf16[2,64,16,8]{3,2,1,0} get-tuple-element(%while.1), index=1
}
"""
POOL_BYTES = 2 * 64 * 16 * 8 * 2


def test_kernels_of_a_step_known_answer():
    assert gpu_program.loop_bodies(HLO) == ["body.7"]
    assert gpu_program.entry(HLO) == "main.9"
    found = gpu_program.kernels(HLO, "body.7", POOL_BYTES)
    # three GEMM fusions, two loop fusions, the custom call, the scatter and the copy; not the
    # parameter, get-tuple-elements, bitcasts or the tuple
    assert found["kernels"] == 8
    assert found["by_kind"] == {"fusion __triton_nested_gemm_fusion": 3, "fusion kLoop": 2,
                                "custom-call mosaic_gpu_v2": 1, "fusion kInput": 1, "copy": 1}
    splits = {g["name"]: (g["shape"], g["split_k"]) for g in found["gemms"]}
    assert splits == {"gemm_fusion_dot.1": ("f32[4,8,64]", 4),   # summed after it: split-K
                      "gemm_fusion_dot.2": ("bf16[8,128]", 1),
                      "gemm_fusion_dot.3": ("f32[2,8,8]", 1)}    # rank 3, nothing sums it
    # the in-place page write is not a pool-sized write; the copy of the pool is
    assert found["pool_sized"] == ["copy.1 copy bf16[2,64,16,8]"]
    assert gpu_program.kernels(HLO, "body.7")["pool_sized"] == []   # not asked
    # the whole program's own kernels: the loop runs its body's (control flow launches none)
    assert gpu_program.kernels(HLO, "main.9")["kernels"] == 0

    row = gpu_program.summary(found)
    assert row["split_gemms"] == 1 and row["kernels"] == 8
    assert sorted((g["shape"], g["split_k"], g["count"]) for g in row["gemms"]) == [
        ("bf16[8,128]", 1, 1), ("f32[2,8,8]", 1, 1), ("f32[4,8,64]", 4, 1)]


def test_target_config_describes_the_gpu():
    text = gpu_program.target_config("h200", "9.8", "12.8")
    assert 'device_description_str: "NVIDIA H200"' in text
    # stated so that XLA's 80% of it is the allocator limit at the fraction (0.95 by default)
    assert f"device_memory_size: {int(143_771 * 2**20 * 0.95 / 0.8)}" in text
    assert f"device_memory_size: {int(81_559 * 2**20 * 0.5 / 0.8)}" in gpu_program.target_config(
        "h100", "9.8", "12.8", memory_fraction=0.5)
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "dnn_version_info { major: 9 minor: 8 }" in text
    assert "runtime_version { major: 12 minor: 8 }" in text
    assert "NVIDIA H100 80GB HBM3" in gpu_program.target_config("h100", "9.1", "12.4")


def test_without_the_cuda_plugin_it_says_what_to_install():
    """In a process whose jax has no CUDA plugin (the test venv's), the deviceless compile stops
    with the packages to install (a fresh process: a CUDA plugin found by this one's jax would
    describe the GPU instead)."""
    code = ("import sys; sys.path.insert(0, 'benchmarks')\n"
            "try:\n    import jax_plugins.xla_cuda12\n    print('has plugin'); raise SystemExit(0)\n"
            "except ImportError:\n    pass\n"
            "import gpu_program; gpu_program.compile_only_device('h100', '9.8', '12.8')")
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=300)
    if "has plugin" in done.stdout:
        pytest.skip("this jax has the CUDA plugin")
    assert done.returncode != 0
    assert "jax-cuda12-plugin==" in done.stderr and "gpu_jax_check.sh --compile" in done.stderr


def test_a_decode_program_compiled_for_an_h100(tmp_path):
    """With the CUDA plugin (gpu_jax_check.sh --compile): a 2-layer bf16 decode of Qwen3-0.6B's
    widths compiled for an H100 runs the Mosaic kernel once a layer a step, writes no pool-sized
    buffer but in place, and with batch_invariant has no split GEMM and no cuBLAS call at 8 and
    64 rows."""
    pytest.importorskip("jax_plugins.xla_cuda12")
    import json
    out = tmp_path / "gpu_program.json"
    gpu_program.main(["--rows", "8", "64", "--num-layers", "2", "--vocab-size", "4096",
                      "--output", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert {(r["rows"], r["batch_invariant"]) for r in rows} == {(8, 0), (8, 1), (64, 0), (64, 1)}
    for r in rows:
        assert r["compiled_memory"]["backend"] == "gpu (NVIDIA H100 80GB HBM3, compile only)"
        assert r["by_kind"].get("custom-call mosaic_gpu_v2") == 2
        assert r["pool_sized"] == []
        if r["batch_invariant"]:
            assert r["split_gemms"] == 0
            assert not [k for k in r["by_kind"] if "cublas" in k]


def test_train_step_memory_compiled_for_an_h100(tmp_path):
    """With the CUDA plugin: train_throughput.py --compile-for h100 compiles its memory analysis
    for the H100 (the figures say so) beside plan mode's."""
    pytest.importorskip("jax_plugins.xla_cuda12")
    import importlib.util
    import json
    spec = importlib.util.spec_from_file_location(
        "train_throughput", pathlib.Path(gpu_program.__file__).with_name("train_throughput.py"))
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    out = tmp_path / "tt.json"
    tt.main(["--skip-throughput", "--compile-for", "h100", "--memory-preset", "tiny",
             "--memory-seq", "128", "--memory-response-len", "64", "--memory-batch", "4",
             "--memory-micro-batch", "2", "--remat", "full", "--attention", "auto",
             "--logprob-impls", "chunked", "--logprob-chunk", "256", "--out", str(out)])
    row, = json.loads(out.read_text())["memory"]
    assert row["backend"] == "gpu (NVIDIA H100 80GB HBM3, compile only)"
    assert row["peak_estimate_bytes"] > 0 and row["plan_update_bytes"] > 0


def test_local_target_reports_this_machines_decode_program(tmp_path, on_cpu):
    """--target local compiles for this machine's own device (a GPU's autotuned programs on a
    GPU; here XLA:CPU's): the whole script end to end at the tiny preset, a step's kernels and
    the call's, no buffer of a page pool's size written other than in place (as
    tests/test_attention.py checks on the CPU's program), the memory analysis the CPU's."""
    import json
    out = tmp_path / "local.json"
    gpu_program.main(["--target", "local", "--preset", "tiny", "--dtype", "float32",
                      "--rows", "4", "8", "--batch-invariant", "0", "1", "--new-tokens", "64",
                      "--prompt-len", "32", "--output", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["batch_invariant"]) for r in rows] == [(4, 0), (4, 1), (8, 0), (8, 1)]
    for r in rows:
        assert r["program"] == "decode" and r["kernels"] > 0 and r["call_kernels"] > 0
        assert r["pool_sized"] == []
        assert r["compiled_memory"]["backend"] == "cpu"
        assert sum(r["by_kind"].values()) == r["kernels"]


def test_a_decode_program_compiled_for_a_tpu(tmp_path):
    """--target v5p (libtpu, in a subprocess: tests/tpu_compile.py says why): a 2-layer bf16
    decode of Qwen3-0.6B's widths at 8 rows compiled for a v5p chip, its TPU memory analysis
    printed and recorded, its temporaries under two page pools' size (2026-11-28: 32.9 MB, one pool
    25.2 MB; 87.4 MB when the page writes made the TPU compiler relayout the pools)."""
    import json
    from tests.tpu_compile import run_compiling_for_a_tpu
    out = tmp_path / "tpu.json"
    done = run_compiling_for_a_tpu(
        ["benchmarks/gpu_program.py", "--target", "v5p", "--num-layers", "2",
         "--vocab-size", "1024", "--rows", "8", "--batch-invariant", "0", "--page-size", "16",
         "--prompt-len", "512", "--new-tokens", "1024", "--output", str(out)])
    assert "compiled memory [tpu (TPU v5, compile only)] decode_rows8_queue0_inv0" in done.stdout
    (row,) = json.loads(out.read_text())["results"]
    pool = 8 * (1 + 8 * 96) * 16 * 128 * 2   # one pool: K heads x pages x 16 x D, bf16
    assert row["program"] == "decode" and 0 < row["compiled_memory"]["temp_bytes"] < 2 * pool
