"""The SGLang environment for tests and benchmarks: its python, and scripts run with it.

SGLang lives in its own environment (``.venv-sglang``, made by ``scripts/setup-sglang.sh``: sglang 0.5.23 with
torch 2.13.0+cpu); code that imports SGLang runs there in a subprocess and prints one ``RESULT <json>`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"


def require_sglang() -> str:
    """The SGLang environment's python. Raises RuntimeError naming the setup script when it is missing."""
    if not SGLANG_PYTHON.exists():
        raise RuntimeError(f"{SGLANG_PYTHON} is missing: run scripts/setup-sglang.sh first (sglang 0.5.23 environment)")
    return str(SGLANG_PYTHON)


def sglang_env(**extra: str) -> dict:
    """This process's environment for an SGLang subprocess: kvtier and ``harness`` from this checkout first, no
    ``KVTIER_*`` settings leaking in, SGLang's warnings about absent GPU kernels silenced."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra)
    return env


def run_json(argv: list[str], timeout_seconds: float, **env: str) -> list | dict:
    """Run ``argv`` (after the SGLang python) and return the JSON of its last ``RESULT`` line.

    Raises:
        RuntimeError: it failed or printed no result (with the tail of its output).
    """
    proc = subprocess.run([require_sglang(), *argv], env=sglang_env(**env), capture_output=True, text=True,
                          timeout=timeout_seconds, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len("RESULT "):])
