# Shared by agg.sh and disagg.sh: Dynamo settings on top of examples/vllm/common.sh (kvtier server, cleanup by
# pid with SIGKILL after 30 s, wait_http). Source it, do not run it. No etcd, NATS or GPU: file discovery
# (DYN_FILE_KV), TCP request plane, ZMQ event plane; listeners on 127.0.0.1 or ipc:// (except Dynamo's own
# event-plane PUB, which 1.6.1 binds on 0.0.0.0 while advertising 127.0.0.1).
LOG_DIR=${LOG_DIR:-$(mktemp -d -t kvtier-dynamo-XXXX)}
source "$(dirname "${BASH_SOURCE[0]}")/../vllm/common.sh"
DYNAMO_PY=${DYNAMO_PYTHON:-$ROOT/.venv-dynamo/bin/python}     # made by scripts/setup-dynamo.sh
HTTP_PORT=${HTTP_PORT:-8000}
for py in "$VLLM_PY" "$DYNAMO_PY"; do
    [ -x "$py" ] || { echo "$py is missing: run scripts/setup-vllm.sh and scripts/setup-dynamo.sh" >&2; exit 1; }
done
export DYN_FILE_KV=${DYN_FILE_KV:-$LOG_DIR/discovery}        # every Dynamo process must read the same folder
export DYN_EVENT_PLANE_HOST=127.0.0.1 DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1
export DYN_SYSTEM_HOST=127.0.0.1 DYN_HTTP_HOST=127.0.0.1 VLLM_HOST_IP=127.0.0.1 GLOO_SOCKET_IFNAME=lo
PLANES=(--discovery-backend file --request-plane tcp --event-plane zmq)
mkdir -p "$DYN_FILE_KV"
# CPU-only machines: scripts/dynamo-cpu makes `python -m dynamo.vllm` importable (see the comments there);
# with a CUDA torch (a GPU machine) it stays off the path.
if "$VLLM_PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null; then
    export PYTHONPATH="$ROOT/scripts/dynamo-cpu${PYTHONPATH:+:$PYTHONPATH}"
fi

# The kvtier server publishes KV events for what it holds (per vLLM block, vLLM's hashes); each worker's connector
# subscribes (kvtier.server_events, with replay) and announces those chunks in the worker's own KV event stream,
# the one stream per worker that Dynamo's router reads (docs/deployment.md, "What the router sees").
KV_EVENTS_PORT=${KV_EVENTS_PORT:-5557}
KV_REPLAY_PORT=${KV_REPLAY_PORT:-5558}

# `python -m dynamo.vllm` sets PYTHONHASHSEED=0 when it is unset, and vLLM seeds its block hashes with it: the
# server must hash with the same seed (the connector refuses a server that does not)
HASH_SEED=${PYTHONHASHSEED:-0}

start_kvtier_node() {  # start_kvtier_node NAME KV_PORT ADMIN_PORT EVENTS_PORT REPLAY_PORT [extra kvtier server args]
    local name=$1 port=$2 admin=$3 events=$4 replay=$5; shift 5
    "$KVTIER_PY" -m kvtier server --port "$port" --admin-port "$admin" --l1-size-gb "${L1_SIZE_GB:-2}" \
        --eviction-policy LRU --chunk-size "$CHUNK_SIZE" --block-size "$BLOCK_SIZE" --hash-seed "$HASH_SEED" --enable-kv-events \
        --kv-events-endpoint "tcp://127.0.0.1:$events" --kv-events-replay-endpoint "tcp://127.0.0.1:$replay" \
        "$@" >"$LOG_DIR/$name.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$admin/healthz" "$name" "$!"
}

start_kvtier() {  # the single kvtier server of agg.sh and disagg.sh, with its KV events
    start_kvtier_node kvtier "$KV_PORT" "$KV_ADMIN_PORT" "$KV_EVENTS_PORT" "$KV_REPLAY_PORT"
}

# kvtier_transfer_config ROLE [CLASS [KV_PORT EVENTS_PORT REPLAY_PORT]]: --kv-transfer-config JSON for the kvtier
# connector of the server on those ports (default: the single server of start_kvtier)
kvtier_transfer_config() {
    local role=$1 cls=${2:-KVTierConnector} module=kvtier.connectors.vllm
    local port=${3:-$KV_PORT} events=${4:-$KV_EVENTS_PORT} replay=${5:-$KV_REPLAY_PORT}
    [ "$cls" = KVTierConnector ] || module=kvtier.connectors.dynamo_pd
    local extra="\"kvtier.server_url\":\"tcp://127.0.0.1:$port\",\"kvtier.server_events\":\"tcp://127.0.0.1:$events\",\"kvtier.server_events_replay\":\"tcp://127.0.0.1:$replay\""
    echo "{\"kv_connector\":\"$cls\",\"kv_connector_module_path\":\"$module\",\"kv_role\":\"$role\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{$extra}}"
}

count_workers() {  # worker instances registered in file discovery (their "generate" endpoints)
    ls "$DYN_FILE_KV/v1/instances" 2>/dev/null | grep -c '%2Fgenerate%2F' || true
}

worker_ids() {  # instance ids of the registered workers, one a line
    "$KVTIER_PY" -c "
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob('*%2Fgenerate%2F*')):
    print(json.loads(p.read_text())['instance_id'])" "$DYN_FILE_KV/v1/instances"
}

start_worker() {  # start_worker NAME TRANSFER_CONFIG [extra dynamo.vllm args...]: a dynamo.vllm worker, until registered
    local name=$1 cfg=$2; shift 2
    # vLLM publishes its own KV events on an ipc socket; the worker relays them to the router
    local events="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"ipc://$LOG_DIR/$name-kv-events\"}"
    # its system port serves /metrics (vLLM's own TTFT histogram per worker: check.py --metrics); Dynamo 1.6.1
    # parses DYN_SYSTEM_PORT as a signed 16-bit number, so it must be below 32768 (OS-assigned ones are not)
    local system_port
    system_port=$("$KVTIER_PY" -c "
import random, socket
for port in random.sample(range(20000, 32768), 200):
    with socket.socket() as s:
        try:
            s.bind(('127.0.0.1', port))
        except OSError:
            continue
        print(port)
        break")
    echo "$name=http://127.0.0.1:$system_port/metrics" >>"$LOG_DIR/metrics-urls"
    DYN_SYSTEM_PORT=$system_port "$VLLM_PY" -m dynamo.vllm --model "$MODEL" --served-model-name smollm2 "${PLANES[@]}" --dtype "${DTYPE:-float32}" \
        --enforce-eager --max-model-len 4096 --enable-prefix-caching --kv-events-config "$events" \
        --kv-transfer-config "$cfg" "$@" >"$LOG_DIR/$name.log" 2>&1 &
    PIDS+=($!)
    local pid=$! want=$(( $(count_workers) + 1 ))
    for _ in $(seq 1 600); do
        if ! kill -0 "$pid" 2>/dev/null; then echo "$name exited; see $LOG_DIR/$name.log" >&2; tail -n 20 "$LOG_DIR/$name.log" >&2; exit 1; fi
        [ "$(count_workers)" -ge "$want" ] && break
        sleep 0.5
    done
    [ "$(count_workers)" -ge "$want" ] || { echo "$name did not register in 300 s" >&2; exit 1; }
    local id
    id=$(worker_ids | grep -vxF -f <(cut -sd= -f2 "$LOG_DIR/worker-ids" 2>/dev/null) | head -n 1 || true)
    echo "$name=$id" >>"$LOG_DIR/worker-ids"  # the instance id the frontend reports (nvext worker_id)
    echo "$name ready (pid $pid, instance $id)"
}

start_frontend() {  # start_frontend [extra dynamo.frontend args...]: OpenAI API on 127.0.0.1:$HTTP_PORT, $ROUTER_MODE router
    "$DYNAMO_PY" -m dynamo.frontend "${PLANES[@]}" --router-mode "${ROUTER_MODE:-kv}" --http-host 127.0.0.1 --http-port "$HTTP_PORT" \
        "$@" >"$LOG_DIR/frontend.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$HTTP_PORT/health" frontend "$!"
}
