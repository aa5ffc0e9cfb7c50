"""The client side of the data plane: where KV bytes go between a client tensor and the server's L1 slots.

Same host: the client maps the server's L1 arena (``/dev/shm/<shm_name>``, ``SharedMapping``) and copies
each chunk straight into a reserved slot (store) or out of a pinned slot (retrieve); the server only
sends offsets. Otherwise each chunk travels as one raw ZMQ frame (C-contiguous chunk bytes,
``(num_layers, 2, n, num_kv_heads, head_dim)`` in the layout dtype). Either way one copy per direction.

Only the server allocates in the arena (``kvtier.l1.arena``); a client maps it and reads or writes at the
offsets the server hands out, so nothing here imports the storage side.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import socket
from pathlib import Path

import numpy as np

from kvtier.errors import ConfigError, KVTierError
from kvtier.layout import KVLayout
from kvtier.protocol import Slot
from kvtier.shm import check_range, shm_path

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14, include/uapi/asm-generic/mman-common.h
log = logging.getLogger(__name__)


def host_id() -> str:
    """This machine as the server compares it: hostname plus kernel boot id (same /dev/shm, same kernel)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


class SharedMapping:
    """An existing ``/dev/shm/<shm_name>`` (the server's L1 arena) mapped read-write into this process.

    Attach only: the file is never created, resized or unlinked here, and there is no allocator; the server
    decides offsets (``StoreSlots`` / ``RetrieveSlots``). Mapped with ``os.open`` + ``mmap`` rather than
    ``multiprocessing.shared_memory``, whose resource tracker (Python 3.11) would unlink the server's file
    when this process exits.

    Args:
        shm_name: the file name under /dev/shm (``HelloReply.shm_name``).
        capacity_bytes: bytes to map from offset 0 (``HelloReply.shm_capacity_bytes``), an int > 0.

    Raises:
        ConfigError: unsafe name, bad capacity, file missing, or file smaller than ``capacity_bytes``.
    """

    def __init__(self, shm_name: str, capacity_bytes: int):
        path = shm_path(shm_name)
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ConfigError(f"shared-memory file {path} does not exist: is the kvtier server running?") from None
        try:
            size = os.fstat(fd).st_size
            if size < capacity_bytes:
                raise ConfigError(f"{path} holds {size} bytes, fewer than the {capacity_bytes} asked for")
            self._mmap = mmap.mmap(fd, capacity_bytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.shm_name = shm_name
        self.capacity_bytes = capacity_bytes
        self._buf = memoryview(self._mmap)
        self._closed = False

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Writable memoryview (format ``B``) of ``nbytes`` bytes at ``offset``; no copy.

        Raises InputError when the range is not inside the mapping, KVTierError when closed.
        """
        if self._closed:
            raise KVTierError("shared mapping is closed")
        check_range(offset, nbytes, self.capacity_bytes)
        return self._buf[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap (idempotent). Views still held keep the pages mapped until they are garbage-collected;
        the mapping itself refuses new views at once. The server's file is left alone."""
        if self._closed:
            return
        self._closed = True
        self._buf.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # outstanding views: the mapping goes when the last one is garbage-collected


def attach_arena(shm_name: str, capacity_bytes: int) -> SharedMapping | None:
    """Map the server's L1 arena, or None when it is not visible here (then the client uses frames)."""
    try:
        return SharedMapping(shm_name, capacity_bytes)
    except (KVTierError, OSError, ValueError):
        return None


def prefault(mapping: SharedMapping) -> bool:
    """Map every page of the attached arena writable now (``madvise(MADV_POPULATE_WRITE)``), allocating the
    server's tmpfs pages not yet touched. Contents are unchanged. Without it each 4 KiB page costs a page
    fault on its first copy in this process, which made a store or a fresh process's first retrieve
    several times slower than the copy itself. Costs one pass over the arena at startup and commits the
    whole L1 (``--l1-size-gb``) in /dev/shm. Returns False (and logs why) when the kernel refuses it."""
    buf = mapping.view(0, mapping.capacity_bytes)
    try:
        address = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.madvise(address, mapping.capacity_bytes, _MADV_POPULATE_WRITE) == 0:
            return True
        log.info("could not prefault the shared L1 (%s); pages are mapped on first use",
                 os.strerror(ctypes.get_errno()))
        return False
    finally:
        buf.release()  # no export may outlive this call: the mapping must stay closable


def slot_tokens(slot: Slot, layout: KVLayout) -> int:
    """Tokens held by a slot (its byte size over the layout's bytes per token)."""
    return slot.nbytes // layout.bytes_per_token
