#!/usr/bin/env bash
# Issue #9 on a full 8-GPU node (the paper's setting), in one call: every GPU at once.
#   1. hardware calibration on all GPUs (per-GPU H2D under all-to-all contention, eta, spread)
#   2. `vexpert node` itself, streaming vs pre-filled, bf16 and FP8 (benchmarks/gpu_node_path.py)
#   3. `vexpert node` on all GPUs under a skewed real-load trace
#   4. the 64-GPU simulator prediction with the profile measured in step 1
# Results land in $OUT/{calibrate,gpu_node_path,node}/ and $OUT/simulate_64gpu.json.
# Needs PYTHONPATH with runtime/ and pydantic; NCCL settings are taken from the environment as they are.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_node8}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
rc=0
OUT="$OUT/calibrate" bash benchmarks/gpu_calibrate.sh || rc=1
"$PY" benchmarks/gpu_node_path.py --out "$OUT/gpu_node_path" || rc=1
OUT="$OUT/node" bash benchmarks/gpu_node.sh || rc=1
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
profile="$OUT/calibrate/calib_${NGPU}gpu.stdout.json"
if [ -f "$profile" ]; then
  "$PY" -m vexpert_runtime trace build --phase bundled:decode_in1000out1000:200 --phase bundled:prefill_in4096:200 \
    --phase bundled:decode_in500out1500:200 --gpus 64 --tokens-per-gpu 256 --top-k 8 --seed 0 -o "$OUT/ds3.npz" \
    && "$PY" -m vexpert_runtime simulate "$OUT/ds3.npz" --gpus 64 --nodes 8 --k 10 --group-size 2 --vmax 1 \
      --profile "$profile" --json > "$OUT/simulate_64gpu.json" || rc=1
fi
exit $rc
