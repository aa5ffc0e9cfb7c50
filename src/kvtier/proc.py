"""Facts about local processes and this machine: whether a pid runs, when it started, which host and boot
this is. Read by the shared-memory reaper (``kvtier.shm``), the local-disk adapter's stale-file cleanup
(``l2/disk_index.py``), the client (its ``Hello``) and the server (is a client on this host, is its process
still the one that said ``Hello``: ``server/server.py``, ``server/limits.py``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs here (one of another user counts as running)."""
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def pid_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None when there
    is no such process visible here. With the pid it names one process, even after the pid is reused."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after the last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def host_id() -> str:
    """This machine as the server compares it: hostname plus kernel boot id (same /dev/shm, same kernel)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"
