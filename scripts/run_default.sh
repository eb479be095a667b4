#!/usr/bin/env bash
# The README's main-job command: set up .venv, then run the embedded default experiment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m delta_jax.main --config=experiments/tiny.py --workdir="${WORKDIR:-runs/tiny}" "$@"
