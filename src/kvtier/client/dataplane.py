"""The client side of the data plane: where KV bytes go between a client tensor and the server's L1 slots.

Same host: the client maps the server's L1 arena (``/dev/shm/<shm_name>``, ``SharedMapping``) and copies
each chunk straight into a reserved slot (store) or out of a pinned slot (retrieve); the server only
sends offsets. Otherwise each chunk travels as one raw ZMQ frame (C-contiguous chunk bytes,
``(num_layers, 2, n, num_kv_heads, head_dim)`` in the layout dtype). Either way one copy per direction.

Attaching maps the file without touching it (no ``MAP_POPULATE``, no prefault of the whole arena), so attach
time and the client's committed memory do not grow with the L1 size; a copying client populates the 2 MiB
regions of the slots it is handed, once each (``SharedMapping.populate``).

Only the server allocates in the arena (``kvtier.l1.arena``); a client maps it and reads or writes at the
offsets the server hands out, so nothing here imports the storage side.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import numpy as np

from kvtier.errors import ConfigError, KVTierError
from kvtier.layout import KVLayout
from kvtier.protocol import Slot
from kvtier.shm import check_range, shm_path

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14, include/uapi/asm-generic/mman-common.h
POPULATE_BYTES = 2 << 20  # granule of SharedMapping.populate: one huge page, a few chunks of KV
log = logging.getLogger(__name__)


class SharedMapping:
    """An existing ``/dev/shm/<shm_name>`` (the server's L1 arena) mapped read-write into this process.

    Attach only: the file is never created, resized or unlinked here, and there is no allocator; the server
    decides offsets (``StoreSlots`` / ``RetrieveSlots``). Mapped with ``os.open`` + ``mmap`` rather than
    ``multiprocessing.shared_memory``, whose resource tracker (Python 3.11) would unlink the server's file
    when this process exits.

    Args:
        shm_name: the file name under /dev/shm (``HelloReply.shm_name``).
        capacity_bytes: bytes to map from offset 0 (``HelloReply.shm_capacity_bytes``), an int > 0.

    Attributes:
        address: the mapping's first byte in this process's memory; close_hooks: callables run with the mapping
            when ``close`` starts, before it is unmapped.

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
        self.address = np.frombuffer(self._buf, dtype=np.uint8).ctypes.data  # the export ends with the array
        # called with this mapping before it is unmapped (e.g. to cudaHostUnregister it: connectors.device_copy)
        self.close_hooks: list = []
        # one flag per POPULATE_BYTES region: already populated in this process (see ``populate``)
        self._populated = bytearray(-(-capacity_bytes // POPULATE_BYTES))

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Writable memoryview (format ``B``) of ``nbytes`` bytes at ``offset``; no copy.

        Raises InputError when the range is not inside the mapping, KVTierError when closed.
        """
        if self._closed:
            raise KVTierError("shared mapping is closed")
        check_range(offset, nbytes, self.capacity_bytes)
        return self._buf[offset : offset + nbytes]

    def populate(self, offset: int, nbytes: int) -> int:
        """Prefault the ``POPULATE_BYTES`` regions covering ``[offset, offset + nbytes)`` that this process has
        not populated yet (``prefault``); returns how many regions were populated now. This is how a copying
        client pays page faults in batches for the slots it uses, never for the whole arena: attach cost and
        committed memory stay independent of the L1 size. Raises InputError when the range is outside the
        mapping, KVTierError when closed."""
        if self._closed:
            raise KVTierError("shared mapping is closed")
        check_range(offset, nbytes, self.capacity_bytes)
        first, last = offset // POPULATE_BYTES, (offset + max(nbytes, 1) - 1) // POPULATE_BYTES
        done = 0
        i = first
        while i <= last:
            if self._populated[i]:
                i += 1
                continue
            j = i
            while j + 1 <= last and not self._populated[j + 1]:
                j += 1
            start = i * POPULATE_BYTES
            stop = min((j + 1) * POPULATE_BYTES, self.capacity_bytes)
            prefault(self, start, stop - start)  # refused: the copy faults pages in by itself
            self._populated[i:j + 1] = b"\x01" * (j + 1 - i)
            done += j + 1 - i
            i = j + 1
        return done

    def close(self) -> None:
        """Unmap (idempotent). Views still held keep the pages mapped until they are garbage-collected;
        the mapping itself refuses new views at once. The server's file is left alone."""
        if self._closed:
            return
        self._closed = True
        for hook in self.close_hooks:
            hook(self)
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


def prefault(mapping: SharedMapping, offset: int = 0, nbytes: int | None = None) -> bool:
    """Map the pages of ``[offset, offset + nbytes)`` of the attached arena writable now
    (``madvise(MADV_POPULATE_WRITE)``; default: the whole arena), allocating the server's tmpfs pages not yet
    touched. Contents are unchanged. One call populates a range in a batch, far cheaper than a page fault per
    4 KiB page on the first copy. Returns False (and logs why, once) when the kernel refuses it; the pages are
    then mapped on first use. Raises InputError when the range is not inside the mapping."""
    nbytes = mapping.capacity_bytes - offset if nbytes is None else nbytes
    buf = mapping.view(offset, nbytes)
    try:
        address = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        if _madvise(address, nbytes, _MADV_POPULATE_WRITE) == 0:
            return True
        global _WARNED_POPULATE
        if not _WARNED_POPULATE:
            log.info("could not prefault the shared L1 (%s); pages are mapped on first use",
                     os.strerror(ctypes.get_errno()))
            _WARNED_POPULATE = True
        return False
    finally:
        buf.release()  # no export may outlive this call: the mapping must stay closable


_WARNED_POPULATE = False
_LIBC = None


def _madvise(address: int, nbytes: int, advice: int) -> int:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    start = address // page * page  # madvise wants a page-aligned start
    return _LIBC.madvise(start, nbytes + (address - start), advice)


def slot_tokens(slot: Slot, layout: KVLayout) -> int:
    """Tokens held by a slot (its byte size over the layout's bytes per token)."""
    return slot.nbytes // layout.bytes_per_token
