"""Shared test set-up.

Backend. The suite runs on CPU unless told otherwise: JAX_PLATFORMS defaults to "cpu" here, so
`bash scripts/test.sh` on a GPU machine still tests on its CPU. To run it on the GPU:

    JAX_PLATFORMS=cuda,cpu bash scripts/test.sh

Tests marked `@pytest.mark.gpu` (the compiled Mosaic GPU paged decode attention, cuDNN
attention) run only when JAX's default backend is a GPU and are skipped elsewhere with that
reason. Tests marked `@pytest.mark.devices(n)` (meshes of n devices) skip when the default
backend has fewer (one GPU has one; the CPU has eight, below).
`XLA_FLAGS=--xla_force_host_platform_device_count=1 bash scripts/test.sh` shows on a CPU what a
one-GPU machine skips.

Tests marked `@pytest.mark.cpu` expect what only the CPU gives (figures of XLA:CPU's own, a host-only
profiler trace, no data-sheet peak) and skip elsewhere; the GPU side of what they cover is
measured by scripts/gpu_bench.sh. Tests that compare with XLA:CPU's compiled figures or HLO, or
compute a reference for CPU worker processes, take the `on_cpu` fixture instead: they run on any
machine, with the CPU as JAX's default device and attention dispatch seeing no CUDA GPU.

On a CUDA run (JAX_PLATFORMS naming cuda or gpu) the suite also sets
XLA_PYTHON_CLIENT_PREALLOCATE=false, so the processes some tests start (the main job, resumes
after a kill, two-host runs) can allocate beside the pytest process instead of finding 75% of the
GPU taken, and adds XLA_FLAGS --xla_gpu_deterministic_ops=true: the exact-resume tests compare two
runs' weights at 1e-6, and XLA:GPU's scatter-adds (the embedding gradient) use atomics, whose
order differs run to run. (Neither is set for the product: they are the suite's choices.)

Eight simulated CPU devices (XLA_FLAGS --xla_force_host_platform_device_count=8) for the whole
session, so the sharding tests can build meshes; this must happen before jax is first imported.
The flag only changes the CPU platform: on a GPU run the GPU is still device 0 and the CPU devices
stay beside it.

Matmul precision. JAX_DEFAULT_MATMUL_PRECISION defaults to "highest" for the whole session (set
before jax is imported, so every trace in every thread and every subprocess a test starts sees it).
The tests compare fp32 results with float64 / full-logits references at 1e-5; on a GPU JAX's
default precision lets XLA run fp32 matmuls in TF32 (10-bit mantissa), which breaks those
comparisons by 3e-4 to 5e-2 (issue #16). The pin is read when a function is traced (jax.jit caches
per precision), so it holds inside jit and inside Pallas kernel bodies. On CPU it changes nothing:
XLA:CPU computes fp32 matmuls in fp32 either way. Set the variable yourself (e.g. to "default") to
run the suite at the backend's own precision.

CPU code generation. On the CPU (JAX_PLATFORMS=cpu, the default here) the suite compiles with
XLA_FLAGS --xla_backend_optimization_level=0: LLVM's optimisation of the generated machine code
only, after every HLO pass (fusion, layout, buffer assignment: the compiled memory analyses the
plan tests check are the same). The suite's programs are tiny and compiled once or twice each, so
this takes ~40% off their compile time (test_plan's update-phase grid: 56 s -> 34 s). Results
differ from the default level's by rounding (a tiny model's fp32 logits by 3e-7, its sampled
log-probs by 1e-6; what vectorised code rounds differently), which every tolerance here allows.
Set the flag in XLA_FLAGS yourself to test at another level; GPU runs are left alone.
Also --xla_cpu_use_fusion_emitters=false: XLA:CPU's elemental fusion emitter instead of its newer
MLIR fusion emitters, whose per-fusion lowering pipeline was most of a compile after the HLO
passes (one of test_plan's train steps: 8.2 s -> 3.4 s, the same buffer assignment to within 192
bytes of 416 MB; test_plan + test_sampling + test_train_step + test_default_run + test_sampler_ab
with an empty cache: 247 s -> 133 s, the same passes and strict xfails). Added only where this
jaxlib's XLA accepts it (an unknown flag in XLA_FLAGS aborts the process): checked once per session
in a subprocess. Put `--xla_cpu_use_fusion_emitters=true` in XLA_FLAGS to test the default.
test_default_run.py runs the README's main job with neither flag (rl_fixtures.default_codegen_env),
so the product is also tested end to end as a user's CPU run compiles it.

Compiled once a process. On the CPU (JAX_PLATFORMS=cpu) tests/compile_once.py keeps the
executables XLA compiled in this process (LRU, in memory) and gives one back for a program
compiled before with the same cache key and devices: tests that each build their own run
compile the same train step again otherwise. SUITE_COMPILE_ONCE=0 turns it off.

Compilation cache: off. JAX's persistent compilation cache would compile each program once per
run for the two workers and the subprocesses tests start, but every cache write runs XLA:CPU's
executable serialization, which crashed a pytest worker (SIGSEGV in `executable.serialize()`,
jax 0.10.2) in 2 of about 10 full runs, and pytest-xdist then hung until CI's time limit. The
suite took 9 min 5 s without it against ~8 min 40 s with it from an empty cache (a clean clone),
both on the 2-core VM (2026-11-28). A developer may still point JAX_COMPILATION_CACHE_DIR at a
directory for warm reruns of a checkout (e.g. `.jax_cache/tests`, git-ignored); its key is the
program, the compile options, the devices and the jax/jaxlib versions, so a hit runs the same
executable a compile would have built.
"""
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CPU code-generation flags below, by name (rl_fixtures.default_codegen_env removes them).
SUITE_CODEGEN_FLAGS = ("xla_backend_optimization_level", "xla_cpu_use_fusion_emitters")
_OPT_LEVEL, _EMITTERS = SUITE_CODEGEN_FLAGS
if os.environ["JAX_PLATFORMS"] == "cpu" and _OPT_LEVEL not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" --{_OPT_LEVEL}=0"
_EMITTER_FLAG = f"--{_EMITTERS}=false"
if (os.environ["JAX_PLATFORMS"] == "cpu"
        and _EMITTERS not in os.environ["XLA_FLAGS"]
        and os.environ.get("DELTA_JAX_TEST_EMITTER_FLAG") != "unknown"):
    # One probe per session: the pytest-xdist workers and every subprocess inherit XLA_FLAGS (or
    # the "unknown" verdict) from the process that ran it.
    _probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, timeout=300,
        env={**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {_EMITTER_FLAG}"})
    if _probe.returncode == 0:
        os.environ["XLA_FLAGS"] += " " + _EMITTER_FLAG
    else:
        os.environ["DELTA_JAX_TEST_EMITTER_FLAG"] = "unknown"
if any(name in os.environ["JAX_PLATFORMS"] for name in ("cuda", "gpu")):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if "xla_gpu_deterministic_ops" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_gpu_deterministic_ops=true"
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")  # "" = off, here and in subprocesses
if not os.environ["JAX_COMPILATION_CACHE_DIR"]:
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
# Where a developer turns it on: cache compiles from 0.1 s (JAX's default is 1 s; most of the
# suite's compiles are shorter but repeat) and keep the directory under 2 GiB, LRU first.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))

import pytest  # noqa: E402

REPO_ROOT = _REPO
SHARED_DIR = REPO_ROOT.parent / "shared"
GPU_MARKER = "gpu: needs a GPU as JAX's default backend (JAX_PLATFORMS=cuda,cpu); skipped elsewhere"
DEVICES_MARKER = ("devices(n): needs n JAX devices (the CPU backend has eight here); skipped on a "
                  "backend with fewer, e.g. one GPU")
CPU_MARKER = ("cpu: expects what only the CPU backend gives (XLA:CPU's figures, host-only traces); "
              "skipped where JAX's default backend is another")


def pytest_configure(config):
    if os.environ["JAX_PLATFORMS"] == "cpu" and os.environ.get("SUITE_COMPILE_ONCE") != "0":
        from tests import compile_once  # a program compiled once a process (its docstring)
        compile_once.install()
    config.addinivalue_line("markers", GPU_MARKER)
    config.addinivalue_line("markers", DEVICES_MARKER)
    config.addinivalue_line("markers", CPU_MARKER)


def pytest_runtest_setup(item):
    gpu, devices = item.get_closest_marker("gpu"), item.get_closest_marker("devices")
    cpu = item.get_closest_marker("cpu")
    if gpu is None and devices is None and cpu is None:
        return
    import jax

    backend = jax.default_backend()
    if gpu is not None and backend != "gpu":
        pytest.skip(f"GPU-only path; JAX's default backend is {backend!r} (run with "
                    f"JAX_PLATFORMS=cuda,cpu on a GPU machine)")
    if cpu is not None and backend != "cpu":
        pytest.skip(f"expects the CPU backend's own results; JAX's default backend is {backend!r} "
                    f"(scripts/gpu_bench.sh measures this on a GPU)")
    if devices is not None and len(jax.devices()) < devices.args[0]:
        pytest.skip(f"needs {devices.args[0]} devices; the {backend} backend has "
                    f"{len(jax.devices())}")


@pytest.fixture
def on_cpu(monkeypatch):
    """The CPU as the backend a test compiles and dispatches for, whatever JAX_PLATFORMS names:
    JAX's default device is the first CPU device (which attention dispatch follows: no cuDNN,
    no GPU paged decode kernel, model.remat=auto's CPU order), and the device reports no
    allocator limit, as the CPU does. For tests whose expected values are XLA:CPU's (compiled
    memory figures, HLO text) or that compare with CPU worker processes. Changes nothing on
    the CPU."""
    import jax
    from delta_jax import plan
    monkeypatch.setattr(plan, "device_memory_bytes", lambda device=None: None)
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def few_executables():
    """JAX's caches cleared (and the dropped executables collected) before a test that runs
    jax.profiler traces: a trace's stop takes time in proportion to the executables alive in the
    process (0.65 s a trace in a worker after tests/test_sampling.py, 0.04 s in a fresh process,
    jax 0.10.2; decode_gemm's tiny run stops 12 traces: 12 s against 2 s). The programs the test
    then runs compile afresh, as in a benchmark's own process."""
    import gc

    import jax

    from tests import compile_once
    jax.clear_caches()
    compile_once.clear()
    gc.collect()


@pytest.fixture(scope="session")
def shared_dir():
    """../shared beside the checkout (data sets, the Qwen3 tokenizer); skip when absent."""
    if not SHARED_DIR.is_dir():
        pytest.skip("../shared is not present beside the checkout")
    return SHARED_DIR


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(shared_dir):
    path = shared_dir / "tokenizers" / "qwen3"
    if not (path / "tokenizer.json").is_file():
        pytest.skip("../shared/tokenizers/qwen3 is not present")
    return path
