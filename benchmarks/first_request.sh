#!/usr/bin/env bash
# Time from `vexpert serve` start to /health 200, then the time of one 4-token completion sent
# IDLE seconds (default 0) after /health. Usage (with the repo's venv active or VEXPERT set):
#   benchmarks/first_request.sh MODEL_DIR [vexpert serve args...]
#   e.g. benchmarks/first_request.sh /tmp/cpu-compare/model --cpu-workers 1 --compile on
# A non-200 completion is reported as a failure, not timed.
set -uo pipefail
model=$1; shift
vexpert=${VEXPERT:-vexpert}
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
log=$(mktemp -t vexpert-first-XXXX.log)
start=$(date +%s.%N)
$vexpert serve --model "$model" --host 127.0.0.1 --port "$port" --served-model-name bench "$@" > "$log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
until curl -sf "localhost:$port/health" > /dev/null; do
  kill -0 $pid 2>/dev/null || { echo "server exited; log: $log"; exit 1; }
  sleep 0.2
done
healthy=$(date +%s.%N)
sleep "${IDLE:-0}"
t0=$(date +%s.%N)
code=$(curl -s -o /dev/null -w "%{http_code}" "localhost:$port/v1/completions" -H 'content-type: application/json' \
  -d '{"model":"bench","prompt":"hello there","max_tokens":4}')
t1=$(date +%s.%N)
[ "$code" = 200 ] || { echo "first completion answered $code; log: $log"; exit 1; }
python3 -c "print('health after %.1f s; first completion %.2f s, sent %.0f s after health' % ($healthy-$start, $t1-$t0, $t0-$healthy))"
