"""LookupMemo: the chunk refs of recently seen prompts, bounded in bytes (``lookup_memo_max_bytes``)."""

from __future__ import annotations

import threading
from collections import OrderedDict

# What one memoized prompt costs, rounded up from tracemalloc on CPython 3.11 (chunk_refs of 65,536 tokens at
# chunk/block 16/16, 256/16, 256/256: about 73 bytes per block digest and 210-480 per ChunkRef with its ChunkKey,
# ~130 more once the key has made its L2 name, which it keeps: ``ChunkKey.name``).
_MEMO_BLOCK_BYTES = 100
_MEMO_CHUNK_BYTES = 600
_MEMO_EXTRA_BLOCK_BYTES = 120  # a per-block extra-keys entry (tuple of short keys), when there are any


class LookupMemo:
    """Chunk refs of recently seen prompts (lookup, retrieve and store of one prompt hash it once), bounded
    in bytes: ``max_bytes`` of estimated memory, least recently used first out; a prompt costing more than
    the whole budget is not kept. Thread-safe. Shared by every cache over one ``Tiers``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict = OrderedDict()  # key -> (refs, cost)
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def put(self, key, refs: list, num_blocks: int, has_extra: bool) -> None:
        cost = (num_blocks * (_MEMO_BLOCK_BYTES + (_MEMO_EXTRA_BLOCK_BYTES if has_extra else 0))
                + len(refs) * _MEMO_CHUNK_BYTES + 200)
        if cost > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[key] = (refs, cost)
            self._bytes += cost
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    @property
    def nbytes(self) -> int:
        """Estimated bytes held."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
