"""A ``kvtier server`` subprocess for tests and benchmarks: free 127.0.0.1 ports, a log file, /healthz wait,
stopped by pid (SIGTERM, then SIGKILL after a grace period)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from kvtier_harness.service_proc import free_port


# servers still running, killed at interpreter exit (a failed assertion or an interrupt leaves none behind)
_LIVE: set[subprocess.Popen] = set()


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.kill()


def kvtier_cmd(*args: str) -> list[str]:
    """argv running the kvtier CLI with this interpreter."""
    return [sys.executable, "-m", "kvtier", *args]


def stop_process(proc: subprocess.Popen, grace_seconds: float) -> None:
    """SIGTERM ``proc`` (started by us, stopped by pid), SIGKILL it if it is still running after ``grace_seconds``."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_healthy(server, url: str, what: str, timeout_seconds: float) -> None:
    """Poll ``url`` until it answers 200 while ``server.proc`` runs; else stop it and raise with its log's tail.

    ``server`` has ``proc`` (a Popen), ``log_path`` and ``stop()``.
    """
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {server.proc.returncode}:\n{server.log_path.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"{what} not healthy after {timeout_seconds:.0f} s:\n{server.log_path.read_text()[-4000:]}")


class ServerProcess:
    """``kvtier server`` with ``chunk_size`` tokens per chunk and an LRU L1 of ``l1`` (a size: ``"2GB"``,
    ``"4096B"``), on free 127.0.0.1 ports (or ``port`` and ``admin_port``, to restart a server where its
    clients expect it). ``block_size``: hash per engine block (None: per chunk); ``l2``: an L2 adapter spec;
    ``config``: a config tree written to a YAML file in ``log_dir``; ``token``: the admin token (for
    ``clear_l1``); ``extra``: more flags. ``KVTIER_*`` variables of this process are not passed on.

    Raises:
        RuntimeError: the server exited or was not healthy within ``startup_timeout_seconds`` (with its log's tail).
    """

    def __init__(self, log_dir: Path, chunk_size: int, l1: str = "2GB", block_size: int | None = None, *,
                 port: int | None = None, admin_port: int | None = None, l2: dict | None = None,
                 config: dict | None = None, token: str | None = None, extra: tuple[str, ...] = (),
                 startup_timeout_seconds: float = 60.0):
        self.port, self.admin_port = port or free_port(), admin_port or free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.token = token
        log_dir = Path(log_dir)
        self.log_path = log_dir / f"kvtier-server-{self.port}-{time.monotonic_ns()}.log"
        args = ["server", "--port", str(self.port), "--admin-port", str(self.admin_port), "--l1-size-gb", l1,
                "--eviction-policy", "LRU", "--chunk-size", str(chunk_size)]
        if block_size is not None:
            args += ["--block-size", str(block_size)]
        if l2 is not None:
            args += ["--l2-adapter", json.dumps(l2)]
        if config:
            path = log_dir / f"config-{self.port}-{time.monotonic_ns()}.yaml"
            path.write_text(yaml.safe_dump(config))
            args += ["--config", str(path)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        if token:
            env["KVTIER_ADMIN_TOKEN"] = token
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- the server writes to it until stop()
        self.proc = subprocess.Popen(kvtier_cmd(*args, *extra), stdout=self._log, stderr=subprocess.STDOUT, env=env)
        _LIVE.add(self.proc)
        wait_healthy(self, f"{self.admin}/healthz", "kvtier server", startup_timeout_seconds)

    def log(self) -> str:
        """What the server has logged so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def status(self, token: str | None = None) -> dict:
        """``/status`` as JSON (with ``token``: as the admin sees it)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.get(f"{self.admin}/status", timeout=10, headers=headers).json()

    def metrics_text(self) -> str:
        """``/metrics`` (Prometheus text; ``kvtier_harness.metrics`` reads it)."""
        return httpx.get(f"{self.admin}/metrics", timeout=10).text

    def clear_l1(self) -> None:
        resp = httpx.post(f"{self.admin}/clear", json={"medium": "CPU"}, timeout=30,
                          headers={"Authorization": f"Bearer {self.token}"})
        resp.raise_for_status()

    def stop(self, grace_seconds: float = 30.0) -> int:
        """SIGTERM, SIGKILL after ``grace_seconds``; returns the exit code. Idempotent."""
        stop_process(self.proc, grace_seconds)
        _LIVE.discard(self.proc)
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
