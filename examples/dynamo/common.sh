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

kvtier_transfer_config() {  # kvtier_transfer_config ROLE [CLASS]: --kv-transfer-config JSON for the kvtier connector
    local role=$1 cls=${2:-KVTierConnector} module=kvtier.connectors.vllm
    [ "$cls" = KVTierConnector ] || module=kvtier.connectors.dynamo_pd
    echo "{\"kv_connector\":\"$cls\",\"kv_connector_module_path\":\"$module\",\"kv_role\":\"$role\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"kvtier.server_url\":\"tcp://127.0.0.1:$KV_PORT\"}}"
}

count_workers() {  # worker instances registered in file discovery (their "generate" endpoints)
    ls "$DYN_FILE_KV/v1/instances" 2>/dev/null | grep -c '%2Fgenerate%2F' || true
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
    echo "$name ready (pid $pid)"
}

start_frontend() {  # start_frontend [extra dynamo.frontend args...]: OpenAI API on 127.0.0.1:$HTTP_PORT with the KV router
    "$DYNAMO_PY" -m dynamo.frontend "${PLANES[@]}" --router-mode kv --http-host 127.0.0.1 --http-port "$HTTP_PORT" \
        "$@" >"$LOG_DIR/frontend.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$HTTP_PORT/health" frontend "$!"
}
