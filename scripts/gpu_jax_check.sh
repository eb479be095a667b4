#!/usr/bin/env bash
# Checks the Mosaic GPU decode kernel against the jax of the GPU image, on this CPU machine:
# its CUDA lowering (jax.export for "cuda": Mosaic GPU's layout inference, TMA and WGMMA shapes)
# and its runs in Mosaic GPU's CPU interpreter, with the jax / jaxlib / flax versions that
# ../shared/bench/README.md's GPU machine has (jax 0.11.2 needs Python >= 3.12; the project's
# own .venv takes the newest jax for its Python, 0.10.2 on 3.11). Why: the kernel's lowering
# changed between the two (2026-11-26: a q window copied from an unaligned row, accepted by
# jax 0.10's lowering and its interpreter, is refused by 0.11's), and a GPU session is too short
# to find that out there.
#
#   bash scripts/gpu_jax_check.sh                  # the kernel's tests and the sampler's
#   bash scripts/gpu_jax_check.sh tests/test_x.py  # other tests under that jax
#   bash scripts/gpu_jax_check.sh --compile benchmarks/gpu_program.py [args]
#       # a script under that jax with its CUDA plugin, JAX_PLATFORMS=cpu: programs compiled for
#       # an H100 / H200 without one (benchmarks/gpu_program.py's deviceless compile)
#
# Makes .venv-gpujax (git-ignored) with PYTHON312 (default: python3.12 on PATH, else pyenv's);
# --compile makes .venv-gpucompile, the same plus jax-cuda12-plugin / jax-cuda12-pjrt (~200 MB;
# kept apart: with the plugin installed, every jax import looks for a CUDA driver), and with
# COMPILE_CUDNN=1 nvidia-cudnn-cu12 9.8 (~700 MB: cuDNN attention, i.e. the prefill's and the
# train step's, asks the library's version when it is traced).
set -euo pipefail
cd "$(dirname "$0")/.."
JAX_VERSION=${GPU_JAX_VERSION:-0.11.2}
FLAX_VERSION=${GPU_FLAX_VERSION:-0.12.10}
VENV=.venv-gpujax
EXTRA=()
if [ "${1:-}" = "--compile" ]; then
  shift
  VENV=.venv-gpucompile
  EXTRA=("jax-cuda12-plugin==$JAX_VERSION" "jax-cuda12-pjrt==$JAX_VERSION")
  [ "${COMPILE_CUDNN:-0}" = 1 ] && EXTRA+=("nvidia-cudnn-cu12>=9.8,<9.9")
fi
if [ ! -x "$VENV/bin/python" ]; then
  PY=${PYTHON312:-}
  if [ -z "$PY" ]; then
    for cand in python3.12 python3.13 "$HOME"/.pyenv/versions/3.12*/bin/python; do
      if "$cand" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
        PY=$cand; break
      fi
    done
  fi
  [ -n "$PY" ] || { echo "gpu_jax_check: no Python >= 3.12 found (set PYTHON312)" >&2; exit 2; }
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
"$VENV/bin/python" -m pip install -q "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" \
    "flax==$FLAX_VERSION" pytest pytest-xdist "${EXTRA[@]}" -e .
# No persistent compile cache unless JAX_COMPILATION_CACHE_DIR names one (tests/conftest.py says
# why; with a directory shared with the project venv, jax 0.11.2 once segfaulted reading an entry,
# 2026-11-27: give each venv its own).
if [ ${#EXTRA[@]} -gt 0 ]; then
  [ $# -gt 0 ] || { echo "gpu_jax_check --compile: name the script to run" >&2; exit 2; }
  JAX_PLATFORMS=cpu exec "$VENV/bin/python" "$@"
fi
"$VENV/bin/python" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
if [ $# -eq 0 ]; then
  set -- tests/test_paged_decode.py tests/test_sampling.py tests/test_attention.py
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
