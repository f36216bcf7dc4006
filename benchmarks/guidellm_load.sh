#!/usr/bin/env bash
# Issue #22: a load run with a load generator we did not write — guidellm 0.8.1 — against `vexpert serve`
# on CPU (the embedded demo model, 2 CPU workers), closed-loop concurrency 1, 8 and 32, 64-token
# synthetic prompts, 64 output tokens. guidellm lives in its own venv (it pins its own dependencies):
#   python3 -m venv /work/guidellm-venv && /work/guidellm-venv/bin/pip install torch==2.13.0 guidellm==0.8.1
#   ./benchmarks/guidellm_load.sh [OUT]          # results: OUT/guidellm.json, OUT/console.txt, OUT/server.log
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/guidellm}"
GUIDELLM="${GUIDELLM:-/work/guidellm-venv/bin/guidellm}"
SECONDS_PER_LEVEL="${SECONDS_PER_LEVEL:-40}"
mkdir -p "$OUT"
PORT=$(.venv/bin/python -c "from vexpert_runtime.ports import free_port; print(free_port())")
.venv/bin/vexpert serve --host 127.0.0.1 --port "$PORT" --cpu-workers 2 > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 180); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
TOKENIZER="${XDG_CACHE_HOME:-$HOME/.cache}/vexpert/demo-model"
"$GUIDELLM" run --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=vexpert-demo,request_format=/v1/completions,max_tokens=64" \
  --profile kind=concurrent,streams=1 --override profile.streams 1,8,32 \
  --constraint "kind=max_duration,seconds=$SECONDS_PER_LEVEL" \
  --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
  --data kind=synthetic_text,prompt_tokens=64 \
  --output "kind=json,path=$OUT/guidellm.json" --output kind=console 2>&1 | tee "$OUT/console.txt"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^vexpert_serve_requests_total' > "$OUT/requests_by_status.txt" || true
