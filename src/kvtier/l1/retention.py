"""The L1 bookkeeping behind retention hints (``kvtier.hints``: ``priority``, ``ttl_seconds``, ``session_id``).

A hint protects a chunk from eviction while it is *live*: until ``ttl_seconds`` after the store that set it
(no TTL: until the hint is cleared). Under pressure ``L1Store`` evicts unprotected chunks (no hint, or an expired
one) first, in policy order; only when none is left does it evict protected chunks, lowest ``priority`` first
(policy order within a priority). A chunk of a live session therefore outlives every unhinted chunk and every
lower-priority chunk. Protected chunks may hold at most ``max_share`` of L1's bytes
(``l1_retention_max_share``), and the chunks one owner hinted (a hint's ``owner``: the server sets the client's
principal) at most ``max_owner_share`` (``l1_retention_max_share_per_principal``): a hint past either is refused
(the chunk is stored as an ordinary one and the refusal is counted), so hints can never starve the cache and one
tenant cannot take the share from the others. A ``session_id`` without a TTL gets ``session_ttl_seconds``; any
other hint without one ``default_ttl_seconds`` (``retention_max_ttl_seconds``): only a management pin has no expiry.

Not thread-safe on its own: ``L1Store`` calls it under its lock. Times come from ``clock`` (seconds,
``time.monotonic`` by default; the simulator passes the trace's clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass

from kvtier.errors import InputError
from kvtier.hints import MAX_PRIORITY, RetentionHint

@dataclass(slots=True)
class _Held:
    priority: int
    expires_at: float | None
    session_id: str | None
    nbytes: int
    pinned: bool = False
    owner: str | None = None


class Retention:
    """Live hints of the chunks in one L1: key -> (priority, expiry, session, bytes), and the bytes they hold.

    Args:
        capacity_bytes: L1's budget; ``max_share`` of it may be held by protected chunks.
        max_share: 0..1 (0 disables hints: every one is refused).
        session_ttl_seconds: TTL of a hint with a ``session_id`` and no ``ttl_seconds``.
        max_owner_share: 0..1, of ``capacity_bytes``: what the hints of one owner may hold (hints without an
            owner count only against ``max_share``).
        default_ttl_seconds: TTL of any other hint without ``ttl_seconds`` (a management pin has none).
    """

    def __init__(self, capacity_bytes: int, max_share: float = 0.5, session_ttl_seconds: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, *, max_owner_share: float = 1.0,
                 default_ttl_seconds: float | None = None):
        for name, share in (("l1_retention_max_share", max_share), ("max_owner_share", max_owner_share)):
            if not 0.0 <= share <= 1.0:
                raise InputError(f"{name} must be between 0 and 1, got {share!r}")
        self.max_bytes = int(capacity_bytes * max_share)
        self.max_owner_bytes = int(capacity_bytes * max_owner_share)
        self.session_ttl_seconds = session_ttl_seconds
        self.default_ttl_seconds = default_ttl_seconds
        self.clock = clock
        self._held: dict[Hashable, _Held] = {}
        self._held_bytes = 0
        self._owner_bytes: dict[str, int] = {}
        self.num_refused = 0

    def set(self, key: Hashable, hint: RetentionHint, nbytes: int, *, pinned: bool = False) -> bool:
        """Protect ``key`` (``nbytes`` in L1) under ``hint``; a stronger existing hint keeps its priority and the
        later expiry (a live hint without an expiry keeps none), and the owner that first hinted it. Returns False
        (and counts a refusal) when it would take protected bytes past the share, or its owner's past theirs."""
        now = self.clock()
        ttl = hint.ttl_seconds
        if ttl is None and not pinned:
            ttl = self.session_ttl_seconds if hint.session_id is not None else self.default_ttl_seconds
        expires = None if ttl is None else now + ttl
        old = self._held.get(key)
        if old is None:
            owner = hint.owner
            if not self._room(nbytes, owner):
                self.expire(now)
                if not self._room(nbytes, owner):
                    self.num_refused += 1
                    return False
            self._held[key] = _Held(hint.priority, expires, hint.session_id, nbytes, pinned, owner)
            self._held_bytes += nbytes
            if owner is not None:
                self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + nbytes
            return True
        live = self.live(old, now)
        old.priority = max(old.priority, hint.priority) if live else hint.priority
        if expires is None or old.pinned or pinned or (live and old.expires_at is None):
            old.expires_at = None  # no expiry outlasts any TTL: a later TTL hint does not shorten it
        else:
            old.expires_at = max(expires, old.expires_at or expires)
        old.session_id = hint.session_id or old.session_id
        old.pinned = old.pinned or pinned
        return True

    def _room(self, nbytes: int, owner: str | None) -> bool:
        return self._held_bytes + nbytes <= self.max_bytes and (
            owner is None or self._owner_bytes.get(owner, 0) + nbytes <= self.max_owner_bytes)

    def drop(self, key: Hashable) -> bool:
        """Forget ``key``'s hint (evicted, removed, or unpinned); True when it had one."""
        held = self._held.pop(key, None)
        if held is not None:
            self._held_bytes -= held.nbytes
            if held.owner is not None:
                left = self._owner_bytes[held.owner] - held.nbytes
                if left:
                    self._owner_bytes[held.owner] = left
                else:
                    del self._owner_bytes[held.owner]
        return held is not None

    def expire(self, now: float | None = None) -> int:
        """Forget the hints whose TTL passed; returns how many."""
        now = self.clock() if now is None else now
        gone = [k for k, h in self._held.items() if not self.live(h, now)]
        for key in gone:
            self.drop(key)
        return len(gone)

    @staticmethod
    def live(held: _Held, now: float) -> bool:
        return held.expires_at is None or now < held.expires_at

    def protection(self, key: Hashable, now: float) -> int | None:
        """None when ``key`` is an ordinary eviction candidate, else its rank (higher: evicted later;
        a management pin ranks above every priority)."""
        held = self._held.get(key)
        if held is None or not self.live(held, now):
            return None
        return MAX_PRIORITY + 1 if held.pinned else held.priority

    def eviction_order(self, victims: Iterable[Hashable], pins: Callable[[Hashable], int | None]) -> Iterator[Hashable]:
        """The keys to evict, in order, from ``victims`` (the policy's order; evicting a yielded key meanwhile is
        fine): unprotected ones (no hint, or an expired one) first; then, unless one of those was only pinned for
        a moment (a read, an L2 write: then nothing more), hinted ones by priority, lowest first; a management pin
        never. ``pins(key)``: the key's pins, None once it is gone; a pinned key is never yielded."""
        now = self.clock() if self._held else None
        protected: list[tuple[int, Hashable]] = []
        busy = False
        for key in victims:
            rank = None if now is None else self.protection(key, now)
            if rank is not None:
                protected.append((rank, key))
            elif pins(key):
                busy = True  # the policy rotates it and offers the next one
            else:
                yield key
        if busy:
            return
        for rank, key in sorted(protected, key=lambda p: p[0]):
            if rank <= MAX_PRIORITY and pins(key) == 0:
                yield key

    def get(self, key: Hashable) -> _Held | None:
        return self._held.get(key)

    def describe(self, key: Hashable) -> dict | None:
        """``key``'s hint as a dict (priority, expires_in_seconds, session_id, pinned), None without one."""
        held = self._held.get(key)
        if held is None:
            return None
        left = None if held.expires_at is None else max(0.0, held.expires_at - self.clock())
        return {"priority": held.priority, "expires_in_seconds": left, "session_id": held.session_id,
                "pinned": held.pinned}

    def session_keys(self, session_id: str) -> list[Hashable]:
        """Keys whose hint names ``session_id`` (live or not yet expired away)."""
        return [k for k, h in self._held.items() if h.session_id == session_id]

    def sessions(self) -> dict[str, tuple[int, int]]:
        """session_id -> (chunks, bytes) of its hinted chunks in L1."""
        out: dict[str, tuple[int, int]] = {}
        for held in self._held.values():
            if held.session_id is not None:
                n, b = out.get(held.session_id, (0, 0))
                out[held.session_id] = (n + 1, b + held.nbytes)
        return out

    def __len__(self) -> int:
        return len(self._held)

    def owner_bytes(self, owner: str) -> int:
        """Bytes held by the hints ``owner`` set."""
        return self._owner_bytes.get(owner, 0)

    @property
    def held_bytes(self) -> int:
        """Bytes of L1 held by hinted chunks (expired ones until the next ``expire``)."""
        return self._held_bytes
