#!/usr/bin/env bash
# The README's test command: set up .venv with the test extras, then run the whole suite.
# pytest exits 5 when it collects no test; that is a failure here too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
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
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile tests "$@"
