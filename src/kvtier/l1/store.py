"""L1Store: chunks in host memory under a byte budget, with pin counts and an eviction policy.

Life of an entry::

    reserve(key, nbytes) -> slot view   (pinned, invisible)  -> write the bytes ->
    commit(key)                         (visible, unpinned, known to the policy)
    acquire(key) -> (view, meta, offset) (pinned, counts an access) -> read the bytes -> release(key, offset)

Eviction is synchronous and bounded: ``reserve`` evicts unpinned committed entries in policy order
until a contiguous slot fits (fragmentation can need more than the byte count), and returns None
("not stored") once nothing unpinned is left; it never waits. Pinned entries (reserved, or acquired
and not yet released) are never evicted. ``remove`` of a pinned entry hides it at once and frees its
slot at the last ``release``; its key can be reserved again at once, in another slot (a pin is released by
key *and* offset, so the old slot's readers and the new one's never release each other's pins).

A reservation can be quarantined instead of aborted (``kvtier.l1.quarantine``); entries can carry retention
hints (``kvtier.l1.retention``, set by ``hint``), which order eviction (``_evict_for``).

Thread-safe: one lock around every method (it guards the hint table and the quarantine too). ``on_evict``
runs after the lock is released, so it may call back into the store. The bytes of a slot are read and written
outside the lock; the pin is what keeps them in place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.errors import InputError
from kvtier.l1.arena import Arena, align_up
from kvtier.hints import RetentionHint
from kvtier.l1.policies import make_policy
from kvtier.l1.quarantine import Quarantine
from kvtier.l1.retention import Retention

log = logging.getLogger(__name__)

EvictCallback = Callable[[list[tuple[Hashable, Any]]], None]


@dataclass(slots=True)
class _Entry:
    offset: int
    nbytes: int
    meta: Any
    pins: int = 1  # the reservation pin, dropped by commit
    committed: bool = False


class L1Store:
    """Host-memory chunk store with a byte budget.

    Args:
        capacity_bytes: the budget; also the size of the arena (virtual memory, touched lazily).
        policy: eviction policy name, "LRU", "ARC" or "S3FIFO" (ConfigError otherwise).
        shm_name: back the arena with ``/dev/shm/<shm_name>`` so clients can attach it
            (``kvtier.client.dataplane.SharedMapping(shm_name, capacity_bytes)``) and copy through ``offset(key)``.
        replace_shm: unlink a stale ``/dev/shm/<shm_name>`` instead of refusing to start.
        retention: the hint table (``kvtier.l1.retention.Retention`` over ``capacity_bytes``: its shares, TTLs and
            clock); None: one with its defaults.
        arena: an arena of ``capacity_bytes`` to use (the simulator's ``l1.arena.VirtualArena``); None: a new one.

    Keys are any hashable (the cache uses ``kvtier.keys.ChunkKey``); ``meta`` is any object kept with the entry
    and handed back by ``acquire``/``meta``/``on_evict``.

    Attributes:
        arena: the ``Arena`` holding the bytes. shm_name: as given. retention: the hint table.
        on_evict: None or a callable receiving ``[(key, meta), ...]`` of evicted entries, called without the lock
            after the ``reserve`` that evicted them; what it raises is logged, not propagated.
    """

    def __init__(self, capacity_bytes: int, policy: str = "LRU", shm_name: str | None = None,
                 *, replace_shm: bool = False, retention: Retention | None = None, arena: Arena | None = None):
        self._policy = make_policy(policy)
        self.retention = retention if retention is not None else Retention(capacity_bytes)
        self.policy_name = self._policy.name
        self.arena = arena if arena is not None else Arena(capacity_bytes, shm_name, replace=replace_shm)
        self.shm_name = shm_name
        self.on_evict: EvictCallback | None = None
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}
        self._removed: dict[int, _Entry] = {}  # arena offset -> entry removed while pinned, freed by its last release
        self._num_chunks = 0  # committed entries in _entries
        self._quarantine = Quarantine(self.arena)

    def reserve(self, key: Hashable, nbytes: int, meta: Any = None) -> memoryview | None:
        """Allocate a pinned, invisible slot of ``nbytes`` bytes for ``key`` and return its view.

        Evicts unpinned committed entries (policy order) as needed. Returns None, without waiting,
        when the key is already present or reserved, when ``nbytes`` exceeds the capacity, or when
        no slot can be freed. Mutates: the store; may evict (reported through ``on_evict``).

        Raises InputError for an unhashable key or a non-positive / non-int ``nbytes``.
        """
        try:
            hash(key)
        except TypeError:
            raise InputError(f"L1 keys must be hashable, got {type(key).__name__}") from None
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InputError(f"reserve needs a positive int number of bytes, got {nbytes!r}")
        if align_up(nbytes) > self.arena.capacity_bytes // 64 * 64:
            return None
        evicted: list[tuple[Hashable, Any]] = []
        with self._lock:
            if key in self._entries:
                return None
            offset = self.arena.alloc(nbytes)
            if offset is None:
                offset = self._evict_for(nbytes, evicted)
            if offset is not None:
                self._entries[key] = _Entry(offset, nbytes, meta)
                view = self.arena.view(offset, nbytes)
            else:
                view = None
        self._report(evicted)
        return view

    def _evict_for(self, nbytes: int, evicted: list) -> int | None:
        """Evict in ``Retention.eviction_order`` until a slot of ``nbytes`` fits; its offset, or None."""
        need = align_up(nbytes)
        for victim in self.retention.eviction_order(self._policy.victims(), self._pins):
            if self._evict_one(victim, self._entries[victim], evicted) >= need:
                return self.arena.alloc(nbytes)
        return None

    def _pins(self, key: Hashable) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.pins

    def _evict_one(self, victim: Hashable, entry: _Entry, evicted: list) -> int:
        del self._entries[victim]
        self._num_chunks -= 1
        self._policy.remove(victim, evicted=True)
        self.retention.drop(victim)
        evicted.append((victim, entry.meta))
        return self.arena.free(entry.offset)

    def hint(self, keys: Iterable[Hashable], hint: RetentionHint, *, pinned: bool = False) -> tuple[int, int]:
        """Put the committed ``keys`` under ``hint`` (``pinned``: never evicted, no expiry; the management API's
        pin). Returns (keys accepted, keys refused because protected chunks would pass the L1 share). Absent
        keys are skipped. Mutates the retention table only."""
        accepted = refused = 0
        with self._lock:
            for key in keys:
                entry = self._visible(key)
                if entry is None:
                    continue
                if self.retention.set(key, hint, self.arena.block_size(entry.offset), pinned=pinned):
                    accepted += 1
                else:
                    refused += 1
        return accepted, refused

    def unhint(self, keys: Iterable[Hashable]) -> int:
        """Make ``keys`` ordinary eviction candidates again; returns how many had a hint."""
        with self._lock:
            return sum(self.retention.drop(key) for key in keys)

    def session_keys(self, session_id: str) -> list[Hashable]:
        """Committed keys whose retention hint names ``session_id``."""
        with self._lock:
            return [k for k in self.retention.session_keys(session_id) if self._visible(k) is not None]

    def sessions(self) -> dict[str, tuple[int, int]]:
        """session_id -> (chunks, bytes) held in L1 under its hints."""
        with self._lock:
            return self.retention.sessions()

    def retention_of(self, key: Hashable) -> dict | None:
        """The hint of ``key`` as a dict (priority, expires_in_seconds, session_id, pinned), None without one."""
        with self._lock:
            return self.retention.describe(key)

    def commit(self, key: Hashable) -> None:
        """Make a reserved entry visible, unpin it and hand it to the policy.

        Raises InputError when ``key`` is not reserved (never reserved, already committed, aborted).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.committed:
                raise InputError(f"commit({key!r}): no reservation for this key (reserve it first)")
            entry.committed = True
            entry.pins -= 1
            self._num_chunks += 1
            self._policy.insert(key)

    def abort(self, key: Hashable) -> bool:
        """Free a reserved (uncommitted) slot. Returns False when there is no reservation for ``key``.

        Safe to call from error paths. The view returned by ``reserve`` must not be used after.
        """
        with self._lock:
            entry = self._take_reservation(key)
            if entry is not None:
                self.arena.free(entry.offset)
            return entry is not None

    def _take_reservation(self, key: Hashable) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None or entry.committed:
            return None
        return self._entries.pop(key)

    def quarantine(self, key: Hashable) -> int | None:
        """Take the reservation of ``key`` out of the key space but keep its slot allocated; returns a token
        for ``free_quarantined``, or None when ``key`` is not reserved (then nothing changes).

        The slot is never reused until ``free_quarantined(token)``: a late writer still holding its offset can
        only change bytes nobody reads. ``key`` can be reserved again at once (in another slot).
        """
        with self._lock:
            entry = self._take_reservation(key)
            return None if entry is None else self._quarantine.hold(entry.offset)

    def free_quarantined(self, token: int) -> bool:
        """Free the slot of a ``quarantine`` token; False when the token is unknown (already freed)."""
        with self._lock:
            return self._quarantine.free(token)

    @property
    def quarantined_bytes(self) -> int:
        """Bytes (64-aligned) in quarantined slots: allocated, unreadable, waiting for their writer to be gone."""
        with self._lock:
            return self._quarantine.nbytes

    def acquire(self, key: Hashable, count_access: bool = True) -> tuple[memoryview, Any, int] | None:
        """Pin a committed entry and (unless ``count_access`` is False, e.g. for an internal L2 write)
        count an access; returns (view of its bytes, meta, arena offset of its slot) or None.

        Every successful acquire needs one ``release(key, offset)``.
        """
        with self._lock:
            entry = self._visible(key)
            if entry is None:
                return None
            entry.pins += 1
            if count_access:
                self._policy.access(key)
            return self.arena.view(entry.offset, entry.nbytes), entry.meta, entry.offset

    def release(self, key: Hashable, offset: int) -> None:
        """Drop one pin that ``acquire`` took on the slot at ``offset``; frees the slot if the entry was removed
        meanwhile (then ``key`` may name a newer entry in another slot, which keeps its own pins).

        Raises InputError when that slot holds no acquire pin of ``key``.
        """
        with self._lock:
            entry = self._entries.get(key)
            removed = entry is None or entry.offset != offset
            if removed:
                entry = self._removed.get(offset)
            if entry is None or not entry.committed or entry.pins <= 0:
                raise InputError(f"release({key!r}, {offset}) without a matching acquire")
            entry.pins -= 1
            if entry.pins == 0 and removed:
                del self._removed[offset]
                self.arena.free(offset)

    def _visible(self, key: Hashable) -> _Entry | None:
        entry = self._entries.get(key)
        return entry if entry is not None and entry.committed else None

    def contains(self, key: Hashable) -> bool:
        """True when ``key`` is committed and not removed. Does not count an access."""
        return self.leading((key,)) == 1

    def leading(self, keys: Iterable[Hashable]) -> int:
        """How many of ``keys``, from the first, are committed (``contains`` of each, under one lock)."""
        n = 0
        with self._lock:
            for key in keys:  # _visible, inline: a lookup asks this for every chunk of its prompt
                if (entry := self._entries.get(key)) is None or not entry.committed:
                    break
                n += 1
        return n

    def meta(self, key: Hashable) -> Any:
        """The meta of a committed entry, None when absent."""
        with self._lock:
            entry = self._visible(key)
            return None if entry is None else entry.meta

    def offset(self, key: Hashable) -> int | None:
        """Arena offset of the slot of ``key`` (reserved or committed), None when absent.

        For the shared-memory data plane: a client attached to the arena copies at this offset
        while the server holds the pin (reserve or acquire).
        """
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.offset

    def touch(self, keys: Iterable[Hashable]) -> int:
        """Count an access to each committed key, in the given order; returns how many were present.

        The cache passes a prefix's keys tail first, so the head ends up the most recently used.
        """
        touched = 0
        with self._lock:
            for key in keys:
                if self._visible(key) is not None:
                    self._policy.access(key)
                    touched += 1
        return touched

    def remove(self, key: Hashable) -> bool:
        """Delete a committed entry; False when absent. Not reported through ``on_evict``.

        A pinned entry disappears at once (contains/acquire miss, and the key can be reserved again) but its
        slot is freed at the last ``release``.
        """
        with self._lock:
            return self._remove_locked(key)

    def _remove_locked(self, key: Hashable) -> bool:
        entry = self._visible(key)
        if entry is None:
            return False
        self._policy.remove(key)
        self.retention.drop(key)
        self._num_chunks -= 1
        del self._entries[key]
        if entry.pins:
            self._removed[entry.offset] = entry
        else:
            self.arena.free(entry.offset)
        return True

    def clear(self) -> list[Hashable]:
        """Remove every committed entry (as ``remove``); returns their keys. Reservations stay."""
        with self._lock:
            keys = [k for k, e in self._entries.items() if e.committed]
            for key in keys:
                self._remove_locked(key)
            return keys

    def keys(self) -> list[Hashable]:
        """Keys of the committed, visible entries (a snapshot, in no particular order)."""
        with self._lock:
            return [k for k, e in self._entries.items() if e.committed]

    @property
    def used_bytes(self) -> int:
        """Bytes allocated in the arena (committed, reserved, quarantined and removed-but-pinned; 64-aligned)."""
        with self._lock:
            return self.arena.used_bytes

    @property
    def capacity_bytes(self) -> int:
        """The byte budget."""
        return self.arena.capacity_bytes

    @property
    def num_chunks(self) -> int:
        """Number of committed, visible entries."""
        with self._lock:
            return self._num_chunks

    def close(self) -> None:
        """Unmap the arena and, when this store created a ``/dev/shm`` file, unlink it."""
        with self._lock:
            self._entries.clear()
            self._removed.clear()
            self._quarantine.clear()
            self._num_chunks = 0
            self.arena.close()
            self.arena.unlink()

    def _report(self, evicted: list[tuple[Hashable, Any]]) -> None:
        if evicted and (callback := self.on_evict) is not None:
            try:
                callback(evicted)
            except Exception:
                log.exception("L1 on_evict callback failed for %d evicted entries", len(evicted))

