#!/usr/bin/env bash
# Create .venv with the CPU build of torch (from the local wheel cache when present) and the project.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# Install torch first: otherwise pip resolves `torch` to a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" || python -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch
python -m pip install -q -e ".[${1:-dev}]"
