#!/usr/bin/env bash
# The README's test command: set up .venv with the test extras, then run the whole suite.
# pytest exits 5 when it collects no test; that is a failure here too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
exec .venv/bin/python -m pytest -q tests "$@"
