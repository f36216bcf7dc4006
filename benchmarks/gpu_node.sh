#!/usr/bin/env bash
# The node's GPU path on a GPU host (issue #7 groundwork): the GPU tests, then `vexpert node` on all
# visible GPUs (coordinator + one worker per GPU, NCCL all-to-all, slots in HBM filled over CUDA IPC
# from the coordinator's pinned pool) under a skewed decode load, once with the built-in demo model
# and once with a larger one (H=1024, I=512, 16 experts × 4 MoE layers, bf16: 3 MiB per expert), the
# larger one also on a single GPU for comparison.
# Results land in $OUT:
#   pytest_gpu.txt                 GPU tests (tests/test_runtime_gpu.py, tests/test_runtime_transport.py)
#   node_<model>_<n>gpu.stderr     the node's log: progress lines and the final metrics line
#   summary.txt                    per run: tokens/s, balance static → vExpert, slot-fill wait, bytes streamed
#   gpus.csv, topo.txt, env_nccl.txt
# Needs PYTHONPATH to include runtime/ and pydantic + torch (CUDA). NCCL settings are taken from the
# environment as they are (nothing here sets or unsets NCCL_*).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_node}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
ITERS="${ITERS:-200}"

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
echo "GPUs visible: $NGPU"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$OUT/gpus.csv" 2>&1 || true
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
env | grep -E '^(NCCL_|CUDA_VISIBLE_DEVICES)' | sort > "$OUT/env_nccl.txt" || true
if [ "$NGPU" -lt 1 ]; then
  echo "no CUDA device: nothing to run"
  exit 1
fi

rc=0
start=$SECONDS
timeout "${TEST_TIMEOUT:-170}" "$PY" -m pytest -v -p no:cacheprovider -m gpu --durations=0 \
  tests/test_runtime_gpu.py tests/test_runtime_transport.py > "$OUT/pytest_gpu.txt" 2>&1 || rc=1
echo "GPU tests: $((SECONDS - start)) s"
grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$OUT/pytest_gpu.txt" | tail -12

MODEL_DIR="$(mktemp -d)/medium-model"
"$PY" - "$MODEL_DIR" <<'EOF'
import sys
from vexpert_runtime.model.checkpoint import DEEPSEEK, MoESpec, write_tiny_checkpoint
spec = MoESpec(architecture=DEEPSEEK, hidden_size=1024, intermediate_size=512, num_experts=16, top_k=4,
               moe_layers=(1, 2, 3, 4), n_group=4, topk_group=2, routed_scaling_factor=2.5,
               norm_topk_prob=True, correction_bias=True, shared_intermediate_size=512)
write_tiny_checkpoint(sys.argv[1], spec, seed=0)
EOF

node() {  # $1 name, $2 checkpoint ('' = built-in), $3 tokens per worker, $4 GPUs
  local name="$1" ckpt="$2" tokens="$3" gpus="$4" port cfg="$OUT/runtime_$1_$4gpu.yaml"
  port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  cat > "$cfg" <<EOF
model: {checkpoint_path: "$ckpt", dtype: bfloat16}
parallelism: {expert_parallel_size: $gpus, gpus_per_node: $gpus, master_port: $port}
vexpert: {group_size: 2, vmax: 1, balance_threshold: 0.95}
tuning: {allocation_interval: 20}
runtime: {device: cuda, metrics_port: 0}
EOF
  local t0=$SECONDS log="$OUT/node_${name}_${gpus}gpu.stderr"
  timeout "${NODE_TIMEOUT:-60}" "$PY" -m vexpert_runtime node --config "$cfg" --iterations "$ITERS" \
    --tokens-per-worker "$tokens" --load bundled:decode_in1000out1000:100,bundled:prefill_in4096:100 \
    > /dev/null 2> "$log"
  local code=$?
  echo "vexpert node ($name, $gpus GPUs, $tokens tokens/worker): exit $code, $((SECONDS - t0)) s wall"
  [ "$code" -eq 0 ] || rc=1
  grep -E "cuda workers|stopped after" "$log" | sed 's/^vexpert node: //'
  { echo "[$name, $gpus GPUs, $tokens tokens/worker, bf16, exit $code]"; grep -E "stopped after" "$log" | sed 's/^vexpert node: //'; } >> "$OUT/summary.txt"
  [ "$code" -eq 0 ] || tail -20 "$log"
}
: > "$OUT/summary.txt"
node demo "" 256 "$NGPU"
node medium "$MODEL_DIR" 256 "$NGPU"
if [ "$NGPU" -gt 1 ]; then
  node medium "$MODEL_DIR" 256 1  # the same load on one GPU (no replicas possible: plan ids change, slots stay empty)
fi
rm -rf "$(dirname "$MODEL_DIR")"
exit $rc
