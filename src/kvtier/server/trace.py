"""TraceRecorder: the server writes what it is asked to a trace file (``kvtier.trace.format``), off the request path.

On (``server.trace_file``), each handled lookup, retrieve, prefetch and store becomes one record, and so does the end
of each lease a store or retrieve holds (``end``: committed or aborted, unpinned), so a replay reserves, pins and
evicts when the server did. The request thread only stamps the time and puts a tuple of what it already holds (the
request, its cache, the hit counts) on a bounded queue (``server.trace_queue_size``); a full queue drops the record
and counts it (``kvtier_trace_records_dropped_total{reason="queue_full"}``): a request never waits for the trace. The
writer thread names the prompt's chunks (``KVCache.chunk_refs``, usually from the lookup memo), digests their keys
(``format.chunk_digest``), encodes the line and appends it, waking at most every 50 ms with what came meanwhile (a
wake-up per record took the GIL from the request thread often enough to cost lookups 13 %; batched, 1-2 %). The file
is bounded: the header and the records together never pass ``server.trace_max_bytes``; past it records are dropped and
counted (``reason="size_limit"``), so the file is always whole lines and a valid trace. ``close`` writes what is
queued and closes the file.

Off, every method returns at once (one attribute test).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import xxhash

from kvtier import protocol as P
from kvtier.errors import ConfigError
from kvtier.keys import scope_of
from kvtier.metrics import Metrics
from kvtier.units import GB, parse_size
from kvtier.trace.format import FIELDS, FORMAT, VERSION, TraceHeader, TraceRecord, chunk_digest, encode_line

log = logging.getLogger(__name__)
_STOP = object()
_BATCH = 4096  # records encoded per write
_GATHER_SECONDS = 0.05  # the writer waits this long after a record for more, then writes them together


class TraceRecorder:
    """Records requests to ``config.server.trace_file`` (nothing when it is None).

    Args:
        config: the server's configuration (``server.trace_*``, and the chunk, L1 and L2 settings for the header).
        metrics: where written and dropped records and the file's bytes are counted.

    Raises:
        ConfigError: the file cannot be created, or ``trace_max_bytes`` cannot hold the header.
    """

    def __init__(self, config, metrics: Metrics):
        srv = config.server
        self.metrics = metrics
        self.enabled = srv.trace_file is not None
        self.path = srv.trace_file
        self.max_bytes = srv.trace_max_bytes
        self.token_ids = srv.trace_token_ids
        self.chunk_size = config.chunk_size
        self.full = False  # trace_max_bytes reached: later records are counted, not queued
        self._started = time.monotonic()
        self._scopes: dict[tuple, str] = {}
        self._open: dict[int, int] = {}  # id() of the ticket of a live lease -> its number in the trace
        self._next_ticket = 0
        self._queue: queue.Queue = queue.Queue(srv.trace_queue_size)
        self._thread: threading.Thread | None = None
        if not self.enabled:
            return
        line = encode_line(_header(config))
        if len(line) > self.max_bytes:
            raise ConfigError(f"server.trace_max_bytes ({self.max_bytes}) cannot hold the trace header "
                              f"({len(line)} bytes); raise it (e.g. --trace-max-bytes 1GB)")
        try:
            self._fh = open(self.path, "wb")  # noqa: SIM115 -- the writer thread owns it until close()
        except OSError as exc:
            raise ConfigError(f"cannot create the trace file {self.path} (--trace-file): {exc.strerror}") from exc
        self._fh.write(line)
        self._fh.flush()
        self.bytes = len(line)
        metrics.set("kvtier_trace_bytes", self.bytes)
        self._thread = threading.Thread(target=self._writer, name="kvtier-trace", daemon=True)
        self._thread.start()

    # ---- the request thread's calls ---------------------------------------------------------------
    def lookup(self, identity: bytes, session, msg: P.Lookup, reply) -> None:
        """A lookup was answered with ``reply`` (``LookupReply``: tokens held, tokens held in L1)."""
        if self.enabled and isinstance(reply, P.LookupReply):
            self._put(("lookup", identity, session, msg, (reply.num_l1_tokens, reply.num_tokens)))

    def retrieve(self, identity: bytes, session, msg: P.RetrieveBegin, ticket, pending: bool) -> None:
        """A retrieve pinned the leading chunks ``ticket`` (``RetrieveTicket``) holds in L1, after any promotion from
        L2; ``pending``: they stay pinned until ``end(ticket)`` (a shared-memory lease), else released at once."""
        if self.enabled:
            self._put(("retrieve", identity, session, msg, (self._open_ticket(ticket, pending), len(ticket.slots))))

    def prefetch(self, identity: bytes, session, msg: P.Prefetch, num_chunks: int) -> None:
        """A prefetch left ``num_chunks`` leading chunks in L1."""
        if self.enabled:
            self._put(("prefetch", identity, session, msg, num_chunks))

    def store(self, identity: bytes, session, ticket, pending: bool) -> None:
        """A store reserved the slots of ``ticket`` (``StoreTicket``: the prompt's refs, hint and slots); ``pending``:
        they become visible at ``end(ticket, ok)`` (a lease), else they were committed at once."""
        if self.enabled:
            self._put(("store", identity, session, ticket, (self._open_ticket(ticket, pending), len(ticket.slots),
                                                            ticket.nbytes)))

    def end(self, ticket, ok: bool) -> None:
        """The lease of a pending store (committed if ``ok``, else aborted) or retrieve (unpinned) ended."""
        if self.enabled:
            number = self._open.pop(id(ticket), None)
            if number is not None:
                self._put(("end", b"", None, None, (number, ok)))

    def clear(self, medium: str | None) -> None:
        """The server dropped every chunk of L1 (``"CPU"``), L2 (``"STORAGE"``) or both (None)."""
        if self.enabled:
            self._put(("clear", b"", None, None, medium))

    def _open_ticket(self, ticket, pending: bool) -> int:
        """The trace's number for a lease on ``ticket`` (0: none); the ticket object lives as long as its lease."""
        if not pending:
            return 0
        self._next_ticket += 1
        self._open[id(ticket)] = self._next_ticket
        return self._next_ticket

    def _put(self, item: tuple) -> None:
        if self.full:
            self.metrics.inc("kvtier_trace_records_dropped_total", reason="size_limit")
            return
        try:
            self._queue.put_nowait((time.monotonic() - self._started, *item))
        except queue.Full:
            self.metrics.inc("kvtier_trace_records_dropped_total", reason="queue_full")

    # ---- the writer thread ------------------------------------------------------------------------
    def _writer(self) -> None:
        while True:
            batch = [self._queue.get()]
            if batch[0] is not _STOP:  # gather a batch: fewer wake-ups taking the GIL from the request thread
                time.sleep(_GATHER_SECONDS)
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            self._write([item for item in batch if item is not _STOP])
            if stop:
                return

    def _write(self, batch: list[tuple]) -> None:
        lines, written = [], 0
        for item in batch:
            try:
                line = encode_line(self._record(*item))
            except Exception:  # noqa: BLE001 -- a record that cannot be made must not stop the trace
                log.exception("trace record of a %s could not be made", item[1])
                self.metrics.inc("kvtier_trace_records_dropped_total", reason="error")
                continue
            if self.full or self.bytes + len(line) > self.max_bytes:
                if not self.full:
                    log.warning("trace %s reached server.trace_max_bytes (%d): later requests are not recorded",
                                self.path, self.max_bytes)
                self.full = True
                self.metrics.inc("kvtier_trace_records_dropped_total", reason="size_limit")
                continue
            lines.append(line)
            self.bytes += len(line)
            written += 1
        if lines:
            self._fh.write(b"".join(lines))
            self._fh.flush()  # whole lines on disk: a trace read while the server runs ends at a line
            self.metrics.inc("kvtier_trace_records_total", written)
            self.metrics.set("kvtier_trace_bytes", self.bytes)

    def _record(self, t: float, op: str, identity: bytes, session, what, result) -> TraceRecord:
        if op == "end":
            return TraceRecord(t=round(t, 6), op=op, ticket=result[0], ok=result[1])
        if op == "clear":
            return TraceRecord(t=round(t, 6), op=op, medium=result)
        cache = session.cache
        layout = cache.layout
        if op == "store":
            ticket, hint = what, what.hint
            tokens, refs = ticket.tokens, ticket.refs
            first = refs[0].index if refs else 0
        else:
            hint = None
            tokens, refs = session.chunk_refs(what)
            first = getattr(what, "start", 0) // self.chunk_size
            refs = refs[first:]
        record = TraceRecord(t=round(t, 6), op=op, tokens=len(tokens), first=first, chunks=self._digests(refs),
                             bytes_per_token=layout.bytes_per_token,
                             session="s:" + hint.session_id if hint is not None and hint.session_id else _client(identity))
        if op == "lookup":
            l1_tokens, total = result
            n1 = sum(1 for r in refs if r.end <= l1_tokens)
            n = sum(1 for r in refs if r.end <= total)
            record.hits = [n1, n - n1]
            record.bytes = sum(r.end - r.start for r in refs[:n]) * layout.bytes_per_token
        elif op == "store":
            record.ticket, record.stored, record.bytes = result
            if hint is not None:
                record.priority, record.ttl_seconds = hint.priority, hint.ttl_seconds
        else:
            if op == "retrieve":
                record.ticket, result = result
            record.hits = [result, 0]
            record.bytes = sum(r.end - r.start for r in refs[:result]) * layout.bytes_per_token
        if self.token_ids:
            record.token_ids = tokens.tolist()
        return record

    def _digests(self, refs) -> list[int]:
        out = []
        for ref in refs:
            key = ref.key
            part = (key.model, key.layout_id, key.namespace)
            scope = self._scopes.get(part)
            if scope is None:
                scope = self._scopes[part] = scope_of(*part)
            out.append(chunk_digest(scope, key.prefix_hash))
        return out

    def close(self, timeout_seconds: float = 10.0) -> None:
        """Write what is queued (at most ``timeout_seconds``) and close the file. Idempotent."""
        if self._thread is None:
            return
        thread, self._thread = self._thread, None
        try:
            self._queue.put(_STOP, timeout=timeout_seconds)
        except queue.Full:
            log.warning("trace %s: writer did not drain its queue in %.0f s", self.path, timeout_seconds)
        thread.join(timeout_seconds)
        if not thread.is_alive():
            self._fh.close()


def _client(identity: bytes) -> str:
    return "c:" + xxhash.xxh3_64_hexdigest(identity)[:12]


def _header(config) -> TraceHeader:
    l2 = [{"type": spec.get("type"), "capacity_bytes": _capacity(spec)} for spec in config.l2_adapters]
    return TraceHeader(format=FORMAT, version=VERSION, created_unix_seconds=round(time.time(), 3),
                       chunk_size=config.chunk_size, block_size=config.effective_block_size,
                       save_unfull_chunk=config.save_unfull_chunk, l1_size_bytes=config.l1_size_bytes,
                       eviction_policy=config.eviction_policy, l1_retention_max_share=config.l1_retention_max_share,
                       session_ttl_seconds=config.session_ttl_seconds, l2=l2,
                       token_ids=config.server.trace_token_ids, fields=FIELDS)


def _capacity(spec: dict) -> int | None:
    size = spec.get("size_gb")
    return None if size is None else round(parse_size(size) * GB)
