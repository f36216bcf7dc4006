#!/usr/bin/env bash
# Create .venv with torch and the project. Where no NVIDIA GPU is visible torch is the CPU build,
# asked for by its local version (torch==X+cpu): pip takes it from the configured sources (a local
# wheel cache or mirror) when they hold it, else from the PyTorch CPU index (≈ 200 MB). A plain
# `pip install torch` from PyPI would fetch the multi-GB CUDA build and its 16 nvidia-* packages.
#   VEXPERT_TORCH=cpu|cuda   overrides the GPU detection
#   SETUP_DRY_RUN=1          prints the torch install commands and stops
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu

variant=${VEXPERT_TORCH:-}
if [ -z "$variant" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then variant=cuda; else variant=cpu; fi
fi
case "$variant" in
  cuda) first=(python -m pip install -q "torch==$TORCH_VERSION"); fallback=() ;;
  cpu)  first=(python -m pip install -q "torch==$TORCH_VERSION+cpu")
        fallback=(python -m pip install -q "torch==$TORCH_VERSION+cpu" --extra-index-url "$CPU_INDEX") ;;
  *) echo "error: VEXPERT_TORCH: must be cpu or cuda, got '$variant' (fix: unset it to detect the GPU)" >&2; exit 2 ;;
esac
if [ -n "${SETUP_DRY_RUN:-}" ]; then
  echo "torch: $variant"
  echo "${first[*]}"
  [ ${#fallback[@]} -eq 0 ] || echo "else: ${fallback[*]}"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch before the project, so that the project's `torch>=2.4` is already satisfied by this build.
if ! python -c "import torch" 2>/dev/null; then
  if ! "${first[@]}" 2>/dev/null; then
    [ ${#fallback[@]} -gt 0 ] || { "${first[@]}"; exit 1; }  # show pip's error
    "${fallback[@]}"
  fi
fi
python -m pip install -q -e ".[${1:-dev}]"
