"""The client side of the data plane: where KV bytes go between a client tensor and L1 slots.

Same host: the client maps the server's L1 arena (``/dev/shm/<shm_name>``, ``Arena.attach``) and copies
each chunk straight into a reserved slot (store) or out of a pinned slot (retrieve); the server only
sends offsets. Otherwise each chunk travels as one raw ZMQ frame (C-contiguous chunk bytes,
``(num_layers, 2, n, num_kv_heads, head_dim)`` in the layout dtype). Either way one copy per direction.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
from pathlib import Path

import numpy as np

from kvtier.cache import (  # one tensor<->numpy convention for the cache and the client
    as_numpy,
    require_torch,
)
from kvtier.errors import KVTierError
from kvtier.l1.arena import Arena
from kvtier.layout import KVLayout
from kvtier.server.protocol import Slot


def host_id() -> str:
    """This machine as the server compares it: hostname plus kernel boot id (same /dev/shm, same kernel)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def attach_arena(shm_name: str, capacity_bytes: int) -> Arena | None:
    """Map the server's L1 arena, or None when it is not visible here (then the client uses frames)."""
    try:
        return Arena.attach(shm_name, capacity_bytes)
    except (KVTierError, OSError, ValueError):
        return None


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14, include/uapi/asm-generic/mman-common.h
log = logging.getLogger(__name__)


def prefault(arena: Arena) -> bool:
    """Map every page of the attached arena writable now (``madvise(MADV_POPULATE_WRITE)``), allocating the
    server's tmpfs pages not yet touched. Contents are unchanged. Without it each 4 KiB page costs a page
    fault on its first copy in this process, which made a store or a fresh process's first retrieve
    several times slower than the copy itself. Costs one pass over the arena at startup and commits the
    whole L1 (``--l1-size-gb``) in /dev/shm. Returns False (and logs why) when the kernel refuses it."""
    buf = arena.view(0, arena.capacity_bytes)
    try:
        address = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.madvise(address, arena.capacity_bytes, _MADV_POPULATE_WRITE) == 0:
            return True
        log.info("could not prefault the shared L1 (%s); pages are mapped on first use",
                 os.strerror(ctypes.get_errno()))
        return False
    finally:
        buf.release()  # no export may outlive this call: the arena must stay closable


def slot_tokens(slot: Slot, layout: KVLayout) -> int:
    """Tokens held by a slot (its byte size over the layout's bytes per token)."""
    return slot.nbytes // layout.bytes_per_token


def to_numpy(kv) -> np.ndarray:
    """A numpy view of a torch tensor or numpy array (no copy; bf16/fp8 viewed as same-size ints)."""
    return as_numpy(kv)


def empty_kv(layout: KVLayout, num_tokens: int):
    """A new torch tensor ``layout.chunk_shape(num_tokens)`` in the layout dtype, and its numpy view."""
    torch = require_torch()
    out = torch.empty(layout.chunk_shape(num_tokens), dtype=getattr(torch, layout.dtype))
    return out, as_numpy(out)


def chunk_view(buf, layout: KVLayout, num_tokens: int, dtype: np.dtype) -> np.ndarray:
    """``buf`` (a slot view or a frame) as a chunk array ``layout.chunk_shape(num_tokens)``; no copy."""
    return np.frombuffer(buf, dtype=dtype).reshape(layout.chunk_shape(num_tokens))
