"""Files under /dev/shm that hold a server's L1: the name rule and the bounds rule shared by both ends.

The server creates the file (``l1/arena.py``), a client on the same host maps it (``client/dataplane.py``);
both refuse a name that could escape /dev/shm and a range outside the mapping with the same errors.
"""

from __future__ import annotations

import os
import re

from kvtier.errors import ConfigError, InputError

SHM_DIR = "/dev/shm"
_SHM_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


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
