"""Eviction policies for L1: LRU, ARC and S3-FIFO, over keys only (sizes live in the store).

Every policy has the same small interface, called by ``L1Store`` under its lock (policies are not
thread-safe on their own):

* ``insert(key)``: a key became resident (committed). Inserting a resident key counts as an access.
* ``access(key)``: a resident key was used (acquire, touch). Unknown keys are ignored.
* ``remove(key, evicted=False)``: a key left residency. ``evicted=True`` means the store evicted it
  (ARC and S3-FIFO then remember it in a ghost list); False is an explicit delete (forgotten
  entirely, ghosts included).
* ``victims()``: a generator of resident keys in the order they should be evicted. The caller may
  call ``remove(k, evicted=True)`` on the key just yielded before advancing; a yielded key that is
  still resident when the generator advances was skipped (pinned: it is being read) and is rotated
  to the back of its queue, as if just used. Each key is yielded at most once per generator, so a
  pass ends after at most every resident key. Advancing may reorganise the policy (S3-FIFO
  promotions and reinsertions happen lazily, at eviction time, as in the paper).

Sizes in entries: ARC's target ``p`` and the S3-FIFO small-queue share need the cache size in
entries, but L1 has a byte budget and variable chunk sizes. We use the high-water mark of the number
of resident keys, which settles at the number of chunks that fit. Ghost lists are bounded by it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from kvtier.errors import ConfigError


class _Policy:
    name = "?"

    def __init__(self) -> None:
        self._max_resident = 1

    def _grew(self, resident: int) -> None:
        if resident > self._max_resident:
            self._max_resident = resident

    def __len__(self) -> int:  # number of resident keys
        raise NotImplementedError

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError


def _head(queue: OrderedDict) -> Hashable:
    return next(iter(queue))


class LRU(_Policy):
    """Least recently used first. All operations O(1) (OrderedDict)."""

    name = "LRU"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # head = least recently used

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable, evicted: bool = False) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        skipped = 0
        while len(self._order) > skipped:  # skipped keys sit at the tail, in order
            key = _head(self._order)
            yield key
            if key in self._order:
                self._order.move_to_end(key)
                skipped += 1


class ARC(_Policy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    T1: resident keys seen once recently; T2: resident keys seen at least twice; B1/B2: ghosts of
    keys evicted from T1/T2. ``p`` is the adaptive target size of T1 (in entries): a ghost hit in
    B1 (we evicted a recency key too early) grows it, one in B2 shrinks it. A one-time scan fills T1
    and is evicted from T1 while T2 (the keys used twice) survives.

    Differences from the paper, forced by the store's flow (reserve, evict, then commit): the
    ghost-hit adaptation of ``p`` happens at ``insert`` (after the eviction that made room), and the
    cache size ``c`` is the high-water mark of resident keys. All operations O(1).
    """

    name = "ARC"

    def __init__(self) -> None:
        super().__init__()
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.t1 or key in self.t2

    def insert(self, key: Hashable) -> None:
        if key in self.t1 or key in self.t2:
            self.access(key)
            return
        c = self._max_resident
        if key in self.b1:  # evicted from T1 too early: favour recency
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # evicted from T2 too early: favour frequency
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._grew(len(self))
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        # The paper's invariants: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.
        c = self._max_resident
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def access(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Hashable, evicted: bool = False) -> None:
        if key in self.t1:
            del self.t1[key]
            if evicted:
                self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            if evicted:
                self.b2[key] = None
        else:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            return
        self._trim_ghosts()

    def victims(self) -> Iterator[Hashable]:
        skipped1 = skipped2 = 0
        while True:
            avail1, avail2 = len(self.t1) - skipped1, len(self.t2) - skipped2
            if avail1 <= 0 and avail2 <= 0:
                return
            # REPLACE: take T1's LRU while T1 exceeds its target p, else T2's LRU.
            from_t1 = avail1 > 0 and (len(self.t1) > self.p or avail2 <= 0)
            queue = self.t1 if from_t1 else self.t2
            key = _head(queue)
            yield key
            if key in queue:
                queue.move_to_end(key)
                if from_t1:
                    skipped1 += 1
                else:
                    skipped2 += 1


class S3FIFO(_Policy):
    """S3-FIFO (Yang et al., SOSP 2023): small FIFO S (~10% of entries), main FIFO M, ghost G.

    New keys enter S (or M if G remembers them). Accesses bump a frequency counter capped at 3.
    Eviction from S: a key accessed since insertion moves to M (counter reset), otherwise it is
    evicted and remembered in G, so one-hit wonders leave quickly. Eviction from M is
    FIFO-reinsertion: a key with counter > 0 goes back to the tail with counter - 1. G holds at most
    as many keys as the cache (high-water resident count). Amortised O(1) per operation.
    """

    name = "S3FIFO"
    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self) -> None:
        super().__init__()
        self.small: OrderedDict[Hashable, int] = OrderedDict()  # key -> frequency, head = oldest
        self.main: OrderedDict[Hashable, int] = OrderedDict()
        self.ghost: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.small or key in self.main

    def _small_target(self) -> int:
        return max(1, int(self._max_resident * self.SMALL_FRACTION))

    def insert(self, key: Hashable) -> None:
        if key in self.small or key in self.main:
            self.access(key)
            return
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = 0
        else:
            self.small[key] = 0
        self._grew(len(self))

    def access(self, key: Hashable) -> None:
        if key in self.small:
            self.small[key] = min(self.small[key] + 1, self.MAX_FREQ)
        elif key in self.main:
            self.main[key] = min(self.main[key] + 1, self.MAX_FREQ)

    def remove(self, key: Hashable, evicted: bool = False) -> None:
        if key in self.small:
            del self.small[key]
            if evicted:
                self.ghost[key] = None
                while len(self.ghost) > self._max_resident:
                    self.ghost.popitem(last=False)
        elif key in self.main:
            del self.main[key]
        else:
            self.ghost.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        skipped_small: set[Hashable] = set()
        skipped_main: set[Hashable] = set()
        while True:
            avail_small = len(self.small) - len(skipped_small)
            avail_main = len(self.main) - len(skipped_main)
            if avail_small <= 0 and avail_main <= 0:
                return
            if avail_small > 0 and (len(self.small) >= self._small_target() or avail_main <= 0):
                key = _head(self.small)  # skipped keys are rotated behind all unskipped ones
                if self.small[key] > 0 and key not in skipped_small:
                    del self.small[key]
                    self.main[key] = 0  # promotion (lazy: only when it reaches the head of S)
                    continue
                yield key
                if key in self.small:
                    self.small.move_to_end(key)
                    skipped_small.add(key)
            else:
                key = _head(self.main)
                freq = self.main[key]
                if key in skipped_main or freq > 0:  # reinsertion; skipped keys just rotate
                    self.main.move_to_end(key)
                    if key not in skipped_main:
                        self.main[key] = freq - 1
                    continue
                yield key
                if key in self.main:
                    self.main.move_to_end(key)
                    skipped_main.add(key)


POLICIES: dict[str, type[_Policy]] = {"LRU": LRU, "ARC": ARC, "S3FIFO": S3FIFO}


def make_policy(name: str) -> LRU | ARC | S3FIFO:
    """A new policy from its name: "LRU", "ARC", "S3FIFO" (case-insensitive; "S3-FIFO" accepted).

    Raises ConfigError listing the valid names for anything else.
    """
    canonical = name.upper().replace("-", "").replace("_", "") if isinstance(name, str) else None
    if canonical not in POLICIES:
        raise ConfigError(f"unknown eviction policy {name!r}; valid: {', '.join(POLICIES)}")
    return POLICIES[canonical]()
