#!/usr/bin/env bash
# The README's test command: set up .venv with the test extras, then run the whole suite.
# pytest exits 5 when it collects no test; that is a failure here too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
# Two pytest workers, whole files each (module fixtures are built once): the suite is mostly
# XLA compiles, and two CPU cores take ~20% less time that way. TEST_WORKERS=0 runs it in this
# process, the default when JAX_PLATFORMS names an accelerator (one process per GPU: each
# would claim most of its memory).
case "${JAX_PLATFORMS:-cpu}" in
  *cuda*|*gpu*|*rocm*|*tpu*) workers="${TEST_WORKERS:-0}" ;;
  *) workers="${TEST_WORKERS:-2}" ;;
esac
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile tests "$@"
