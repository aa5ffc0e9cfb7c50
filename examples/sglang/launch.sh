#!/usr/bin/env bash
# kvtier as SGLang's HiCache storage backend (its L3, behind GPU and host memory) on a GPU host.
# The cache server starts first (shared memory L1, local-disk L2, KV events in SGLang's encoding), then SGLang
# with `--hicache-storage-backend dynamic`; stopping SGLang stops the server.
#
#   MODEL=Qwen/Qwen3-8B examples/sglang/launch.sh             # one SGLang instance on GPU 0
#   MODEL=... PORT=30001 KVTIER_EXTERNAL=1 examples/sglang/launch.sh   # a second instance on the same server
#   DRY_RUN=1 examples/sglang/launch.sh                       # print SGLang's arguments (one per line), run nothing
#
# Settings (environment): MODEL, PORT (SGLang's HTTP port, 30000), PAGE_SIZE (64), HICACHE_RATIO (2: host memory
# per GPU KV cache), KVTIER_PORT (5555), KVTIER_ADMIN_PORT (8080), KVTIER_EVENTS (tcp://127.0.0.1:5557), L1_SIZE_GB
# (kvtier's shared L1, 16), L2_PATH (./kvtier-l2), KVTIER_EXTERNAL=1 (a server is already running: do not start one).
# Needs: pip install "kvtier[server]" next to SGLang (kvtier.connectors.sglang is loaded by SGLang's own process).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=${MODEL:-Qwen/Qwen3-8B}
PORT=${PORT:-30000}
PAGE_SIZE=${PAGE_SIZE:-64}
KVTIER_PORT=${KVTIER_PORT:-5555}
KVTIER_EVENTS=${KVTIER_EVENTS:-tcp://127.0.0.1:5557}

# the backend's extra config: SGLang's keys, then kvtier's (kvtier.<key>, docs/configuration.md)
EXTRA='{"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang", "class_name": "KVTierStorage", '
EXTRA+='"interface_v1": 1, "hicache_storage_pass_prefix_keys": true, '
EXTRA+="\"kvtier.server_url\": \"tcp://127.0.0.1:$KVTIER_PORT\", \"kvtier.timeout_seconds\": 2}"
ARGS=(--model-path "$MODEL" --host 0.0.0.0 --port "$PORT" --page-size "$PAGE_SIZE"
      --enable-hierarchical-cache --hicache-ratio "${HICACHE_RATIO:-2}" --hicache-mem-layout page_first
      --hicache-write-policy write_through --hicache-storage-prefetch-policy timeout
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "$EXTRA")

if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%s\n' "${ARGS[@]}"
  exit 0
fi
if [[ -n "${KVTIER_EXTERNAL:-}" ]]; then
  exec python -m sglang.launch_server "${ARGS[@]}"
fi
PORT=$KVTIER_PORT ADMIN_PORT=${KVTIER_ADMIN_PORT:-8080} L1_SIZE_GB=${L1_SIZE_GB:-16} \
  KVTIER_SERVER_FLAGS="--enable-kv-events --kv-events-encoding sglang --kv-events-endpoint $KVTIER_EVENTS" \
  exec "$ROOT/examples/server.sh" -- python -m sglang.launch_server "${ARGS[@]}"
