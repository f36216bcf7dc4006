#!/usr/bin/env bash
# Issue #21 on a GPU host: the serving engine's GPU tests, then benchmarks/serve_engine.py.
#   STAGE=tests   the GPU tests of the engine (decode kernels, graphed decode == eager)
#   STAGE=bench   serve_engine.py with ARGS (default: hf baseline + vexpert at 16/64/256 streams)
# pydantic travels as wheels in .whl (see the device README); results land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/serve_engine}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/runtime:$PWD/tests
  [ -x /tmp/site/bin/py-spy ] && export PYSPY=/tmp/site/bin/py-spy  # host sampling (serve_engine.py --pyspy)
else
  export PYTHONPATH=$PWD/runtime:$PWD/tests
fi
case "${STAGE:-bench}" in
  tests)
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu -x ${TESTS:-tests/test_serve_gpu.py} \
      2>&1 | tee "$OUT/pytest_gpu.txt" | tail -30 ;;
  bench)
    python3 benchmarks/serve_engine.py --out "$OUT" ${ARGS:-} 2>&1 | tee "$OUT/bench.txt" | grep -v "Loading weights" | tail -40 ;;
esac
