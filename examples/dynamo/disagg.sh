#!/usr/bin/env bash
# Disaggregated serving under NVIDIA Dynamo: a kvtier server, a prefill worker and a decode worker
# (`python -m dynamo.vllm --disaggregation-mode prefill|decode`) and `python -m dynamo.frontend --router-mode kv`.
# The frontend sends each request to the prefill worker (one token), which computes the prompt and stores its
# chunks in kvtier; then to the decode worker, which loads the prompt's KV from kvtier and decodes.
# Ctrl-C (or any exit) stops everything this script started, by pid.
#
# Connector name: Dynamo's prefill worker accepts only connector names it has a PD protocol for, so both
# workers load kvtier's connector as "LMCacheMPConnector" from kvtier.connectors.dynamo_pd, which selects
# Dynamo's cache-mediated protocol (no per-request transfer parameters: KV moves through the kvtier server).
# The module's docstring says why this is the clean way through.
# Roles: the prefill worker is kv_both (it also loads a prefix kvtier already holds), the decode worker
# kv_consumer (it only loads).
# Settings (environment): as agg.sh; extra arguments go to both workers.
set -euo pipefail
source "$(dirname "$0")/common.sh"
start_kvtier
start_frontend
start_worker prefill "$(kvtier_transfer_config kv_both LMCacheMPConnector)" --disaggregation-mode prefill "$@"
start_worker decode "$(kvtier_transfer_config kv_consumer LMCacheMPConnector)" --disaggregation-mode decode "$@"
echo "serving on http://127.0.0.1:$HTTP_PORT (prefill and decode workers; kvtier admin: http://127.0.0.1:$KV_ADMIN_PORT/status); Ctrl-C to stop"
wait -n "${PIDS[@]}"
