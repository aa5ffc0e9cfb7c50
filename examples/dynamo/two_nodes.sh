#!/usr/bin/env bash
# Two nodes on one machine under NVIDIA Dynamo: node A and node B, each a kvtier server with its own
# `python -m dynamo.vllm` worker (KVTierConnector, kv_both), and one `python -m dynamo.frontend --router-mode kv`.
# Each worker announces what its node's kvtier server holds (CPU = L1, STORAGE = L2) in its own KV event stream,
# so the router sends a prompt to the node whose kvtier holds it, even after that node's vLLM evicted it.
# With SHARED_L2 (a Redis URL) both servers also share one L2: a prompt stored through A is found by B's server.
# Ctrl-C (or any exit) stops everything this script started, by pid.
#   examples/dynamo/two_nodes.sh                                  # separate nodes, no L2
#   SHARED_L2=redis://127.0.0.1:6379/0 examples/dynamo/two_nodes.sh   # plus a shared Redis L2
#   ROUTER_MODE=round-robin examples/dynamo/two_nodes.sh         # the baseline the benchmark compares with
# Settings (environment): MODEL, HTTP_PORT (8000), node A's ports KV_PORT (5555), KV_ADMIN_PORT (8080),
# KV_EVENTS_PORT (5557), KV_REPLAY_PORT (5558), node B's the same plus 10 (B_OFFSET), L1_SIZE_GB (2), SHARED_L2,
# ROUTER_MODE (kv), LOG_DIR; extra arguments go to both dynamo.vllm workers (e.g. --kv-cache-memory-bytes N).
# $LOG_DIR/worker-ids names each node's worker instance id; $LOG_DIR/metrics-urls its /metrics.
set -euo pipefail
source "$(dirname "$0")/common.sh"
OFF=${B_OFFSET:-10}
if [[ " $* " == *" --kv-cache-memory-bytes "* ]]; then
    unset VLLM_CPU_KVCACHE_SPACE  # vLLM CPU sizes its KV cache from this variable (whole GiB) when it is set
fi
L2_ARGS=()
if [ -n "${SHARED_L2:-}" ]; then
    L2_ARGS=(--l2-adapter "{\"type\":\"redis\",\"url\":\"$SHARED_L2\"}")
fi
start_kvtier_node kvtier-a "$KV_PORT" "$KV_ADMIN_PORT" "$KV_EVENTS_PORT" "$KV_REPLAY_PORT" "${L2_ARGS[@]}"
start_kvtier_node kvtier-b $((KV_PORT + OFF)) $((KV_ADMIN_PORT + OFF)) $((KV_EVENTS_PORT + OFF)) \
    $((KV_REPLAY_PORT + OFF)) "${L2_ARGS[@]}"
start_frontend
start_worker node-a "$(kvtier_transfer_config kv_both KVTierConnector "$KV_PORT" "$KV_EVENTS_PORT" "$KV_REPLAY_PORT")" "$@"
start_worker node-b "$(kvtier_transfer_config kv_both KVTierConnector $((KV_PORT + OFF)) $((KV_EVENTS_PORT + OFF)) \
    $((KV_REPLAY_PORT + OFF)))" "$@"
echo "serving on http://127.0.0.1:$HTTP_PORT (router ${ROUTER_MODE:-kv}; kvtier admin: http://127.0.0.1:$KV_ADMIN_PORT/status" \
     "and http://127.0.0.1:$((KV_ADMIN_PORT + OFF))/status${SHARED_L2:+; shared L2 $SHARED_L2}); Ctrl-C to stop"
wait -n "${PIDS[@]}"
