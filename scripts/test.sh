#!/usr/bin/env bash
# The README's test command: set up .venv with the test extras, then run the whole suite.
# pytest exits 5 when it collects no test; that is a failure here too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
# libtpu, the TPU compiler, at the version this jax pins (its "tpu" extra), in .tpu-compile beside
# the venv rather than in it: tests compile the rollout engine's programs for a TPU slice without
# one (tests/tpu_compile.py), while the venv's own jax (the main job's) never looks for a TPU.
# TPU_COMPILE=0 leaves it out (those tests then skip).
if [ "${TPU_COMPILE:-1}" != 0 ]; then
  pin=$(.venv/bin/python -c 'import importlib.metadata as m; print(next((r.split(";")[0].replace(" ", "") for r in m.requires("jax") or () if r.startswith("libtpu") and "tpu" in r), ""))')
  if [ -n "$pin" ]; then
    have=$(cat .tpu-compile/.pin 2>/dev/null || true)
    if [ "$have" != "$pin" ]; then
      rm -rf .tpu-compile
      .venv/bin/python -m pip install -q --no-deps --target .tpu-compile "$pin"
      echo "$pin" > .tpu-compile/.pin
    fi
    export PYTHONPATH="$PWD/.tpu-compile${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
# Two pytest workers, whole files each (module fixtures are built once): the suite is mostly
# XLA compiles, and two CPU cores take ~20% less time that way. TEST_WORKERS=0 runs it in this
# process. On a CUDA GPU (JAX_PLATFORMS=cuda,cpu) the workers share the GPU (tests/conftest.py
# turns off JAX's preallocation there), three for every four cores: the whole suite took 290 s
# with 12 workers on one H200 with 16 cores (2026-11-26). A TPU (or ROCm) is one process's:
# one worker there, this process.
case "${JAX_PLATFORMS:-cpu}" in
  *cuda*|*gpu*) workers="${TEST_WORKERS:-$(( ($(nproc) * 3 + 3) / 4 ))}" ;;
  *rocm*|*tpu*) workers="${TEST_WORKERS:-0}" ;;
  *) workers="${TEST_WORKERS:-2}" ;;
esac
# A worker that crashes (a segfault in XLA) ends the run with that test failed rather than being
# replaced: once, a replacement worker hung until CI's time limit.
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --max-worker-restart=0 tests "$@"
