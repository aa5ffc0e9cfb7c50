"""Quarantine: arena slots taken out of an L1 key space but kept allocated until their late writer is gone.

The server quarantines the slot of a store lease that expired while its client may still be writing into it
through shared memory: a late write can then only change bytes nobody reads, and the slot is never handed out
again until ``free``. Not thread-safe on its own: ``L1Store`` calls it under its lock.
"""

from __future__ import annotations

from kvtier.l1.arena import Arena


class Quarantine:
    """Tokens of quarantined slots of one ``Arena``.

    Attributes:
        nbytes: bytes (64-aligned block sizes) of the slots held.
    """

    def __init__(self, arena: Arena):
        self._arena = arena
        self._offsets: dict[int, int] = {}  # token -> arena offset
        self._next_token = 1
        self.nbytes = 0

    def hold(self, offset: int) -> int:
        """Keep the allocated slot at ``offset`` out of use; returns the token that frees it."""
        token = self._next_token
        self._next_token += 1
        self._offsets[token] = offset
        self.nbytes += self._arena.block_size(offset)
        return token

    def free(self, token: int) -> bool:
        """Free the slot of ``token`` in the arena; False when the token is unknown (already freed)."""
        offset = self._offsets.pop(token, None)
        if offset is None:
            return False
        self.nbytes -= self._arena.block_size(offset)
        self._arena.free(offset)
        return True

    def clear(self) -> None:
        """Forget every slot (the arena is being closed)."""
        self._offsets.clear()
        self.nbytes = 0
