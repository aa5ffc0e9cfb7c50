"""The server side of the shared L1 file under /dev/shm: who owns it, and cleaning up after a crash.

A running server holds a shared ``flock`` on its arena file. At startup a server removes this user's
``kvtier-<pid>-<id>`` files whose pid is not running *and* whose lock nobody holds: those were left by a
server killed with SIGKILL (tmpfs memory stays taken until reboot otherwise). The lock makes this
safe across pid namespaces that share one /dev/shm, where a live server's pid may look dead.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re

from kvtier.shm import SHM_DIR

log = logging.getLogger(__name__)
_SHM_RE = re.compile(r"^kvtier-(\d+)-[0-9a-f]{8}$")


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
        match = _SHM_RE.match(name)
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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs here (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
