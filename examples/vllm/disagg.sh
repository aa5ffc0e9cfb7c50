#!/usr/bin/env bash
# Disaggregated prefill: a kvtier server, a prefill vLLM (kv_producer), a decode vLLM (kv_consumer) and the proxy.
# The proxy sends each request to the prefill instance with max_tokens=1, then to the decode instance, which
# loads the prompt's KV from kvtier. Ctrl-C (or any exit) stops everything this script started, by pid.
# Settings (environment): as agg.sh, plus PREFILL_PORT (8100), DECODE_PORT (8200), PROXY_PORT (8000).
set -euo pipefail
source "$(dirname "$0")/common.sh"
PREFILL_PORT=${PREFILL_PORT:-8100}; DECODE_PORT=${DECODE_PORT:-8200}; PROXY_PORT=${PROXY_PORT:-8000}
start_kvtier
start_vllm prefill "$PREFILL_PORT" kv_producer "$@"
start_vllm decode "$DECODE_PORT" kv_consumer "$@"
"$VLLM_PY" "$ROOT/examples/vllm/proxy.py" --prefill "http://127.0.0.1:$PREFILL_PORT" \
    --decode "http://127.0.0.1:$DECODE_PORT" --port "$PROXY_PORT" >"$LOG_DIR/proxy.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$PROXY_PORT/health" proxy "$!"
echo "serving on http://127.0.0.1:$PROXY_PORT (prefill :$PREFILL_PORT, decode :$DECODE_PORT); Ctrl-C to stop"
wait -n "${PIDS[@]}"
