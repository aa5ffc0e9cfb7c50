"""Chunk refs and tickets: what ``KVCache`` hands out for one prompt.

``PromptBlocks`` and ``ChunkRef`` name a prompt's chunks (keys, token ranges, the block digests events are made
of); ``L1Slot`` is an L1 slot handed out for copying (the wire protocol's ``Slot`` names one by offset);
``StoreTicket`` / ``RetrieveTicket`` hold the slots reserved by ``KVCache.begin_store`` or pinned by
``KVCache.begin_retrieve`` until ``commit_store`` / ``end_retrieve``. Plain data: no locks, no tier access.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvtier.hints import RetentionHint
from kvtier.keys import ChunkKey


@dataclass(slots=True)
class PromptBlocks:
    """One prompt's block digests (``block_size`` tokens each; with ``save_unfull_chunk`` the last may be
    partial) and the per-block extra keys they were hashed with: what chunk keys and events are made of.
    ``parent``: the digest before ``digests[0]`` when they do not start the sequence (a ``PageChain``'s)."""

    block_size: int
    digests: list[bytes]
    extra_keys: tuple | None
    parent: bytes | None = None


@dataclass(slots=True)
class ChunkRef:
    """Chunk ``index`` of a prompt: its key (the digest of its last block), token range ``[start, end)`` and
    the prompt's blocks (shared by every ref of the prompt)."""

    index: int
    key: ChunkKey
    start: int
    end: int
    blocks: PromptBlocks


@dataclass(slots=True)
class L1Slot:
    """An L1 slot handed out for copying: chunk ref, arena offset, size in bytes and a view on it."""

    ref: ChunkRef
    offset: int
    nbytes: int
    view: memoryview


@dataclass
class StoreTicket:
    """Slots reserved by ``begin_store``; invisible until ``commit_store``. ``limited``: reserving stopped at
    the caller's ``max_bytes``, not for want of L1 space."""

    tokens: np.ndarray
    refs: list[ChunkRef]
    slots: list[L1Slot] = field(default_factory=list)
    limited: bool = False
    hint: RetentionHint | None = None  # applied at commit to every chunk of the prompt (stored or already held)
    hinted_before: list[ChunkKey] = field(default_factory=list)  # with a hint: the keys of the chunks before start
    # told, from the L2 writer's thread, how many committed chunks will not reach L2 (dropped, failed): flush()
    on_lost: Callable[[int], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots)


@dataclass
class RetrieveTicket:
    """Pinned slots of the leading available chunks; ``num_tokens`` tokens in all."""

    slots: list[L1Slot] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.slots[-1].ref.end if self.slots else 0
