"""Contract-suite factories for the network adapters, each over a real server on 127.0.0.1.

Merged into ``ADAPTER_FACTORIES`` by ``tests/contract/l2/conftest.py`` (it reads ``FACTORIES``). Each server
starts once per test session, on first use, and is stopped (by pid) when the session's process exits.
Every test gets its own key prefix derived from its ``tmp_path``, so a second adapter made in the same
test sees the first one's records and no test sees another's.
"""

from __future__ import annotations

import atexit
import hashlib
import threading
from collections.abc import Callable
from pathlib import Path

from kvtier_harness import services

from kvtier.l2.base import L2Adapter, create_adapter  # noqa: E402

_SERVERS: dict[str, object] = {}
_LOCK = threading.Lock()
_STARTERS: dict[str, Callable[[], object]] = {
    "moto": services.start_moto,
    "seaweedfs": services.start_seaweedfs,
    "azurite": services.start_azurite,
    "redis": services.start_redis,
    "valkey": lambda: services.start_redis(binary="valkey-server"),
    "redis_cluster": services.start_redis_cluster,
}


def server(kind: str):
    """The session's server of ``kind``, started on first use."""
    with _LOCK:
        if kind not in _SERVERS:
            _SERVERS[kind] = _STARTERS[kind]()
        return _SERVERS[kind]


@atexit.register
def _stop_servers() -> None:
    for handle in _SERVERS.values():
        handle.stop()
    _SERVERS.clear()


def _prefix(tmp_path: Path, sep: str) -> str:
    return "kvt" + sep + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:16] + sep


class RemoteFactory:
    """Same shape as ``conftest.AdapterFactory``: ``factory(tmp_path, capacity_bytes=None) -> L2Adapter``.

    Remote adapters have no capacity of their own (the store's operator sizes it), so ``has_capacity`` is False.
    (A plain class: the conftest loads this file without registering it in sys.modules, which dataclasses need.)
    """

    has_capacity = False
    fixtures: tuple[str, ...] = ()

    def __init__(self, make: Callable[[Path], L2Adapter]):
        self.make = make

    def __call__(self, tmp_path: Path, capacity_bytes: int | None = None, **_fixtures) -> L2Adapter:
        if capacity_bytes is not None:
            raise ValueError("remote adapters have no capacity_bytes")
        return self.make(tmp_path)


def _s3(kind: str) -> Callable[[Path], L2Adapter]:
    def make(tmp_path: Path) -> L2Adapter:
        s3 = server(kind)
        return create_adapter({"type": "s3", "bucket": "kvtier-contract", "create": True,
                               "prefix": _prefix(tmp_path, "/"), "endpoint_url": s3.endpoint_url,
                               "aws_access_key_id": s3.access_key_id, "aws_secret_access_key": s3.secret_access_key})
    return make


def _azure(tmp_path: Path) -> L2Adapter:
    az = server("azurite")
    return create_adapter({"type": "azure_blob", "container": "kvtier-contract", "create": True,
                           "prefix": _prefix(tmp_path, "/"), "connection_string": az.connection_string})


def _redis(kind: str, **extra) -> Callable[[Path], L2Adapter]:
    def make(tmp_path: Path) -> L2Adapter:
        handle = server(kind)
        return create_adapter({"type": "valkey" if kind == "valkey" else "redis", "url": handle.url,
                               "cluster": kind == "redis_cluster", "prefix": _prefix(tmp_path, ":"), **extra})
    return make


FACTORIES: dict[str, RemoteFactory] = {
    "s3_moto": RemoteFactory(_s3("moto")),
    "s3_seaweedfs": RemoteFactory(_s3("seaweedfs")),
    "azure_azurite": RemoteFactory(_azure),
    "redis": RemoteFactory(_redis("redis")),
    # records above 256 KiB take the split path (parts + manifest) through the whole suite
    "redis_split": RemoteFactory(_redis("redis", max_value_bytes=256 << 10)),
    "redis_cluster": RemoteFactory(_redis("redis_cluster", max_value_bytes=4 << 20)),
    "valkey": RemoteFactory(_redis("valkey")),
}
