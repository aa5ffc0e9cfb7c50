#!/usr/bin/env bash
# Aggregated serving under NVIDIA Dynamo: a kvtier server, NUM_WORKERS `python -m dynamo.vllm` workers with the
# kvtier connector (kv_both), and `python -m dynamo.frontend --router-mode kv` (OpenAI API on :$HTTP_PORT).
# Ctrl-C (or any exit) stops everything this script started, by pid.
#   examples/dynamo/agg.sh        then: curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
#                                       -d '{"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8}'
# Settings (environment): MODEL, NUM_WORKERS (1), HTTP_PORT (8000), KV_PORT (5555), KV_ADMIN_PORT (8080), LOG_DIR;
# extra arguments go to every dynamo.vllm worker. Needs scripts/setup-vllm.sh and scripts/setup-dynamo.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
start_kvtier
start_frontend
for i in $(seq 1 "${NUM_WORKERS:-1}"); do
    start_worker "worker$i" "$(kvtier_transfer_config kv_both)" "$@"
done
echo "serving on http://127.0.0.1:$HTTP_PORT (kvtier admin: http://127.0.0.1:$KV_ADMIN_PORT/status); Ctrl-C to stop"
wait -n "${PIDS[@]}"
