#!/usr/bin/env bash
# Create (or refresh) a CPU-only virtualenv with sglang and sglang-ext.
#   [SGLANG_VERSION=0.5.23] bash scripts/install_cpu_env.sh [VENV_DIR]   (default: 0.5.17, .venv)
# torch/torchvision: the matched 2.14.1 / 0.29.1 pair (PyPI's torchvision does not
# import beside a CPU-only torch build). sglang: --no-deps, because its pins pull
# CUDA-only packages; requirements/cpu-ci.txt lists what its Python needs on a CPU, and
# requirements/cpu-ci-<version>.txt (when present) overrides the pins that release changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.17}"
PY="${PYTHON:-python3}"
SUPPORTED=$("$PY" -c 'import runpy, sys; print(" ".join(runpy.run_path(sys.argv[1])["SUPPORTED_SGLANG"]))' python/sglang_ext/versions.py)
case " $SUPPORTED " in *" $SGLANG_VERSION "*) ;; *) echo "install_cpu_env: SGLANG_VERSION=$SGLANG_VERSION is not a supported release ($SUPPORTED)" >&2; exit 2 ;; esac
OVERRIDE=()
[ ! -f "requirements/cpu-ci-$SGLANG_VERSION.txt" ] || OVERRIDE=(--override "requirements/cpu-ci-$SGLANG_VERSION.txt")
export PIP_NO_INPUT=1  # never prompt (CI, no stdin)
t0=$(date +%s)
phase_t=$t0
phase() {  # phase NAME: print how long the previous phase took
  local now; now=$(date +%s)
  echo "install_cpu_env: $1 ($((now - phase_t)) s)"
  phase_t=$now
}
# pip warns once per local index directory it cannot use; those lines say nothing about this install.
pip_quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:///" >&2); }

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
pip_quiet "$VPY" -m pip install -q --upgrade pip uv
phase "venv, pip, uv"
# torch first (pip: it sees the local wheel directory; uv would download GBs).
pip_quiet "$VPY" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
phase "torch 2.14.1 + torchvision 0.29.1"
# uv: fast resolver + bytecode compile (imports of sglang are 3x slower without .pyc).
# Its package cache (~/.cache/uv, or UV_CACHE_DIR) makes reruns on the same machine fast.
UV="$VENV/bin/uv"
# The installed torch satisfies every dependent's range, so uv keeps it.
"$UV" pip install -q --python "$VPY" --compile-bytecode -r requirements/cpu-ci.txt "${OVERRIDE[@]}"
"$UV" pip install -q --python "$VPY" --compile-bytecode --no-deps "sglang==$SGLANG_VERSION"
phase "dependencies + sglang $SGLANG_VERSION --no-deps"
# the project itself (editable; pulls no dependencies: sglang and torch are the user's)
pip_quiet "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
phase "sglang-ext (editable)"
echo "install_cpu_env: $VENV ready in $(( $(date +%s) - t0 )) s (sglang $SGLANG_VERSION)"
