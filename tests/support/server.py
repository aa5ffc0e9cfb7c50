"""Helpers for tests that need a kvtier server: start a real ``kvtier server`` subprocess on free
127.0.0.1 ports, wait for /healthz, stop it with SIGTERM (and check it exits 0). No tests here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from kvtier.auth import apply_client, client_credentials
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)  # 128 bytes per token
CHUNK = 16  # tokens per chunk in these tests: 2048 bytes per chunk
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvtier_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtier", *args]


class ServerProc:
    """A ``kvtier server`` subprocess. ``url`` (ZMQ) and ``admin`` (HTTP) are on 127.0.0.1."""

    def __init__(self, tmp_path: Path, *, l1: str = "64MB", lease_seconds: float = 30.0, port: int | None = None,
                 config: dict | None = None, token: str | None = None, extra: tuple[str, ...] = (),
                 shared_memory: bool = True):
        self.port = port or free_port()
        self.admin_port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.log_path = tmp_path / f"server-{self.port}-{time.monotonic_ns()}.log"
        args = ["server", "--port", str(self.port), "--admin-port", str(self.admin_port), "--l1-size-gb", l1,
                "--eviction-policy", "LRU", "--chunk-size", str(CHUNK), "--lease-seconds", str(lease_seconds),
                *(["--no-shared-memory"] if not shared_memory else []), *extra]
        # test L1s hold a few chunks: let one client reserve all of it unless the test sets the share
        config = dict(config or {})
        config["server"] = {"max_reserved_fraction_per_client": 1.0, **config.get("server", {})}
        if config:
            path = tmp_path / f"config-{self.port}.yaml"
            path.write_text(yaml.safe_dump(config))
            args += ["--config", str(path)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        if token:
            env["KVTIER_ADMIN_TOKEN"] = token
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- the server writes to it until stop()
        self.proc = subprocess.Popen(kvtier_cmd(*args), stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.wait_healthy()

    def wait_healthy(self, timeout_seconds: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.admin + "/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout_seconds} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def status(self) -> dict:
        return httpx.get(self.admin + "/status", timeout=10).json()

    def metrics_text(self) -> str:
        return httpx.get(self.admin + "/metrics", timeout=10).text

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def wait_for(predicate, timeout_seconds: float = 30.0, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value (bounded; raises AssertionError with ``what``)."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def metric_value(text: str, name: str, **labels) -> float | None:
    """Value of one Prometheus series in exposition ``text`` (None when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, label_text = series.partition("{")
        if metric != name:
            continue
        found = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if part) if label_text else {}
        found = {k: v.strip('"') for k, v in found.items()}
        if found == {k: str(v) for k, v in labels.items()}:
            return float(value)
    return None


def authenticated(sock, url: str):
    """``sock`` (a raw DEALER, before ``connect``) with the CurveZMQ keys of the same-user server at ``url``."""
    creds, path, problem = client_credentials(url)
    assert creds is not None, problem or f"no secret file at {path}"
    apply_client(sock, creds)
    return sock
