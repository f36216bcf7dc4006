#!/usr/bin/env bash
# Quick start, command 2: set up and run every check (lint, types, tests). CI calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh dev
. .venv/bin/activate
ruff check runtime operator tests benchmarks
mypy runtime/vexpert_runtime operator/vexpert_operator
# tests run in VEXPERT_TEST_JOBS processes (pytest-xdist; work stealing evens out the slow ones);
# VEXPERT_TEST_JOBS=0 runs them in this process, one after another
python -m pytest -q -n "${VEXPERT_TEST_JOBS:-2}" --dist worksteal --durations=25 -m "not gpu and not cluster" "$@"
