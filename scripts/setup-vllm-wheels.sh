#!/usr/bin/env bash
# The Python sources of the CUDA vLLM wheels kvtier's connector is checked against (0.33.0 and 0.34.0), for the tests
# that read their attention layouts and connector contract (tests/integration/vllm/test_cuda_wheels.py).
# Each wheel is downloaded once with --no-deps (never installed: it pins a CUDA torch), only its vllm/**/*.py files
# are kept under .cache/vllm-wheels/<version>/ (about 60 MB each; the 240-340 MB wheel is deleted), and a version
# already there is left alone. Idempotent.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=$ROOT/.cache/vllm-wheels  # tests/support/vllm_wheels.py reads them there
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
for version in 0.33.0 0.34.0; do
    [ -f "$DEST/$version/.complete" ] && continue
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$tmp" "vllm==$version"
    rm -rf "$DEST/$version"
    mkdir -p "$DEST/$version"
    "$PY" - "$tmp" "$DEST/$version" <<'EOF'
import sys, zipfile
from pathlib import Path
wheel = next(Path(sys.argv[1]).glob("vllm-*.whl"))
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
EOF
    rm -rf "$tmp"
    trap - EXIT
    touch "$DEST/$version/.complete"
    echo "setup-vllm-wheels: vllm $version sources in $DEST/$version"
done
