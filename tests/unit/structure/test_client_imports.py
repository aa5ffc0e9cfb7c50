"""The engine-side client is its own package: importing it loads no server, storage-tier, event or admin code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvtier

FORBIDDEN = ("kvtier.server", "kvtier.l1", "kvtier.l2", "kvtier.cache", "kvtier.events", "opentelemetry", "starlette")

PROBE = """
import json, sys
import kvtier.client
from kvtier.client import Client, KVBackend, Retrieved
from kvtier.client.dataplane import SharedMapping, attach_arena, prefault
from kvtier.proc import host_id
print(json.dumps(sorted(sys.modules)))
"""


def test_import_kvtier_client_loads_no_server_or_storage_code():
    src = Path(kvtier.__file__).resolve().parents[1]  # the kvtier under test (a worktree's src, or the install)
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    modules = json.loads(out.stdout)
    assert "kvtier.client.client" in modules and "kvtier.protocol" in modules  # the probe imported what it says
    loaded = [m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert loaded == [], f"import kvtier.client loaded {loaded}"
