#!/usr/bin/env bash
# Set up and run the main job: multi-round QA over a real document with SmolLM2 on CPU, cold vs warm vs a second process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvtier demo "$@"
