#!/usr/bin/env bash
# Quick start, command 2: set up and run every check (lint, types, tests). CI calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh dev
. .venv/bin/activate
ruff check runtime operator tests benchmarks
mypy runtime/vexpert_runtime operator/vexpert_operator
python -m pytest -q -m "not gpu and not cluster" "$@"
