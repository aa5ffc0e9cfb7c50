"""Helpers for tests that need a kvtier server: a real ``kvtier server`` subprocess (``kvtier_harness.kvtier_server``) with
these tests' layout and chunk size, ``wait_for``, CurveZMQ keys for raw sockets. No tests here."""

from __future__ import annotations

import time
from pathlib import Path

from kvtier_harness.kvtier_server import ServerProcess, kvtier_cmd  # noqa: F401 (kvtier_cmd: for the tests)
from kvtier_harness.metrics import metric_value  # noqa: F401 (for the tests)
from kvtier_harness.service_proc import free_port  # noqa: F401 (for the tests)
from kvtier.auth.curve import apply_client
from kvtier.auth.secret_file import add_tenant, client_credentials, default_secret_file, tenant_credentials, write_private
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)  # 128 bytes per token
CHUNK = 16  # tokens per chunk in these tests: 2048 bytes per chunk
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)


class ServerProc(ServerProcess):
    """A ``kvtier server`` with these tests' layout: ``CHUNK`` tokens per chunk, a small L1, and (unless ``config``
    sets it) one client allowed to reserve all of L1. ``url`` (ZMQ) and ``admin`` (HTTP) are on 127.0.0.1."""

    def __init__(self, tmp_path: Path, *, l1: str = "64MB", lease_seconds: float = 30.0, port: int | None = None,
                 config: dict | None = None, token: str | None = None, extra: tuple[str, ...] = (),
                 shared_memory: bool = True):
        # test L1s hold a few chunks: let one client reserve all of it unless the test sets the share
        config = dict(config or {})
        config["server"] = {"max_reserved_fraction_per_client": 1.0, "max_reserved_fraction_per_principal": 1.0,
                            "max_reserved_fraction_all_clients": 1.0, **config.get("server", {})}
        flags = ("--lease-seconds", str(lease_seconds), *(["--no-shared-memory"] if not shared_memory else []), *extra)
        super().__init__(tmp_path, CHUNK, l1, port=port, config=config, token=token, extra=flags)


def wait_for(predicate, timeout_seconds: float = 30.0, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value (bounded; raises AssertionError with ``what``)."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def authenticated(sock, url: str):
    """``sock`` (a raw DEALER, before ``connect``) with the CurveZMQ keys of the same-user server at ``url``."""
    creds, path, problem = client_credentials(url)
    assert creds is not None, problem or f"no secret file at {path}"
    apply_client(sock, creds)
    return sock


def tenant_file(server: ServerProcess, tenant: str, folder: Path) -> str:
    """The credential file of a new tenant ``tenant`` of ``server`` (added to its secret file; the server picks
    it up without a restart), written to ``folder``."""
    creds = add_tenant(default_secret_file(server.port), tenant)
    path = folder / f"{tenant}.cred"
    write_private(path, tenant_credentials(creds, tenant))
    return str(path)
