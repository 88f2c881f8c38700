#!/usr/bin/env bash
# The two-GPU layout on one host: the context worker on GPU 0, the generation worker on GPU 1,
# the coordinator (CPU only) in front of them. KV pages move GPU to GPU over UCX.
#
#   deploy/two_gpu.sh [MODEL] [DTYPE]      e.g. deploy/two_gpu.sh /models/llama-3.2-1b bfloat16
#
# Environment: HOST (bind address, default 127.0.0.1), BASE_PORT (default 50050: coordinator
# 50050, context 50051, generation 50052; metrics on 9100-9102), NUM_BLOCKS (default 4096),
# TOKENS_PER_BLOCK (default 32), LOG_DIR (default ./logs), DEVICE (default cuda:0). Ctrl-C or SIGTERM stops all three
# (by pid) and waits for them to release every page and exit.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-tiny}
DTYPE=${2:-bfloat16}
HOST=${HOST:-127.0.0.1}
BASE_PORT=${BASE_PORT:-50050}
NUM_BLOCKS=${NUM_BLOCKS:-4096}
TOKENS_PER_BLOCK=${TOKENS_PER_BLOCK:-32}
LOG_DIR=${LOG_DIR:-logs}
DEVICE=${DEVICE:-cuda:0}  # DEVICE=cpu runs the same layout without GPUs (a smoke test)
BEAMSPLIT=${BEAMSPLIT:-.venv/bin/beamsplit}
mkdir -p "$LOG_DIR"

COORDINATOR_PORT=$BASE_PORT
CONTEXT_PORT=$((BASE_PORT + 1))
GENERATION_PORT=$((BASE_PORT + 2))
ENGINE_FLAGS=(--model "$MODEL" --dtype "$DTYPE" --device "$DEVICE" --num-blocks "$NUM_BLOCKS"
              --tokens-per-block "$TOKENS_PER_BLOCK" --host "$HOST")

PIDS=()
stop_all() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT INT TERM

# Each worker sees exactly one GPU, which it calls cuda:0.
CUDA_VISIBLE_DEVICES=0 "$BEAMSPLIT" serve context "${ENGINE_FLAGS[@]}" \
  --port "$CONTEXT_PORT" --metrics-port 9101 >"$LOG_DIR/context.log" 2>&1 &
PIDS+=($!)
CUDA_VISIBLE_DEVICES=1 "$BEAMSPLIT" serve generation "${ENGINE_FLAGS[@]}" \
  --port "$GENERATION_PORT" --metrics-port 9102 >"$LOG_DIR/generation.log" 2>&1 &
PIDS+=($!)
# The coordinator waits (bounded) for both workers to describe themselves before it serves.
CUDA_VISIBLE_DEVICES= "$BEAMSPLIT" serve coordinator --host "$HOST" --port "$COORDINATOR_PORT" \
  --metrics-port 9100 --context "$HOST:$CONTEXT_PORT" --generation "$HOST:$GENERATION_PORT" \
  --wait-for-workers-s 600 >"$LOG_DIR/coordinator.log" 2>&1 &
PIDS+=($!)

echo "coordinator $HOST:$COORDINATOR_PORT  context $HOST:$CONTEXT_PORT (GPU 0)  generation $HOST:$GENERATION_PORT (GPU 1)"
echo "logs in $LOG_DIR/; try: $BEAMSPLIT generate --target $HOST:$COORDINATOR_PORT --prompt 'hello' --beam-width 4"
# Exit (and stop the others) as soon as any of the three exits.
wait -n "${PIDS[@]}"
