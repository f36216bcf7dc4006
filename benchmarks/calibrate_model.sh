#!/usr/bin/env bash
# Model calibration (issue #6) on the shared real loads, then the simulator with the calibrated
# profile and the ±20 % sensitivity table (paper Table 2). Results: benchmarks/results/calibration/.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/data}
R=benchmarks/results/calibration
mkdir -p out "$R"
vexpert trace build --phase $SHARED/deepseek-v3/decode_in1000out1000.json:200 \
  --phase $SHARED/deepseek-v3/prefill_in4096.json:200 --phase $SHARED/deepseek-v3/decode_in500out1500.json:200 \
  --gpus 64 --tokens-per-gpu 256 --top-k 8 --seed 0 -o out/ds3.npz >/dev/null
vexpert trace build --phase $SHARED/qwen1.5-moe/expert_freq_qwen_policy_datasets.csv:80 \
  --gpus 4 --tokens-per-gpu 256 --top-k 4 --seed 0 -o out/qwen_datasets.npz >/dev/null
vexpert trace build --phase $SHARED/qwen1.5-moe/expert_freq_qwen_policy_skew.csv:90 \
  --gpus 4 --tokens-per-gpu 256 --top-k 4 --seed 0 -o out/qwen_skew.npz >/dev/null
for ev in next same; do
  /usr/bin/time -f "deepseek-v3 ($ev): %e s" vexpert calibrate model --trace out/ds3.npz --gpus 64 --evaluate $ev \
    --output $R/model_deepseek_v3_$ev.json
  /usr/bin/time -f "qwen1.5-moe ($ev): %e s" vexpert calibrate model --trace out/qwen_datasets.npz \
    --trace out/qwen_skew.npz --gpus 4 --evaluate $ev --output $R/model_qwen15_moe_$ev.json
done
# A full profile: H200 hardware (2 GPUs, measured) + DeepSeek-V3 coefficients (fitted, online "next").
python - "$R" <<'PY'
import json, sys
from vexpert_runtime.policy.profile import PerformanceProfile
r = sys.argv[1]
hw = PerformanceProfile.model_validate_json(open(f"{r}/calib_2gpu.stdout.json").read())
fit = json.load(open(f"{r}/model_deepseek_v3_next.json"))
fit.pop("fit", None)
model = PerformanceProfile.model_validate(fit)
full = hw.with_load_balance(model.load_balance)
open(f"{r}/profile_h200_deepseek_v3.json", "w").write(full.model_dump_json(indent=2))
PY
vexpert simulate out/ds3.npz --gpus 64 --nodes 8 --sensitivity --policies static,vexpert-k1,vexpert,vexpert-future \
  | tee $R/simulate_paper_profile_sensitivity.txt
vexpert simulate out/ds3.npz --gpus 64 --nodes 8 --sensitivity --policies static,vexpert-k1,vexpert,vexpert-future \
  --profile $R/profile_h200_deepseek_v3.json | tee $R/simulate_calibrated_profile_sensitivity.txt
