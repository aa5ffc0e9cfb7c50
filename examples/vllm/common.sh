# Shared by agg.sh and disagg.sh: settings, process bookkeeping and cleanup. Source it, do not run it.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VLLM_PY=${VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}          # made by scripts/setup-vllm.sh
KVTIER_PY=${SERVER_PYTHON:-$ROOT/.venv/bin/python}
[ -x "$KVTIER_PY" ] || KVTIER_PY=$VLLM_PY
MODEL=${MODEL:-$HOME/.cache/kvtier/models/smollm2-135m-instruct}
CHUNK_SIZE=${CHUNK_SIZE:-256}
BLOCK_SIZE=${BLOCK_SIZE:-128}  # vLLM's block size: 128 on vLLM CPU, 16 on GPU (the connector checks it at startup)
KV_PORT=${KV_PORT:-5555}
KV_ADMIN_PORT=${KV_ADMIN_PORT:-8080}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t kvtier-vllm-XXXX)}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# (no KVTIER_* names here: the kvtier server reads KVTIER_* variables as its configuration)
# vLLM CPU reserves one more core when a KV connector is set; pin it so runs with and without kvtier compare
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-1}

PIDS=()
cleanup() {  # SIGTERM everything started here (servers finish in-flight work), SIGKILL what is left after 30 s
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for _ in $(seq 60); do
        local alive=0
        for pid in "${PIDS[@]}"; do if kill -0 "$pid" 2>/dev/null; then alive=1; fi; done
        [ "$alive" = 0 ] && break
        sleep 0.5
    done
    for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
    echo "stopped: ${PIDS[*]} (logs in $LOG_DIR)"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_http() {  # wait_http URL NAME PID: until URL answers 200, or fail when PID exits
    local url=$1 name=$2 pid=$3
    for _ in $(seq 1 600); do
        if ! kill -0 "$pid" 2>/dev/null; then echo "$name exited; see $LOG_DIR/$name.log" >&2; tail -n 20 "$LOG_DIR/$name.log" >&2; exit 1; fi
        if curl -sf -o /dev/null "$url"; then echo "$name ready ($url)"; return 0; fi
        sleep 0.5
    done
    echo "$name not ready after 300 s" >&2; exit 1
}

start_kvtier() {
    "$KVTIER_PY" -m kvtier server --port "$KV_PORT" --admin-port "$KV_ADMIN_PORT" --l1-size-gb "${L1_SIZE_GB:-2}" \
        --eviction-policy LRU --chunk-size "$CHUNK_SIZE" --block-size "$BLOCK_SIZE" >"$LOG_DIR/kvtier.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$KV_ADMIN_PORT/healthz" kvtier "$!"
}

start_vllm() {  # start_vllm NAME PORT ROLE [extra vLLM args...]
    local name=$1 port=$2 role=$3; shift 3
    local cfg="{\"kv_connector\":\"KVTierConnector\",\"kv_connector_module_path\":\"kvtier.connectors.vllm\",\"kv_role\":\"$role\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"kvtier.server_url\":\"tcp://127.0.0.1:$KV_PORT\"}}"
    "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2 \
        --host 127.0.0.1 --port "$port" --dtype "${DTYPE:-float32}" --enforce-eager --max-model-len 4096 \
        --enable-prompt-tokens-details --kv-transfer-config "$cfg" "$@" >"$LOG_DIR/$name.log" 2>&1 &
    PIDS+=($!)
    wait_http "http://127.0.0.1:$port/v1/models" "$name" "$!"
}
