"""The two ``KVBackend`` implementations, opened the way an engine opens them, for ``test_backend_contract.py``:

* ``in_process``: a ``KVCache`` with L1 and a local_disk L2 in ``tmp_path``;
* ``server_shm``: a ``Client`` of a real ``kvtier server`` (local_disk L2, free 127.0.0.1 ports), KV through
  the server's shared-memory L1;
* ``server_frames``: the same server, KV bytes as ZMQ frames (``shared_memory=False``).

One server serves the whole module (started once, stopped by pid); each test starts from an empty cache.
"""

from __future__ import annotations

import json

import pytest
from support.server import CHUNK, LAYOUT, ServerProc

from kvtier.cache import KVCache
from kvtier.client import Client
from kvtier.config import build_config

BACKENDS = ["in_process", "server_shm", "server_frames"]
ADMIN_TOKEN = "backend-contract-admin"  # clear is a mutation: the server requires its admin token


@pytest.fixture(scope="module")
def kvtier_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("backend-server")
    disk = {"type": "local_disk", "path": str(work / "l2")}
    with ServerProc(work, token=ADMIN_TOKEN, extra=("--l2-adapter", json.dumps(disk))) as server:
        yield server
    assert server.proc.returncode == 0, server.log()


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    """A fresh, empty backend for (model "m", ``LAYOUT``, chunk size ``CHUNK``); closed after the test."""
    if request.param == "in_process":
        config = build_config({"chunk_size": CHUNK, "l1_size_gb": "64MB",
                               "l2_adapters": [{"type": "local_disk", "path": str(tmp_path / "l2")}]})
        cache = KVCache(config, "m", LAYOUT, publish_events=False)
    else:
        server = request.getfixturevalue("kvtier_server")
        cache = Client(server.url, model="m", layout=LAYOUT, shared_memory=request.param == "server_shm")
        assert cache.info is not None, server.log()
        assert cache.uses_shared_memory == (request.param == "server_shm")
        # the server outlives the test: start from an empty cache. The L2 writes of the test before hold pins on
        # their L1 slots, and L1 cannot reserve a key again while its cleared slot is pinned: let them finish first
        assert cache.flush(60)
        cache.clear(admin_token=ADMIN_TOKEN)
    yield cache
    cache.close()
