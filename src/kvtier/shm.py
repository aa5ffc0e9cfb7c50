"""Files under /dev/shm that hold a server's L1: the name rule and the bounds rule shared by both ends, who owns
a file, and cleaning up after a crash.

The server creates the file (``l1/arena.py``), a client on the same host maps it (``client/dataplane.py``);
both refuse a name that could escape /dev/shm and a range outside the mapping with the same errors.

A running server holds a shared ``flock`` on its arena file (``hold_lock``). At startup a server removes this
user's ``kvtier-<pid>-<id>`` files whose pid is not running *and* whose lock nobody holds (``reap_stale_shm``):
those were left by a server killed with SIGKILL (tmpfs memory stays taken until reboot otherwise). The lock
makes this safe across pid namespaces that share one /dev/shm, where a live server's pid may look dead.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re

from kvtier.errors import ConfigError, InputError
from kvtier.proc import pid_alive

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
_SHM_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
_SERVER_SHM_RE = re.compile(r"^kvtier-(\d+)-[0-9a-f]{8}$")  # the name a server gives its arena


def shm_path(shm_name: str) -> str:
    """Path of the shared-memory file for ``shm_name``; raises ConfigError for unsafe names."""
    if not isinstance(shm_name, str) or not _SHM_NAME_RE.match(shm_name) or shm_name in (".", ".."):
        raise ConfigError(
            f"invalid shm_name {shm_name!r}: use 1-200 characters from A-Z a-z 0-9 _ . - "
            f"(it becomes a file name under {SHM_DIR})"
        )
    return os.path.join(SHM_DIR, shm_name)


def check_range(offset: int, nbytes: int, capacity_bytes: int) -> None:
    """Raise InputError unless ``[offset, offset + nbytes)`` (ints, bytes) lies inside ``capacity_bytes``."""
    if (
        isinstance(offset, bool) or isinstance(nbytes, bool)
        or not isinstance(offset, int) or not isinstance(nbytes, int)
        or offset < 0 or nbytes < 0 or offset + nbytes > capacity_bytes
    ):
        raise InputError(f"view({offset!r}, {nbytes!r}) is outside the mapping of {capacity_bytes} bytes")


def hold_lock(shm_name: str) -> int:
    """Hold a shared flock on our arena file while we run: the reaper of another server (in any pid
    namespace sharing this /dev/shm) sees it is in use."""
    fd = os.open(os.path.join(SHM_DIR, shm_name), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    return fd


def reap_stale_shm() -> list[str]:
    """Unlink this user's ``/dev/shm/kvtier-<pid>-<id>`` arenas left by a server killed with SIGKILL (it
    could not unlink them; their memory stays taken until reboot otherwise). Stale means: the pid is not
    running here and no process holds the file's flock."""
    reaped = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return reaped
    for name in names:
        match = _SERVER_SHM_RE.match(name)
        if not match:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != os.getuid() or pid_alive(int(match.group(1))):
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            reaped.append(name)
            log.warning("removed %s, the shared L1 of a server that is gone", path)
        except OSError:  # locked: a live server (perhaps in another pid namespace) uses it
            pass
        finally:
            os.close(fd)
    return reaped
