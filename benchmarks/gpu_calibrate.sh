#!/usr/bin/env bash
# Hardware calibration on the GPU host (issue #6): `vexpert calibrate hardware` on every GPU, the
# 1-GPU proxy path when there are more, and the GPU tests. Results land in $OUT:
#   calib_<n>gpu.json            full result (a loadable PerformanceProfile with raw per-iteration timings)
#   calib_<n>gpu.stdout.json     the --json profile (small measurements)
#   termination_<n>gpu.txt       the termination message (≤ 4096 bytes)
#   calib_<n>gpu.stderr, topo.txt, gpus.csv, pytest_gpu.txt
# Run from anywhere; needs PYTHONPATH to include runtime/ and pydantic + torch (CUDA) installed.
# NCCL settings are taken from the environment as they are (nothing here sets or unsets NCCL_*).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_calibrate}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
echo "GPUs visible: $NGPU"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id,pcie.link.gen.current,pcie.link.width.current \
  --format=csv > "$OUT/gpus.csv" 2>&1 || true
env | grep -E '^(NCCL_|CUDA_VISIBLE_DEVICES)' | sort > "$OUT/env_nccl.txt" || true

rc=0
calibrate() {  # $1: number of GPUs
  local n="$1" start=$SECONDS
  "$PY" -m vexpert_runtime calibrate hardware --gpus "$n" --json \
    --output "$OUT/calib_${n}gpu.json" --termination-log "$OUT/termination_${n}gpu.txt" \
    > "$OUT/calib_${n}gpu.stdout.json" 2> "$OUT/calib_${n}gpu.stderr"
  local code=$?
  echo "calibrate hardware --gpus $n: exit $code, $((SECONDS - start)) s wall"
  if [ "$code" -ne 0 ]; then
    rc=1
    tail -5 "$OUT/calib_${n}gpu.stderr"
    return
  fi
  "$PY" - "$OUT/calib_${n}gpu.stdout.json" "$OUT/termination_${n}gpu.txt" <<'EOF'
import json, sys
from vexpert_runtime.calibration.hardware import format_summary
from vexpert_runtime.policy.profile import PerformanceProfile, parse_profile
profile = PerformanceProfile.model_validate_json(open(sys.argv[1]).read())
print(format_summary(profile))
m = profile.provenance.measurements
print(f"  node type       {profile.provenance.node_type.model_dump() if profile.provenance.node_type else None}")
print(f"  gpus            {m.get('gpus')}  host {m.get('host_memory_gib')} GiB, NUMA {m.get('numa_nodes')}")
print(f"  compute curve   " + " ".join(f"{t}:{ms}" for t, ms in zip(m['compute_tpe'], m['compute_ms'])) + " (TPE:ms)")
msg = open(sys.argv[2]).read()
parse_profile(json.loads(msg))
print(f"  termination message {len(msg.encode())} bytes, parses as PerformanceProfile")
EOF
}

if [ "$NGPU" -ge 1 ]; then
  calibrate "$NGPU"
  if [ "$NGPU" -gt 1 ]; then
    calibrate 1
  fi
else
  echo "no CUDA device: skipping the calibration runs"
  rc=1
fi

"$PY" -m pytest -m gpu tests/test_calibrate_hardware.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
test_rc=${PIPESTATUS[0]}
[ "$test_rc" -eq 0 ] || rc=1
exit "$rc"
