#!/usr/bin/env bash
# Quick start, command 2: set up and run every check (lint, types, tests). CI calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh dev
. .venv/bin/activate
ruff check runtime operator tests benchmarks
mypy runtime/vexpert_runtime operator/vexpert_operator
# benchmarks call the product's classes, and no test runs the GPU ones: checked for calls the product no longer
# has (attributes, arguments, names); their loose local typing is left alone
MYPYPATH=runtime:operator mypy --disable-error-code assignment --disable-error-code arg-type --disable-error-code misc \
    --disable-error-code var-annotated --disable-error-code no-redef --disable-error-code return-value benchmarks
# tests run in VEXPERT_TEST_JOBS processes (pytest-xdist; work stealing evens out the slow ones), by default one more
# than the cores: many tests wait on the servers and nodes they start, and a third process on a 2-core machine keeps
# both cores busy (857 → 813 s, 194 % CPU; 2026-12-07); VEXPERT_TEST_JOBS=0 runs them in this process, one after another
python -m pytest -q -n "${VEXPERT_TEST_JOBS:-$(( $(nproc) + 1 ))}" --dist worksteal --durations=25 -m "not gpu and not cluster" "$@"
