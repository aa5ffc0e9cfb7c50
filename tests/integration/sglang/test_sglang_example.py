"""``examples/sglang/launch.sh`` cannot rot: its SGLang arguments (``DRY_RUN=1``) are parsed by SGLang 0.5.23's own
``ServerArgs``, and the storage backend they name is loaded by SGLang's factory code and configured by kvtier."""

from __future__ import annotations

import os
import subprocess

from kvtier_harness.sglang import REPO, run_json


def test_the_launch_example_parses_with_sglangs_server_args():
    env = {**os.environ, "DRY_RUN": "1", "MODEL": "org/some-model", "KVTIER_PORT": "6001"}
    argv = subprocess.run([str(REPO / "examples" / "sglang" / "launch.sh")], env=env, capture_output=True, text=True,
                          check=True).stdout.splitlines()
    got = run_json(["tests/integration/sglang/server_args_check.py", *argv], 300)
    assert got == {"backend": "dynamic", "hierarchical": True, "page_size": 64, "layout": "page_first",
                   "write_policy": "write_through", "class": "kvtier.connectors.sglang.KVTierStorage",
                   "is_hicache_storage": True, "interface_v1": 1, "pass_prefix_keys": True,
                   "server_url": "tcp://127.0.0.1:6001", "timeout_seconds": 2.0}
