#!/usr/bin/env bash
# Start a kvtier server, wait until /healthz answers, and stop it (SIGTERM) when this script exits.
#
#   examples/server.sh                       # 1 GB L1, LRU, local-disk L2 under ./kvtier-l2
#   L1_SIZE_GB=8 L2_PATH=/data/kvtier examples/server.sh -- python my_engine.py
#   KVTIER_SERVER_FLAGS="--enable-kv-events" examples/server.sh   # more `kvtier server` flags (split on spaces)
#
# With a command after "--", it runs that command against the server and stops the server afterwards;
# without one, it keeps the server in the foreground until Ctrl-C.
set -euo pipefail

KVTIER=${KVTIER:-kvtier}
PORT=${PORT:-5555}
ADMIN_PORT=${ADMIN_PORT:-8080}
L1_SIZE_GB=${L1_SIZE_GB:-1}
POLICY=${POLICY:-LRU}
L2_PATH=${L2_PATH:-./kvtier-l2}

$KVTIER server --port "$PORT" --admin-port "$ADMIN_PORT" --l1-size-gb "$L1_SIZE_GB" \
  --eviction-policy "$POLICY" --l2-adapter "{\"type\": \"local_disk\", \"path\": \"$L2_PATH\"}" \
  ${KVTIER_SERVER_FLAGS:-} &
SERVER_PID=$!
stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID" || true
  fi
}
trap stop_server EXIT INT TERM

for _ in $(seq 1 300); do
  if curl -fsS "http://127.0.0.1:$ADMIN_PORT/healthz" >/dev/null 2>&1; then
    break
  fi
  kill -0 "$SERVER_PID" 2>/dev/null || { echo "kvtier server exited during startup" >&2; exit 1; }
  sleep 0.1
done
curl -fsS "http://127.0.0.1:$ADMIN_PORT/healthz" >/dev/null || { echo "kvtier server not healthy after 30 s" >&2; exit 1; }
echo "kvtier server ready: tcp://127.0.0.1:$PORT (admin http://127.0.0.1:$ADMIN_PORT)"

if [[ "${1:-}" == "--" ]]; then
  shift
  "$@"
else
  wait "$SERVER_PID"
fi
