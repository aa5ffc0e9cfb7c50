"""The client side of the data plane: where KV bytes go between a client tensor and L1 slots.

Same host: the client maps the server's L1 arena (``/dev/shm/<shm_name>``, ``Arena.attach``) and copies
each chunk straight into a reserved slot (store) or out of a pinned slot (retrieve); the server only
sends offsets. Otherwise each chunk travels as one raw ZMQ frame (C-contiguous chunk bytes,
``(num_layers, 2, n, num_kv_heads, head_dim)`` in the layout dtype). Either way one copy per direction.
"""

from __future__ import annotations

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


def chunk_frames(src: np.ndarray, slots: list[Slot], layout: KVLayout, chunk_size: int) -> list:
    """One C-contiguous buffer per slot (chunk bytes to send as frames)."""
    out = []
    for slot in slots:
        start = slot.chunk_index * chunk_size
        out.append(np.ascontiguousarray(src[:, :, start:start + slot_tokens(slot, layout)]).data)
    return out
