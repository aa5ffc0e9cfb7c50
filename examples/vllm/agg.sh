#!/usr/bin/env bash
# Aggregated serving: a kvtier server and one vLLM OpenAI server that both stores and loads (kv_both).
# Ctrl-C (or any exit) stops everything this script started, by pid.
#   examples/vllm/agg.sh            then: curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
#                                         -d '{"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8}'
# Settings (environment): MODEL, CHUNK_SIZE (256), KV_PORT (5555), KV_ADMIN_PORT (8080), VLLM_PORT (8000), LOG_DIR.
set -euo pipefail
source "$(dirname "$0")/common.sh"
start_kvtier
start_vllm vllm "${VLLM_PORT:-8000}" kv_both "$@"
echo "serving on http://127.0.0.1:${VLLM_PORT:-8000} (kvtier admin: http://127.0.0.1:$KV_ADMIN_PORT/status); Ctrl-C to stop"
wait -n "${PIDS[@]}"   # returns when any of them exits; the EXIT trap stops the rest
