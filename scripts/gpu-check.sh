#!/usr/bin/env bash
# The GPU check of kvtier's vLLM data path (benchmarks/gpu_check.py): every vLLM CUDA attention layout stored to and
# loaded from a real `kvtier server` bit-exact, GB/s against pinned copies, the compute-stream hold of a load.
#
#   bash scripts/gpu-check.sh --prepare   here, with a package index: kvtier's dependencies that a CUDA machine's
#                                         torch image lacks, as CPython 3.12 x86-64 wheels in .gpucheck/wheels (~10 MB)
#   bash scripts/gpu-check.sh [ARGS]      anywhere with torch (no network, no vLLM): puts those wheels on the path
#                                         (a temporary folder) when the python lacks them, then runs the check;
#                                         ARGS go to benchmarks/gpu_check.py (--quick: small shapes, the CI run on CPU)
#
# Carry .gpucheck with the working tree to a GPU machine (the device tool's `carry`). PYTHON picks the interpreter.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=$ROOT/.gpucheck/wheels
PY=${PYTHON:-python3}
# what `kvtier server` and the client import beyond torch, numpy, click, pyyaml, xxhash, httpx, prometheus_client and
# anyio (present in the CUDA machines' torch image): the versions of kvtier's own environment
DEPS=(msgspec==0.23.0 pyzmq==27.3.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 cbor2==6.3.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
      opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2 starlette==1.10.0
      uvicorn==0.55.0 typing_extensions==4.16.0)

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p "$WHEELS"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "${DEPS[@]}"
    du -sh "$WHEELS"
    exit 0
fi

if ! "$PY" -c "import zmq, msgspec, pydantic, opentelemetry.sdk, starlette, uvicorn" 2>/dev/null; then
    if [ ! -d "$WHEELS" ]; then
        echo "gpu-check: $PY lacks kvtier's dependencies and there is no $WHEELS: run 'bash scripts/gpu-check.sh --prepare' where a package index answers, and carry .gpucheck" >&2
        exit 2
    fi
    SITE=$(mktemp -d)
    trap 'rm -rf "$SITE"' EXIT
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
