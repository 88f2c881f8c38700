#!/usr/bin/env bash
# The whole test suite: install, lint (ruff), types (mypy), import contracts, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] ruff"
.venv/bin/ruff check .  # each on its own line: under set -e a failure left of && would not stop the run
.venv/bin/ruff format --check .
echo "[test] mypy"; .venv/bin/mypy
echo "[test] import contracts"; .venv/bin/lint-imports
echo "[test] pytest"; .venv/bin/python -m pytest -q "$@"
