#!/usr/bin/env bash
# The GPU checks in one command: every test marked `gpu` under tests/gpu/, then a summary.
#
#   scripts/gpu_check.sh [PYTEST ARGS...]      e.g. scripts/gpu_check.sh -k two_gpu
#
# Prints the GPUs torch sees, runs `pytest -m gpu tests/gpu` under a bound (GPU_CHECK_TIMEOUT_S,
# default 480 s), and ends with one line per test (PASSED / FAILED / SKIPPED / ERROR, seconds) and
# the totals. The JUnit report and the output are kept in GPU_CHECK_DIR (default gpu_check/).
# Exit status: pytest's (0 all passed), 2 when no CUDA device is visible (nothing was checked),
# 124 when the bound passed.
# PYTHON: the interpreter with beamsplit installed (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TIMEOUT_S=${GPU_CHECK_TIMEOUT_S:-480}
OUT_DIR=${GPU_CHECK_DIR:-gpu_check}

# One import of torch answers "is there a GPU" (a second or two); nothing else runs without one.
if ! devices=$("$PYTHON" - <<'EOF'
import torch

if not torch.cuda.is_available():
    built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    raise SystemExit(f"no GPU: torch {torch.__version__} ({built}) sees no CUDA device; nothing was checked")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s):")
for index in range(torch.cuda.device_count()):
    properties = torch.cuda.get_device_properties(index)
    print(f"  cuda:{index} {properties.name}, {properties.total_memory / 2**30:.0f} GiB")
EOF
); then
  exit 2
fi
echo "$devices"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader || true

mkdir -p "$OUT_DIR"
report="$OUT_DIR/junit.xml"
status=0
started=$SECONDS
timeout --kill-after=30 "$TIMEOUT_S" "$PYTHON" -m pytest -m gpu tests/gpu -v -rA -p no:cacheprovider \
  --junitxml="$report" "$@" 2>&1 | tee "$OUT_DIR/pytest.log" || status=${PIPESTATUS[0]}

echo
echo "== GPU check summary ($((SECONDS - started)) s, bound ${TIMEOUT_S} s) =="
if [[ $status == 124 || $status == 137 ]]; then
  echo "TIMED OUT after ${TIMEOUT_S} s; see $OUT_DIR/pytest.log"
  exit 124
fi
"$PYTHON" - "$report" <<'EOF'
import sys
import xml.etree.ElementTree as ElementTree

try:
    cases = ElementTree.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ElementTree.ParseError) as error:
    raise SystemExit(f"no report ({error}); see the output above")
totals: dict[str, int] = {}
for case in cases:
    outcome = "PASSED"
    for tag, name in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "SKIPPED")):
        found = case.find(tag)
        if found is not None:
            outcome = name
            reason = (found.get("message") or "").splitlines()[0:1]
            break
    else:
        reason = []
    totals[outcome] = totals.get(outcome, 0) + 1
    detail = f"  ({reason[0][:100]})" if reason and outcome != "PASSED" else ""
    print(f"{outcome:8} {float(case.get('time', 0)):7.1f}s  {case.get('classname')}::{case.get('name')}{detail}")
print("totals: " + ", ".join(f"{count} {outcome.lower()}" for outcome, count in sorted(totals.items())))
EOF
echo "report: $report, output: $OUT_DIR/pytest.log"
exit "$status"
