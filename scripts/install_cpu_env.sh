#!/usr/bin/env bash
# Create (or refresh) a CPU-only virtualenv with sglang 0.5.17 and sglang-ext.
#   bash scripts/install_cpu_env.sh [VENV_DIR]      (default: .venv)
# torch/torchvision: the matched 2.14.1 / 0.29.1 pair (PyPI's torchvision does not
# import beside a CPU-only torch build). sglang: --no-deps, because its pins pull
# CUDA-only packages; requirements/cpu-ci.txt lists what its Python needs on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.17}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
t0=$(date +%s)
"$VPY" -m pip install -q --upgrade pip uv
# torch first (pip: it sees the local wheel directory; uv would download GBs).
"$VPY" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
# uv: fast resolver + bytecode compile (imports of sglang are 3x slower without .pyc).
UV="$VENV/bin/uv"
# The installed torch satisfies every dependent's range, so uv keeps it.
"$UV" pip install -q --python "$VPY" --compile-bytecode -r requirements/cpu-ci.txt
"$UV" pip install -q --python "$VPY" --compile-bytecode --no-deps "sglang==$SGLANG_VERSION"
# the project itself (editable; pulls no dependencies: sglang and torch are the user's)
"$VPY" -m pip install -q --no-deps --no-build-isolation -e .
echo "install_cpu_env: $VENV ready in $(( $(date +%s) - t0 )) s (sglang $SGLANG_VERSION)"
