"""L2Writer: the L2 tier's write path, the bounded asynchronous write-through queue and its threads.

A full queue drops the write and counts it (``kvtier_l2_write_dropped_total``); it never blocks the caller.
Each chunk is encoded once per distinct codec of the adapters, on the writer side (never on the engine's store
path), and written to every adapter; what was written joins the adapters' indexes, is counted (writes, encoded
and raw bytes, compression ratio) and its leading run is announced (BlockStored, medium ``STORAGE``). A chunk
whose payload changed after it was committed is never written.

Threads: the writer (``kvtier-l2-writer``) and, with a record key or a codec, two encoders
(``kvtier-l2-encode``); all daemons, so a hung adapter never keeps the process alive. Writes are never urgent:
these threads run at a lower OS priority and start each item when a server's request thread is idle
(``kvtier.foreground``). A clear
(``clear_async``) runs in the writer, after the writes queued before it; while one is pending, ``clearing``
is non-zero (the tier's lookups answer 0 meanwhile: nothing about to be deleted is announced as a hit).

Lock: ``_cond`` guards the queue, the pending count, ``clearing``, the closed flag and the byte totals; it is
never held while an adapter is called. ``clearing`` is read without it (a single int).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from kvtier.codecs.policy import CodecPolicy
from kvtier.errors import KVTierError
from kvtier.foreground import FOREGROUND, background_thread
from kvtier.keys import ChunkKey
from kvtier.l2.base import L2Adapter
from kvtier.l2.index import L2Index
from kvtier.layout import KVLayout
from kvtier.metrics import Metrics
from kvtier.record import RecordKeys, decode_header, encode_record, record_size
from kvtier.medium import Medium

# the tier's logger: these messages are the tier's, under the name operators already filter on
log = logging.getLogger("kvtier.l2.tier")

# (adapter, op, fn, *args, default=...) -> fn(*args), or default after counting and logging the error (L2Tier._call)
Call = Callable[..., object]


@dataclass(slots=True)
class WriteItem:
    """One chunk to write: its key, layout, token ids and payload (a view pinned in L1 until written)."""

    key: ChunkKey
    layout: KVLayout
    token_ids: list[int]
    payload: memoryview
    checksum: int | None = None  # xxh3-64 of the payload when it was committed; None: take it when writing


@dataclass(slots=True)
class ClearJob:
    """A clear queued behind the writes before it (``clear_async``); ``deleted`` is filled by the writer."""

    done: threading.Event
    deleted: int = 0


@dataclass(slots=True)
class _WriteBatch:
    tokens: object  # the prompt's token ids (numpy int64), for events
    items: list[WriteItem]
    release: Callable[[ChunkKey], None]
    event_refs: list | None  # the items' ChunkRefs (kvtier.cache.ChunkRef), for events
    lost: Callable[[int], None] | None = None  # told how many items were not written
    hint: object = None  # kvtier.hints.RetentionHint of the store, for the adapters' capacity eviction


class L2Writer:
    """The queue and writer thread of an ``L2Tier``.

    Args:
        adapters: in cascade order (the tier's list).
        codecs: each adapter's write codec (``CodecPolicy``).
        metrics: where writes, drops, bytes and codec errors are counted.
        events: an EventEmitter (``stored`` with medium ``STORAGE``) or None.
        index: the tier's ``L2Index``, told what each adapter now holds.
        queue_chunks: most chunks waiting to be written; more are dropped and counted.
        record_key: the keys records are signed with (``record.RecordKeys``, or the bytes alone), or None.
        record_auth: the MAC new records are signed with (``record.AUTH_ALGORITHMS``).
        call: runs an adapter operation with errors as a default plus a metric (``L2Tier._call``).
        clear: deletes every adapter's records for a ``ClearJob`` (filling ``deleted``), in the writer thread.
    """

    def __init__(self, adapters: Sequence[L2Adapter], codecs: CodecPolicy, metrics: Metrics, events, index: L2Index,
                 queue_chunks: int, record_key, record_auth: str, call: Call, clear: Callable[[ClearJob], None]):
        self.adapters = list(adapters)
        self.codecs = codecs
        self.metrics = metrics
        self.events = events
        self.index = index
        self.queue_chunks = queue_chunks
        self.record_key = record_key
        self.record_auth = record_auth
        self._call = call
        self._clear = clear
        self.on_changed: Callable[[ChunkKey], None] | None = None  # a chunk's bytes changed after commit
        self._hasher: ThreadPoolExecutor | None = None
        self._bytes: dict[tuple[str, str], list[int]] = {}  # (adapter, codec) -> [encoded, raw] bytes written
        self._queue: deque[_WriteBatch | ClearJob] = deque()
        self.clearing = 0  # clears queued or running: lookups answer 0 meanwhile
        self._pending = 0  # chunks queued or being written
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.adapters:
            self._thread = threading.Thread(target=self._writer, name="kvtier-l2-writer", daemon=True)
            self._thread.start()

    def write_async(self, tokens, items: list[WriteItem], release: Callable[[ChunkKey], None],
                    event_refs: list | None = None, lost: Callable[[int], None] | None = None, hint=None) -> int:
        """Queue ``items`` for every adapter; returns how many were queued (``L2Tier.write_async``)."""
        if not self.adapters or not items:
            for item in items:
                release(item.key)
            return 0
        with self._cond:
            room = 0 if self._closed else max(0, self.queue_chunks - self._pending)
            queued, dropped = items[:room], items[room:]
            if queued:
                self._queue.append(_WriteBatch(tokens, queued, release, event_refs, lost, hint))
                self._pending += len(queued)
                self._cond.notify_all()
        if dropped:
            self.metrics.inc("kvtier_l2_write_dropped_total", len(dropped))
            for item in dropped:
                release(item.key)
            if lost is not None:
                lost(len(dropped))
        return len(queued)

    def clear_async(self) -> ClearJob:
        """Queue a clear behind the writes already queued (``L2Tier.clear_async``)."""
        job = ClearJob(threading.Event())
        with self._cond:
            self._queue.append(job)
            self.clearing += 1
            self._pending += 1  # flush waits for the clear like for a write
            self._cond.notify_all()
        return job

    def flush(self, timeout_seconds: float = 30.0) -> bool:
        """Wait at most ``timeout_seconds`` until every queued write is done. Returns False on timeout."""
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Stop the writer once the queue is empty (at most a second's wait) and the encoders."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._hasher is not None:
            self._hasher.shutdown(wait=False)

    def written_bytes(self) -> list[dict]:
        """Per adapter: ``codec``, ``raw_bytes_written``, ``bytes_written`` (records, headers included) and their
        ``ratio``, since start (``/status``)."""
        with self._cond:
            totals = dict(self._bytes)
        out = []
        for adapter, codec in zip(self.adapters, self.codecs.codecs):
            encoded, raw = totals.get((adapter.label, codec.name), (0, 0))
            out.append({"adapter": adapter.label, "codec": codec.spec, "raw_bytes_written": raw,
                        "bytes_written": encoded, "ratio": round(raw / encoded, 3) if encoded else None})
        return out

    def _writer(self) -> None:
        background_thread()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._queue.popleft()
            if isinstance(batch, ClearJob):  # at once: lookups answer 0 while it is pending
                self._run_clear(batch)
                continue
            try:
                self._write_batch(batch)
            finally:
                for item in batch.items:
                    batch.release(item.key)
                with self._cond:
                    self._pending -= len(batch.items)
                    self._cond.notify_all()

    def _run_clear(self, job: ClearJob) -> None:
        try:
            self._clear(job)
        finally:
            with self._cond:
                self.clearing -= 1
                self._pending -= 1
                self._cond.notify_all()
            job.done.set()

    def _encoded(self, items: list[WriteItem]):
        """Groups of (name, {codec spec: record parts} or None) in item order: each chunk encoded once per distinct
        codec of the adapters, here on the writer side (never on the engine's store path). With a record key or a
        codec the work runs on helper threads (MACs and the codecs' compressors release the GIL) and each group
        is what is ready, so encoding overlaps writing."""
        codecs = self.codecs.distinct()

        def encode(item: WriteItem):  # each item starts while a server's request thread waits (its GIL first)
            FOREGROUND.wait_idle()
            if item.checksum is not None and xxhash.xxh3_64_intdigest(item.payload) != item.checksum:
                return item.key.name(), None  # changed since it was committed: never written
            return item.key.name(), {codec.spec: self._record(item, codec) for codec in codecs}

        slow = RecordKeys.of(self.record_key).signing is not None or any(c.name != "none" for c in codecs)
        if not slow or len(items) < 2:
            yield [encode(item) for item in items]
            return
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(2, thread_name_prefix="kvtier-l2-encode",
                                              initializer=background_thread)
        futures = [self._hasher.submit(encode, item) for item in items]
        i = 0
        while i < len(futures):
            group = [futures[i].result()]
            i += 1
            while i < len(futures) and futures[i].done():
                group.append(futures[i].result())
                i += 1
            yield group

    def _record(self, item: WriteItem, codec) -> list | None:
        started = time.perf_counter()
        try:
            parts = encode_record(item.key, item.layout, item.token_ids, item.payload, self.record_key,
                                  self.record_auth, checksum=item.checksum, codec=codec)
        except KVTierError as exc:  # a lossy codec refusing this KV (NaN, a dtype it cannot take): not written
            log.warning("L2: chunk %s cannot be encoded with %s: %s", item.key.name(), codec.spec, exc)
            self.metrics.inc("kvtier_codec_errors_total", codec=codec.name)
            return None
        if codec.name != "none":
            self.metrics.inc("kvtier_codec_seconds_total", time.perf_counter() - started, codec=codec.name, op="encode")
        return parts

    def _write_batch(self, batch: _WriteBatch) -> None:
        stored: list[bool] = []
        for group in self._encoded(batch.items):
            records = [rec for rec in group if rec[1] is not None]
            done = [False] * len(records)
            for adapter, codec in zip(self.adapters, self.codecs.codecs) if records else ():
                mine = [(i, name, by_codec[codec.spec]) for i, (name, by_codec) in enumerate(records)
                        if by_codec[codec.spec] is not None]
                flags = self._call(adapter, "put", adapter.put, [(n, p) for _, n, p in mine], default=None)
                if flags is None:
                    continue
                self.index.note(adapter, [mine[j][1] for j, ok in enumerate(flags) if ok], True, written=True)
                written = [(i, parts) for (i, _, parts), ok in zip(mine, flags) if ok]
                for i, _ in written:
                    done[i] = True
                self.metrics.inc("kvtier_l2_writes_total", len(written), adapter=adapter.label)
                self._count_bytes(adapter, codec, [parts for _, parts in written])
                if written and batch.hint is not None and batch.hint.protects:
                    self._call(adapter, "retain", adapter.retain, [(records[i][0], record_size(parts))
                                                                    for i, parts in written], batch.hint, default=0)
            flags_in_order = iter(done)
            for name, parts in group:
                if parts is None:
                    self._changed(batch, name)
                stored.append(False if parts is None else next(flags_in_order))
        failed = stored.count(False)
        if failed:
            self.metrics.inc("kvtier_l2_write_dropped_total", failed)
            if batch.lost is not None:
                batch.lost(failed)
        # a clear queued behind this batch deletes what it wrote: not announced (it would stay in routers' views)
        if self.events is not None and batch.event_refs and not self.clearing:
            run = 0  # announce the leading run of written chunks; a gap breaks the prefix chain
            while run < len(stored) and stored[run]:
                run += 1
            if run:
                self.events.stored(batch.tokens, batch.event_refs[:run], Medium.STORAGE)

    def _count_bytes(self, adapter: L2Adapter, codec, records: list[list]) -> None:
        """Encoded and raw bytes written, per adapter and codec, and their ratio over the process lifetime."""
        if not records:
            return
        encoded = sum(record_size(parts) for parts in records)
        raw = sum(decode_header(parts[0])[0].raw_bytes for parts in records)
        labels = {"adapter": adapter.label, "codec": codec.name}
        self.metrics.inc("kvtier_l2_bytes_written_total", encoded, **labels)
        self.metrics.inc("kvtier_l2_raw_bytes_written_total", raw, **labels)
        with self._cond:
            totals = self._bytes.setdefault((adapter.label, codec.name), [0, 0])
            totals[0] += encoded
            totals[1] += raw
            self.metrics.set("kvtier_l2_compression_ratio", totals[1] / max(totals[0], 1), **labels)

    def _changed(self, batch: _WriteBatch, name: str) -> None:
        self.metrics.inc("kvtier_changed_after_commit_total")
        log.error("chunk %s changed after it was committed (a client wrote into its slot late): not written "
                  "to L2 and dropped from L1", name)
        callback = self.on_changed
        if callback is not None:
            for item in batch.items:
                if item.key.name() == name:
                    callback(item.key)
