#!/usr/bin/env bash
# Regenerates the committed gRPC stubs in beamsplit/v1/ from proto/beamsplit/v1/*.proto.
# Usage: scripts/gen_proto.sh [OUTPUT_ROOT]   (default: the repository root)
# tests/unit/test_proto_stubs.py runs it into a temporary directory and diffs the result.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT/beamsplit/v1"
"$PY" -m grpc_tools.protoc -I proto --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" \
  proto/beamsplit/v1/*.proto
if [ ! -f "$OUT/beamsplit/v1/__init__.py" ]; then
  echo '"""Generated gRPC stubs (scripts/gen_proto.sh); never edit by hand."""' > "$OUT/beamsplit/v1/__init__.py"
fi
