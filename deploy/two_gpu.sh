#!/usr/bin/env bash
# The two-GPU layout on one host: the context worker on GPU 0 (--device cuda:0), the generation
# worker on GPU 1 (--device cuda:1), the coordinator (CPU only) in front of them. KV pages move
# GPU to GPU over UCX (cuda_ipc: both processes see both GPUs, each uses its own).
#
#   deploy/two_gpu.sh [MODEL] [DTYPE]      e.g. deploy/two_gpu.sh /models/llama-3.2-1b bfloat16
#   DEVICE=cpu deploy/two_gpu.sh           the same layout without GPUs (the CI smoke test)
#
# It starts the three servers, waits (bounded) until each says it is serving, prints where to
# send requests, and runs until Ctrl-C (or SIGTERM): then it stops them all by pid (coordinator
# first, SIGTERM, each drains and releases every page), escalates to SIGKILL after STOP_TIMEOUT_S,
# prints each worker's "blocks in use at exit" and exits 0 when every server exited 0. If any
# server exits by itself, it stops the others and exits 1 with that server's log tail.
#
# Environment (defaults in brackets):
#   DEVICE            cuda: workers on cuda:$CONTEXT_GPU and cuda:$GENERATION_GPU; cpu: both on cpu [cuda]
#   CONTEXT_GPU, GENERATION_GPU   GPU indices [0, 1]
#   HOST              bind address of every server [127.0.0.1]
#   BASE_PORT         coordinator BASE_PORT, context +1, generation +2 [50050]
#   COORDINATOR_PORT, CONTEXT_PORT, GENERATION_PORT           override one port each
#   METRICS_BASE_PORT /metrics of coordinator, context, generation on +0, +1, +2 [9100]
#   HTTP_PORT         the coordinator's OpenAI-compatible HTTP front (/v1/completions, /health,
#                     /tokenize, /metrics ...); 0: none [8000]
#   AGGREGATED_PORT   when set, also start an aggregated server (the parity reference) on that
#                     port, on the context worker's device, metrics on METRICS_BASE_PORT + 3
#   KV pool per engine, one of (sized from memory, never a fixed block count by default):
#     KV_CACHE_FRACTION  of the device's free memory at start, weights included [0.7 on GPUs;
#                        0.35 each for the context worker and the aggregated server sharing GPU 0]
#     KV_CACHE_GIB       a budget in GiB [1 on cpu, where the engines share the host's memory]
#     NUM_BLOCKS         exactly this many blocks
#   Each engine's "serving on" line says the blocks and bytes it chose.
#   TOKENS_PER_BLOCK [32]  LOG_DIR [./logs]
#   READY_TIMEOUT_S   bound on waiting for all to serve (model loading included) [600]
#   STOP_TIMEOUT_S    bound on each server's drain after SIGTERM before SIGKILL [30]
#   BEAMSPLIT         the command to run [.venv/bin/beamsplit, else beamsplit on PATH];
#                     may hold words, e.g. "python -m beamsplit.cli"
#   UCX_TLS           on GPUs [cuda_ipc,cuda_copy,sm,tcp,self]: GPU-to-GPU on one host, tcp for
#                     the control path; unset on cpu (UCX picks); UCX_PROTO_INFO [y] logs the
#                     protocols UCX picked, so the logs show whether pages went over cuda_ipc
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
if [[ $DEVICE == cpu ]]; then
  CONTEXT_DEVICE=cpu GENERATION_DEVICE=cpu DEFAULT_DTYPE=float32
else
  CONTEXT_DEVICE=cuda:${CONTEXT_GPU:-0} GENERATION_DEVICE=cuda:${GENERATION_GPU:-1} DEFAULT_DTYPE=bfloat16
  export UCX_TLS=${UCX_TLS:-cuda_ipc,cuda_copy,sm,tcp,self}
fi
export UCX_PROTO_INFO=${UCX_PROTO_INFO:-y}
MODEL=${1:-tiny}
DTYPE=${2:-$DEFAULT_DTYPE}
HOST=${HOST:-127.0.0.1}
BASE_PORT=${BASE_PORT:-50050}
COORDINATOR_PORT=${COORDINATOR_PORT:-$BASE_PORT}
CONTEXT_PORT=${CONTEXT_PORT:-$((BASE_PORT + 1))}
GENERATION_PORT=${GENERATION_PORT:-$((BASE_PORT + 2))}
METRICS_BASE_PORT=${METRICS_BASE_PORT:-9100}
AGGREGATED_PORT=${AGGREGATED_PORT:-}
HTTP_PORT=${HTTP_PORT:-8000}
NUM_BLOCKS=${NUM_BLOCKS:-}
KV_CACHE_GIB=${KV_CACHE_GIB:-}
KV_CACHE_FRACTION=${KV_CACHE_FRACTION:-}
TOKENS_PER_BLOCK=${TOKENS_PER_BLOCK:-32}
LOG_DIR=${LOG_DIR:-logs}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-600}
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-30}
if [[ -z ${BEAMSPLIT:-} ]]; then
  if [[ -x .venv/bin/beamsplit ]]; then BEAMSPLIT=.venv/bin/beamsplit; else BEAMSPLIT=beamsplit; fi
fi
read -r -a BEAMSPLIT_CMD <<<"$BEAMSPLIT"
mkdir -p "$LOG_DIR"

# How each engine sizes its KV pool; the context worker and an aggregated server share GPU 0.
if [[ -n $NUM_BLOCKS ]]; then
  POOL_FLAGS=(--num-blocks "$NUM_BLOCKS") SHARED_POOL_FLAGS=(--num-blocks "$NUM_BLOCKS")
elif [[ -n $KV_CACHE_GIB ]]; then
  POOL_FLAGS=(--kv-cache-gib "$KV_CACHE_GIB") SHARED_POOL_FLAGS=(--kv-cache-gib "$KV_CACHE_GIB")
elif [[ -n $KV_CACHE_FRACTION ]]; then
  POOL_FLAGS=(--kv-cache-fraction "$KV_CACHE_FRACTION") SHARED_POOL_FLAGS=(--kv-cache-fraction "$KV_CACHE_FRACTION")
elif [[ $DEVICE == cpu ]]; then
  POOL_FLAGS=(--kv-cache-gib 1) SHARED_POOL_FLAGS=(--kv-cache-gib 1)
else
  POOL_FLAGS=(--kv-cache-fraction 0.7) SHARED_POOL_FLAGS=(--kv-cache-fraction 0.7)
  [[ -z $AGGREGATED_PORT ]] || SHARED_POOL_FLAGS=(--kv-cache-fraction 0.35)
fi
ENGINE_FLAGS=(--model "$MODEL" --dtype "$DTYPE" --tokens-per-block "$TOKENS_PER_BLOCK" --host "$HOST")
# On cpu both workers compute on this host's cores: the thread layout for sharing them.
WORKER_FLAGS=()
[[ $DEVICE != cpu ]] || WORKER_FLAGS=(--shares-cores)

NAMES=()   # parallel arrays: server name, pid
PIDS=()
start() {  # start NAME ARGS...: one server in the background, its output in $LOG_DIR/NAME.log
  local name=$1
  shift
  "${BEAMSPLIT_CMD[@]}" serve "$@" >"$LOG_DIR/$name.log" 2>&1 &
  NAMES+=("$name")
  PIDS+=($!)
}

is_running() { kill -0 "$1" 2>/dev/null; }

STOP_CODE=0
stop_one() {  # stop_one INDEX: SIGTERM, bounded wait, then SIGKILL; the exit code in STOP_CODE
  local pid=${PIDS[$1]} waited=0
  STOP_CODE=0
  kill -TERM "$pid" 2>/dev/null || true
  while is_running "$pid" && ((waited < STOP_TIMEOUT_S * 10)); do
    sleep 0.1
    waited=$((waited + 1))
  done
  if is_running "$pid"; then
    echo "${NAMES[$1]} did not exit within ${STOP_TIMEOUT_S}s of SIGTERM: SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || STOP_CODE=$?
}

STOPPED=0
stop_all() {  # coordinator first (no new requests), then the workers; returns 1 on any unclean exit
  ((STOPPED)) && return 0
  STOPPED=1
  trap '' INT TERM
  local index held status=0 order=()
  for index in "${!NAMES[@]}"; do [[ ${NAMES[$index]} == coordinator ]] && order+=("$index"); done
  for index in "${!NAMES[@]}"; do [[ ${NAMES[$index]} != coordinator ]] && order+=("$index"); done
  for index in "${order[@]}"; do
    stop_one "$index"
    held=$(grep -ho 'blocks in use at exit: [0-9]*' "$LOG_DIR/${NAMES[$index]}.log" | tail -n 1 || true)
    echo "${NAMES[$index]}: exit $STOP_CODE${held:+, $held}"
    [[ $STOP_CODE == 0 ]] || status=1
  done
  return "$status"
}

on_signal() {
  echo
  echo "stopping (pids ${PIDS[*]})"
  if stop_all; then exit 0; else exit 1; fi
}
trap on_signal INT TERM
trap 'stop_all >/dev/null || true' EXIT

fail() {  # fail NAME MESSAGE: the server's log tail, stop everything, exit 1
  echo "$2; last lines of $LOG_DIR/$1.log:" >&2
  tail -n 20 "$LOG_DIR/$1.log" >&2 || true
  stop_all || true
  exit 1
}

start context context "${ENGINE_FLAGS[@]}" "${SHARED_POOL_FLAGS[@]}" "${WORKER_FLAGS[@]}" \
  --device "$CONTEXT_DEVICE" --port "$CONTEXT_PORT" --metrics-port "$((METRICS_BASE_PORT + 1))"
start generation generation "${ENGINE_FLAGS[@]}" "${POOL_FLAGS[@]}" "${WORKER_FLAGS[@]}" \
  --device "$GENERATION_DEVICE" --port "$GENERATION_PORT" --metrics-port "$((METRICS_BASE_PORT + 2))"
# The coordinator waits (bounded) for both workers to describe themselves before it serves.
CUDA_VISIBLE_DEVICES= start coordinator coordinator --host "$HOST" --port "$COORDINATOR_PORT" \
  --metrics-port "$METRICS_BASE_PORT" --context "$HOST:$CONTEXT_PORT" \
  --generation "$HOST:$GENERATION_PORT" --wait-for-workers-s "$READY_TIMEOUT_S" --http-port "$HTTP_PORT"
if [[ -n $AGGREGATED_PORT ]]; then
  start aggregated aggregated "${ENGINE_FLAGS[@]}" "${SHARED_POOL_FLAGS[@]}" --device "$CONTEXT_DEVICE" \
    --port "$AGGREGATED_PORT" --metrics-port "$((METRICS_BASE_PORT + 3))"
fi

# Ready: every server prints "[ROLE] serving on ..." once its gRPC health service says SERVING.
deadline=$((SECONDS + READY_TIMEOUT_S))
for index in "${!NAMES[@]}"; do
  name=${NAMES[$index]}
  until grep -q "^\[$name\] serving on" "$LOG_DIR/$name.log" 2>/dev/null; do
    is_running "${PIDS[$index]}" || fail "$name" "$name exited while starting"
    ((SECONDS < deadline)) || fail "$name" "$name not serving within ${READY_TIMEOUT_S}s"
    sleep 0.2
  done
done

echo "beamsplit is serving: send requests to the coordinator at $HOST:$COORDINATOR_PORT (gRPC)"
echo "  context worker    $HOST:$CONTEXT_PORT on $CONTEXT_DEVICE, metrics http://$HOST:$((METRICS_BASE_PORT + 1))/metrics"
echo "  generation worker $HOST:$GENERATION_PORT on $GENERATION_DEVICE, metrics http://$HOST:$((METRICS_BASE_PORT + 2))/metrics"
echo "  coordinator       $HOST:$COORDINATOR_PORT, metrics http://$HOST:$METRICS_BASE_PORT/metrics"
if [[ $HTTP_PORT != 0 ]]; then
  echo "  HTTP front        http://$HOST:$HTTP_PORT/v1 (OpenAI API; /health, /tokenize, /metrics on the same port)"
fi
for name in context generation aggregated; do
  pool=$(grep -ho 'KV pool .*' "$LOG_DIR/$name.log" 2>/dev/null | tail -n 1 || true)
  [[ -z $pool ]] || echo "  $name: $pool"
done
[[ -z $AGGREGATED_PORT ]] || echo "  aggregated (reference) $HOST:$AGGREGATED_PORT on $CONTEXT_DEVICE"
echo "  try: ${BEAMSPLIT_CMD[*]} generate --target $HOST:$COORDINATOR_PORT --prompt 'hello' --beam-width 4"
pids=()
for index in "${!NAMES[@]}"; do pids+=("${NAMES[$index]}=${PIDS[$index]}"); done
echo "  logs in $LOG_DIR/; pids ${pids[*]}; Ctrl-C stops all"

# Run until a signal (the trap stops all) or until any server exits by itself.
while true; do
  for index in "${!NAMES[@]}"; do
    is_running "${PIDS[$index]}" || fail "${NAMES[$index]}" "${NAMES[$index]} exited unexpectedly"
  done
  sleep 1 &
  wait $! || true
done
