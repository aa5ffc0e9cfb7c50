#!/usr/bin/env bash
# Set up and run the main job: multi-round QA over a real document with SmolLM2 on CPU, cold vs warm vs a second process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2  # stdout is the demo's alone, so `--json` output is parseable
exec .venv/bin/kvtier demo "$@"
