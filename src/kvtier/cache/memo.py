"""LookupMemo: the chunk refs of recently seen prompts, found again by any whole-chunk prefix of theirs.

An engine asks about one request's prompt several times, at other lengths each time: vLLM's connector looks up
the whole prompt, prefetches and loads its leading chunks, and stores it as chunked prefill computes it (a
32k-token prompt: lookup, then stores of 2k, 4k, ... 32k tokens). Keyed by the exact token array, each of those
hashed the prompt again (10x its tokens for that prompt). So an entry is found by *fingerprints* of its prefixes:
xxh3-128 of its token ids (int64) up to every multiple of ``FINGERPRINT_TOKENS`` that ends a chunk, and up to its
last whole chunk. ``PromptKeys`` asks for the longest fingerprinted prefix of a prompt and hashes only the blocks
after it, chained from that prefix's last digest; a prompt that is a prefix of an entry hashes nothing.

Each fingerprint points at the latest entry that has it; an entry no fingerprint points at any more (a longer
prompt extended it) is dropped. Bounded in bytes: ``max_bytes`` of estimated memory, least recently used first
out; an entry costing more than the whole budget is not kept. Thread-safe. Shared by every cache over one
``Tiers``; an entry's ``scope`` (model, chunk layout, namespace) is part of every fingerprint it is found by.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

FINGERPRINT_TOKENS = 256  # prefixes are found at multiples of this many tokens (rounded up to whole chunks)
# What one memoised prompt costs, rounded up from tracemalloc on CPython 3.11 (chunk_refs of 65,536 tokens at
# chunk/block 16/16, 256/16, 256/256: about 73 bytes per block digest and 210-480 per ChunkRef with its ChunkKey,
# ~130 more once the key has made its L2 name, which it keeps: ``ChunkKey.name``).
_MEMO_BLOCK_BYTES = 100
_MEMO_CHUNK_BYTES = 600
_MEMO_EXTRA_BLOCK_BYTES = 120  # a per-block extra-keys entry (tuple of short keys), when there are any
_MEMO_FINGERPRINT_BYTES = 200  # an index entry: (scope, fingerprint) -> entry


@dataclass(slots=True, eq=False)
class MemoEntry:
    """One memoised prompt: its ``scope``, its fingerprints ``(end token, xxh3-128)`` in ascending order, its chunk
    refs (``ChunkRef``, sharing one ``PromptBlocks``) and the per-block extra keys they were hashed with."""

    scope: tuple
    fingerprints: list[tuple[int, int]]
    refs: list
    extra: tuple | None
    cost: int = 0
    live: int = 0  # fingerprints pointing here


def same_extra(a: tuple | None, b: tuple | None, num_blocks: int) -> bool:
    """Whether two prompts' per-block extra keys agree on their first ``num_blocks`` blocks (None: none at all)."""
    if a is None or b is None:
        other = b if a is None else a
        return other is None or all(e is None for e in other[:num_blocks])
    return a[:num_blocks] == b[:num_blocks]


class LookupMemo:
    """See the module docstring. ``max_bytes``: the budget (``lookup_memo_max_bytes``)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, MemoEntry] = OrderedDict()  # id(entry) -> entry, least recent first
        self._index: dict[tuple, MemoEntry] = {}  # (scope, fingerprint) -> entry
        self._bytes = 0
        self._lock = threading.Lock()

    def find(self, scope: tuple, fingerprints, extra: tuple | None) -> tuple[MemoEntry, int] | None:
        """The entry holding the first of ``fingerprints`` (``(end, fingerprint)``, longest first) found in
        ``scope`` with the same extra keys over its blocks, and that end; None when none is."""
        with self._lock:
            for end, fingerprint in fingerprints:
                entry = self._index.get((scope, fingerprint))
                if entry is None:
                    continue
                block_size = entry.refs[0].blocks.block_size
                if same_extra(entry.extra, extra, end // block_size):
                    self._entries.move_to_end(id(entry))
                    return entry, end
        return None

    def put(self, entry: MemoEntry, num_blocks: int) -> None:
        """Keep ``entry`` (``num_blocks`` block digests): each of its fingerprints now finds it."""
        has_extra = entry.extra is not None
        entry.cost = (num_blocks * (_MEMO_BLOCK_BYTES + (_MEMO_EXTRA_BLOCK_BYTES if has_extra else 0))
                      + len(entry.refs) * _MEMO_CHUNK_BYTES + len(entry.fingerprints) * _MEMO_FINGERPRINT_BYTES + 200)
        if entry.cost > self.max_bytes:
            return
        with self._lock:
            for _, fingerprint in entry.fingerprints:
                old = self._index.get((entry.scope, fingerprint))
                self._index[(entry.scope, fingerprint)] = entry
                entry.live += 1
                if old is not None:
                    old.live -= 1
                    if old.live == 0:  # every prefix of it now finds a newer entry
                        self._drop(old)
            self._entries[id(entry)] = entry
            self._bytes += entry.cost
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries.values())))

    def _drop(self, entry: MemoEntry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        self._bytes -= entry.cost
        for _, fingerprint in entry.fingerprints:
            if self._index.get((entry.scope, fingerprint)) is entry:
                del self._index[(entry.scope, fingerprint)]

    @property
    def nbytes(self) -> int:
        """Estimated bytes held."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
