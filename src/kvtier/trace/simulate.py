"""Replay a trace (``kvtier.trace.format``) through kvtier's own L1 and L2 eviction code at other sizes and policies.

What runs is the server's: ``L1Store`` (its policy, ``LRU`` / ``ARC`` / ``S3FIFO``, its retention hints with the
trace's clock, its first-fit arena allocator and eviction loop) over a ``VirtualArena`` (the allocator over no
memory, so a 1 TB L1 costs only bookkeeping), and the local-disk adapter's ``DiskIndex`` (LRU to capacity, retention hints) with no
files behind it. What this module adds is only the order of calls the server's cache makes for each request
(``KVCache.lookup_tiers``, ``begin_store`` + ``commit_store``, ``begin_retrieve``, ``_promote``; the local-disk
adapter's ``put`` and ``get``), on chunk digests instead of keys:

- lookup: leading chunks L1 holds (``contains``: no access counted), then the leading ones the L2 index holds
- retrieve: a prompt continuing into L2-only chunks promotes them (L2 read: ``touch``; L1 ``reserve`` +
  ``commit``), then the leading L1 chunks are acquired tail first (an access each), and released at the ``end``
  of the record's lease (at once without one)
- prefetch: the promotion alone
- clear: ``L1Store.clear`` and / or every name forgotten from the L2 index
- store: every chunk L1 lacks is reserved in order (stopping at the first that gets no room); at the ``end`` of
  its lease (at once without one) committed tail first, the prompt put under the record's retention hint, and
  each new chunk written to L2 (write-through); or aborted

Hit rate is counted as the server's ``kvtier_lookup_hit_tokens_total`` / ``kvtier_lookup_tokens_total``: leading
tokens found by lookups, by tier, over the tokens looked up. Not modelled: the pin an L2 write in flight holds,
L2 write-queue drops, codecs (L2 holds the raw KV bytes), a cascade of several L2 adapters (one L2 tier), and the
hint a store from ``start`` > 0 puts on the chunks before ``start`` (its record names the chunks from ``start`` on).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.hints import RetentionHint
from kvtier.l1.arena import VirtualArena
from kvtier.l1.retention import Retention
from kvtier.l1.store import L1Store
from kvtier.l2.disk_index import DiskIndex
from kvtier.trace.format import TraceHeader, TraceRecord, read_trace
from kvtier.medium import Medium

_SCOPE = "0" * 16  # DiskIndex names are ChunkKey.name() form: <scope>-<hex>; a digest already covers the scope


def _name(digest: int) -> str:
    return f"{_SCOPE}-{digest:016x}"


@dataclass(frozen=True)
class SimConfig:
    """One configuration to replay: L1 bytes and policy; L2 bytes (None: no L2; 0 is refused by the CLI)."""

    l1_size_bytes: int
    policy: str
    l2_size_bytes: int | None = None


@dataclass
class Outcome:
    """Counts of one replay (or of what the traced server answered: ``traced``). Bytes are KV bytes."""

    lookups: int = 0
    lookup_tokens: int = 0
    l1_hit_tokens: int = 0
    l2_hit_tokens: int = 0
    l1_hit_bytes: int = 0
    l2_hit_bytes: int = 0
    retrieved_bytes: int = 0  # handed out from L1 by retrieves
    promoted_bytes: int = 0  # read from L2 into L1
    stored_bytes: int = 0  # newly stored into L1
    l2_written_bytes: int = 0
    l1_evicted_chunks: int = 0
    l2_evicted_chunks: int = 0
    requests: int = 0

    @property
    def l1_hit_rate(self) -> float:
        return self.l1_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def l2_hit_rate(self) -> float:
        return self.l2_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.l1_hit_rate + self.l2_hit_rate

    def count_lookup(self, record: TraceRecord, chunk_size: int, n1: int, n2: int) -> None:
        first, bpt = record.first, record.bytes_per_token
        self.lookups += 1
        self.lookup_tokens += record.tokens
        l1_tokens = _tokens(record, chunk_size, first, first + n1)
        l2_tokens = _tokens(record, chunk_size, first + n1, first + n1 + n2)
        self.l1_hit_tokens += l1_tokens
        self.l2_hit_tokens += l2_tokens
        self.l1_hit_bytes += l1_tokens * bpt
        self.l2_hit_bytes += l2_tokens * bpt

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(hit_rate=self.hit_rate, l1_hit_rate=self.l1_hit_rate, l2_hit_rate=self.l2_hit_rate)
        return out


def _tokens(record: TraceRecord, chunk_size: int, start: int, stop: int) -> int:
    """Tokens in absolute chunks ``start`` .. ``stop - 1`` of the record's prompt (the last chunk may be partial)."""
    if stop <= start:
        return 0
    return min(stop * chunk_size, record.tokens) - start * chunk_size


@dataclass
class Replay:
    """The tiers of one configuration, fed record by record (``apply``)."""

    header: TraceHeader
    config: SimConfig
    outcome: Outcome = field(default_factory=Outcome)
    now: float = 0.0
    seconds: float = 0.0  # time spent in apply

    def __post_init__(self) -> None:
        cap = self.config.l1_size_bytes
        h = self.header
        retention = Retention(cap, h.l1_retention_max_share, h.session_ttl_seconds, lambda: self.now)
        self.l1 = L1Store(cap, self.config.policy, arena=VirtualArena(cap), retention=retention)
        self.l1.on_evict = self._l1_evicted
        l2 = self.config.l2_size_bytes
        self.l2 = None if l2 is None else DiskIndex("/nonexistent", 0, l2, "0" * 8, lambda path: True,
                                                    lambda path, mode, want: None, clock=lambda: self.now)
        self._ops = {"lookup": self._lookup, "retrieve": self._retrieve, "prefetch": self._promote_from,
                     "store": self._store, "end": self._end, "clear": self._clear}
        self._leases: dict[int, tuple] = {}  # trace ticket -> ("store", record, reserved) | ("retrieve", pins)

    def _l1_evicted(self, evicted: list) -> None:
        self.outcome.l1_evicted_chunks += len(evicted)

    def apply(self, record: TraceRecord) -> None:
        """Replay one request. Mutates the tiers and the outcome."""
        started = time.perf_counter()
        self.now = record.t
        self.outcome.requests += 1
        self._ops[record.op](record)
        self.seconds += time.perf_counter() - started

    def _l1_prefix(self, chunks: list[int]) -> int:
        contains = self.l1.contains
        n = 0
        while n < len(chunks) and contains(chunks[n]):
            n += 1
        return n

    def _l2_prefix(self, chunks: list[int], start: int) -> int:
        if self.l2 is None:
            return 0
        n = start
        while n < len(chunks) and _name(chunks[n]) in self.l2:
            n += 1
        return n - start

    def _lookup(self, record: TraceRecord) -> None:
        n1 = self._l1_prefix(record.chunks)
        self.outcome.count_lookup(record, self.header.chunk_size, n1, self._l2_prefix(record.chunks, n1))

    def _chunk_bytes(self, record: TraceRecord, i: int) -> int:
        """Bytes of ``record.chunks[i]``: a full chunk's, or the partial last one's."""
        c = self.header.chunk_size
        end = (record.first + i + 1) * c
        return (c if end <= record.tokens else record.tokens - end + c) * record.bytes_per_token

    def _promote_from(self, record: TraceRecord, n: int | None = None) -> int:
        """``KVCache.prefetch`` / ``_promote``: copy the leading L2 hits past L1's prefix into L1; returns L1's
        prefix after it."""
        chunks = record.chunks
        n = self._l1_prefix(chunks) if n is None else n
        held = self._l2_prefix(chunks, n)
        if not held:
            return n
        for i in range(n, n + held):  # the adapter's get: each record read becomes the most recently used
            self.l2.touch(_name(chunks[i]))
        l1, count = self.l1, 0
        for i in range(n, n + held):
            nbytes = self._chunk_bytes(record, i)
            if l1.reserve(chunks[i], nbytes) is None:
                if not l1.contains(chunks[i]):
                    break
            else:
                l1.commit(chunks[i])
                self.outcome.promoted_bytes += nbytes
            count += 1
        return n + count

    def _retrieve(self, record: TraceRecord) -> None:
        n = self._promote_from(record)
        l1, pins = self.l1, []
        for i in range(n - 1, -1, -1):  # tail first, so the head ends up most recently used
            got = l1.acquire(record.chunks[i])
            if got is not None:
                pins.append((record.chunks[i], got[2]))
                self.outcome.retrieved_bytes += self._chunk_bytes(record, i)
        if record.ticket:  # pinned until its lease ends (the client copies through shared memory meanwhile)
            self._leases[record.ticket] = ("retrieve", pins)
        else:
            self._unpin(pins)

    def _unpin(self, pins: list) -> None:
        for key, offset in pins:
            self.l1.release(key, offset)

    def _end(self, record: TraceRecord) -> None:
        lease = self._leases.pop(record.ticket, None)
        if lease is None:  # its start was not recorded (dropped, or before the trace)
            return
        if lease[0] == "retrieve":
            self._unpin(lease[1])
        elif record.ok:
            self._commit(lease[1], lease[2])
        else:
            for i, _ in lease[2]:
                self.l1.abort(lease[1].chunks[i])

    def _store(self, record: TraceRecord) -> None:
        l1, chunks = self.l1, record.chunks
        reserved = []
        for i, key in enumerate(chunks):
            if l1.contains(key):
                continue
            nbytes = self._chunk_bytes(record, i)
            if l1.reserve(key, nbytes) is None:
                if l1.contains(key):
                    continue
                break
            reserved.append((i, nbytes))
        if record.ticket:  # reserved (pinned, invisible) until its lease ends
            self._leases[record.ticket] = ("store", record, reserved)
        else:
            self._commit(record, reserved)

    def _commit(self, record: TraceRecord, reserved: list[tuple[int, int]]) -> None:
        """``KVCache.commit_store``: the reserved chunks become visible, the hint applies, L2 is written."""
        l1, chunks = self.l1, record.chunks
        for i, _ in reversed(reserved):  # tail committed first: the policy evicts tails before heads
            l1.commit(chunks[i])
        hint = _hint(record)
        if hint is not None:
            l1.hint(chunks, hint)
        for i, nbytes in reserved:
            self.outcome.stored_bytes += nbytes
            if self.l2 is not None and self._l2_put(_name(chunks[i]), nbytes) and hint is not None:
                self.l2.retention.set(_name(chunks[i]), hint, nbytes)  # the writer's L2Adapter.retain

    def _clear(self, record: TraceRecord) -> None:
        """``Tiers.clear``: L1's committed chunks (reservations stay), L2's index, or both."""
        if record.medium in (None, Medium.CPU):
            self.l1.clear()
        if record.medium in (None, Medium.STORAGE) and self.l2 is not None:
            for name in self.l2.names():
                self.l2.forget(name)

    def _l2_put(self, name: str, nbytes: int) -> bool:
        """``LocalDiskAdapter._put_one`` on the index alone: a record already there is touched, else room is made;
        whether it is held now."""
        l2 = self.l2
        if name in l2:
            l2.touch(name)
            return True
        fits, evicted = l2.reserve(nbytes)
        self.outcome.l2_evicted_chunks += len(evicted)
        if fits:
            l2.written(name, nbytes)
            self.outcome.l2_written_bytes += nbytes
        return fits

    def close(self) -> None:
        self.l1.close()


def _hint(record: TraceRecord) -> RetentionHint | None:
    session = record.session[2:] if record.session.startswith("s:") else None
    hint = RetentionHint(record.priority, record.ttl_seconds, session)
    return hint if hint.protects else None


@dataclass
class Simulation:
    """Result of ``simulate``: the trace's header, what its server answered (``traced``, from the records' hits),
    and one (config, outcome, seconds in apply) per configuration."""

    header: TraceHeader
    traced: Outcome
    results: list[tuple[SimConfig, Outcome, float]]
    records: int
    requests: int  # the records that are not the end of a lease
    seconds: float

    def as_dict(self) -> dict:
        return {"trace": {"records": self.records, "requests": self.requests, "chunk_size": self.header.chunk_size,
                          "l1_size_bytes": self.header.l1_size_bytes, "eviction_policy": self.header.eviction_policy,
                          "l2": self.header.l2, "traced": self.traced.as_dict()},
                "seconds": self.seconds,
                "results": [{**asdict(cfg), **out.as_dict(), "seconds": secs} for cfg, out, secs in self.results]}


def simulate(path: str | Path, configs: list[SimConfig]) -> Simulation:
    """Replay the trace at ``path`` once through every configuration (in lockstep: the file is read once).

    Raises TraceError (an InputError) naming the line of a bad header or record, ConfigError for an unknown
    policy, OSError for a file that cannot be read.
    """
    started = time.perf_counter()
    header, records = read_trace(path)
    replays = [Replay(header, cfg) for cfg in configs]
    traced = Outcome()
    count = requests = 0
    try:
        for _, record in records:
            count += 1
            requests += record.op != "end"
            if record.op == "lookup":
                n1, n2 = (record.hits + [0, 0])[:2]
                traced.count_lookup(record, header.chunk_size, n1, n2)
            for replay in replays:
                replay.apply(record)
    finally:
        for replay in replays:
            replay.close()
    return Simulation(header, traced, [(r.config, r.outcome, r.seconds) for r in replays], count,
                      requests, time.perf_counter() - started)
