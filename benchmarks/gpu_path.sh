#!/usr/bin/env bash
# Issue #7 on a GPU host: the GPU tests of the path (tests/test_gpu_path.py -m gpu), then
# benchmarks/gpu_path.py on all visible GPUs (≤ 2). Results land in $OUT:
#   pytest_gpu.txt, run.log, summary.json and one <section>.json per section, gpus.csv, topo.txt
# Needs PYTHONPATH with runtime/ and pydantic; NCCL settings are taken from the environment as they are.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu_path}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/gpus.csv" 2>&1 || true
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
"$PY" -c "import torch; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count())"
rc=0
start=$SECONDS
timeout "${TEST_TIMEOUT:-60}" "$PY" -m pytest -q -o addopts="" -p no:cacheprovider -m gpu tests/test_gpu_path.py \
  > "$OUT/pytest_gpu.txt" 2>&1 || rc=1
echo "GPU tests ($((SECONDS - start)) s):"; tail -3 "$OUT/pytest_gpu.txt"
start=$SECONDS
timeout "${BENCH_TIMEOUT:-170}" "$PY" benchmarks/gpu_path.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/run.log" | cut -c1-600
code=${PIPESTATUS[0]}
echo "benchmark: exit $code, $((SECONDS - start)) s"
[ "$code" -eq 0 ] || rc=1
exit $rc
