#!/usr/bin/env bash
# Make the SGLang environment for kvtier's SGLang storage backend: .venv-sglang with sglang 0.5.23 installed
# --no-deps, torch 2.13.0 (the CPU build: never let SGLang's torch==2.14.1 pin pull the CUDA one), the light
# modules SGLang's storage, host-pool, cache-controller and server-args modules import, and kvtier editable.
# Idempotent: re-running only repairs what is missing.
# Why --no-deps: `pip install sglang` resolves a CUDA torch and ~200 packages (flashinfer, sgl-kernel, ...). The
# engine cannot run on a CPU machine anyway (PyPI has no CPU sgl-kernel); its storage layer can. triton (CPU-
# installable, no torch requirement) is imported by sglang.srt.utils at module level. torchvision does not load
# against torch 2.13 and is imported at module level by sglang/srt/multimodal/internvl_utils.py (through
# sglang.srt.configs): scripts/sglang-cpu holds an import-only stand-in, put on this environment's sys.path by a
# .pth file (this environment only; a GPU host uses the real torchvision).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${SGLANG_VENV:-$ROOT/.venv-sglang}
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)
# what the modules above import beyond kvtier's own requirements, at SGLang 0.5.23's pins where it pins them
DEPS=("orjson" "psutil" "pybase64" "requests" "packaging" "pillow" "tqdm" "starlette" "ipython" "aiohttp" "dill"
      "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" "gguf" "transformers==5.19.0"
      "tokenizers==0.23.2" "triton")
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"   # every install below keeps the CPU torch, or fails

[ -x "$PY" ] || python3 -m venv "$VENV"
version_of() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
[ "$(version_of torch)" = "2.13.0+cpu" ] || "${PIP[@]}" torch==2.13.0
[ "$(version_of sglang)" = "0.5.23" ] || "${PIP[@]}" --no-deps sglang==0.5.23
STAMP="$VENV/.kvtier-sglang-deps"  # the DEPS last installed: a changed list installs again
if [ "$(cat "$STAMP" 2>/dev/null)" != "${DEPS[*]}" ]; then
    # pip lists every SGLang requirement left out on purpose (the GPU stack): not errors here
    "${PIP[@]}" -c "$CONSTRAINTS" "${DEPS[@]}" 2>&1 | grep -vE "^sglang 0.5.23 requires|dependency resolver|^WARNING: Location" || true
    echo "${DEPS[*]}" > "$STAMP"
fi
if "$PY" -m pip show torchvision >/dev/null 2>&1; then "$PY" -m pip uninstall -q -y torchvision; fi
if [ -z "$(version_of kvtier)" ]; then
    "${PIP[@]}" -c "$CONSTRAINTS" -e "$ROOT" 2>&1 | grep -vE "^sglang 0.5.23 requires|dependency resolver|^WARNING: Location" || true
fi
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$ROOT/scripts/sglang-cpu" > "$SITE/kvtier-sglang-cpu.pth"
[ "$(version_of torch)" = "2.13.0+cpu" ] || { echo "setup-sglang: torch is $(version_of torch), not 2.13.0+cpu" >&2; exit 1; }
"$PY" -W ignore -c "
import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory
import sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.pool_host.mla, sglang.srt.managers.cache_controller
import sglang.srt.server_args, torch, kvtier.connectors.sglang
print('ok: .venv-sglang: sglang', sglang.__version__, 'torch', torch.__version__)" 2>&1 | grep -v -i "warn"
