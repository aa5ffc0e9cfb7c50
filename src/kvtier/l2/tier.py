"""L2Tier: the adapters behind L1, in cascade order.

Owns what every adapter shares: record verification and authentication (a bad or forged record is a
miss, deleted and counted),
prefix semantics on reads (stop at the first missing chunk), error-to-miss conversion with
``kvtier_l2_errors_total``, and the bounded asynchronous write-through queue (a full queue drops
the write and counts it; it never blocks the caller).

In a server (``index_lookups``) lookups never do I/O: ``lookup`` answers from the adapters' in-memory indexes
(``l2.index.L2Index``, which also probes in the background for records other writers stored), so a slow or
hung adapter cannot stall the request thread. ``read`` (promotion) does real I/O and belongs off that thread.

Threads: the writer (``kvtier-l2-writer``), the prober and, with a record key, two signers; all daemons, so a
hung adapter never keeps the process alive. ``clear_async`` runs in the writer, after the writes queued before
it; while one is pending, lookups answer 0 (nothing about to be deleted is announced as a hit).

This module holds the read side (lookups, verified reads, promotion), removal and status; the write path (the
queue, the writer and encoder threads, encoding and byte accounting) is ``l2.writer.L2Writer``, which the tier
composes. The tier takes no lock of its own: the queue's lock is the writer's, the index's is ``L2Index``'s, and
``_refusal_logged`` is a one-way flag (at worst a racing read logs the warning twice).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.codecs import get_codec
from kvtier.codecs.policy import CodecPolicy
from kvtier.errors import ConfigError, KVTierError, CorruptRecordError, ForeignRecordError, RecordAuthError, UnknownCodecError
from kvtier.keys import ChunkKey
from kvtier.l2.base import L2Adapter
from kvtier.l2.index import L2Index
from kvtier.l2.writer import ClearJob, L2Writer, WriteItem  # WriteItem: callers import it from here (cache.cache)
from kvtier.metrics import Metrics
from kvtier.record import RecordKeys, decode_payload, decode_record
from kvtier.medium import Medium

log = logging.getLogger(__name__)


class _LossyRefused(KVTierError):
    """A record in a lossy codec its model may not be served from (``lossy_codecs_allowed``)."""


class L2Payload:
    """One verified chunk ``read`` found: raw KV bytes, or a record's encoded bytes that are decoded only when the
    caller has room for them, straight into that room (an L1 slot), so a decoded chunk is never copied again.

    Attributes:
        nbytes: the chunk's bytes once decoded (``layout.chunk_bytes(num_tokens)``).
        name, record, adapter_index: its L2 name, the whole record as read, the index of the adapter it came from.
    """

    __slots__ = ("_tier", "_adapter", "name", "_header", "_payload", "record", "adapter_index", "nbytes")

    def __init__(self, tier: L2Tier, adapter: L2Adapter, name: str, header, payload, record, adapter_index: int):
        self._tier, self._adapter, self.name, self._header, self._payload = tier, adapter, name, header, payload
        self.record, self.adapter_index = record, adapter_index
        self.nbytes = header.raw_bytes

    def copy_into(self, view) -> bool:
        """Write the chunk into ``view`` (a writable buffer of ``nbytes``), decoding it there when encoded (on the
        caller's thread: the promotion pool's). False when the record does not decode: then it is deleted from
        its adapter and counted (``kvtier_corrupt_records_total``), and ``view`` holds no chunk."""
        target = np.frombuffer(view, np.uint8)
        if not self._header.encoded:
            # numpy copies without the GIL: a server's request thread keeps running during a promotion
            np.copyto(target, np.frombuffer(self._payload, np.uint8))
            return True
        started = time.perf_counter()
        try:
            decode_payload(self._header, self._payload, out=target)
        except CorruptRecordError as exc:
            self._tier.drop_corrupt(self._adapter, self.name, exc)
            return False
        self._tier.metrics.inc("kvtier_codec_seconds_total", time.perf_counter() - started,
                               codec=self._header.encoding, op="decode")
        return True


class L2Tier:
    """Cascade of L2 adapters with verified reads and bounded asynchronous writes.

    Args:
        adapters: in cascade order (fastest first).
        metrics: where errors, drops, writes and corrupt records are counted.
        events: an EventEmitter (``stored``/``removed`` with medium ``STORAGE``) or None.
        queue_chunks: most chunks waiting to be written; more are dropped and counted.
        record_key: the keys records are signed and checked with (``record.RecordKeys``, or the
            ``l2_record_key`` bytes alone), or None.
        record_auth: the MAC new records are signed with (``record.AUTH_ALGORITHMS``).
        codecs: the ``kvtier.codecs.policy.CodecPolicy`` (each adapter's write codec, the lossy codecs each model
            may be served from); None: every adapter's ``config.codec``, lossless only.
        index_lookups: answer ``lookup`` from the in-memory indexes only (the server: its request thread must
            never wait for an adapter); False (in process): ask the adapters (``contains``), so a record another
            process just wrote (vLLM's scheduler and worker each open a cache over one folder) counts at once.
    """

    def __init__(self, adapters: Sequence[L2Adapter], metrics: Metrics, events=None,
                 queue_chunks: int = 64, record_key: bytes | None = None,
                 record_auth: str = "blake3", index_lookups: bool = False, codecs: CodecPolicy | None = None):
        self.adapters = list(adapters)
        self.codecs = codecs or CodecPolicy([getattr(a.config, "codec", "none") for a in self.adapters],
                                            labels=[a.label for a in self.adapters])
        self.metrics = metrics
        self.events = events
        self.record_key = record_key
        self.record_auth = record_auth
        if RecordKeys.of(record_key).any and record_auth == "blake3":
            try:
                import blake3  # noqa: F401 -- fail at startup, not in the writer thread
            except ImportError as exc:
                raise ConfigError("l2_record_auth 'blake3' needs the blake3 package (pip install blake3); "
                                  "or set l2_record_auth: hmac-sha256") from exc
        self._refusal_logged = False  # one warning for records kept but not servable; the metrics count them all
        self.index = L2Index(self.adapters, metrics, self._per_name)
        self.index_lookups = index_lookups
        for adapter in self.adapters:
            adapter.on_evict = lambda names, a=adapter: self._on_adapter_evict(a, names)
            adapter.on_errors = lambda op, n, a=adapter: self.metrics.inc("kvtier_l2_errors_total", n, adapter=a.label, op=op)
        self._writes = L2Writer(self.adapters, self.codecs, metrics, events, self.index, queue_chunks, record_key,
                                record_auth, call=self._call, clear=self._run_clear)

    @property
    def queue_chunks(self) -> int:
        """Most chunks waiting to be written; more are dropped and counted."""
        return self._writes.queue_chunks

    @property
    def on_changed(self) -> Callable[[ChunkKey], None] | None:
        """Told the key of a chunk whose bytes changed after commit (not written to L2)."""
        return self._writes.on_changed

    @on_changed.setter
    def on_changed(self, callback: Callable[[ChunkKey], None] | None) -> None:
        self._writes.on_changed = callback

    # ---- reads -------------------------------------------------------------------------
    def _call(self, adapter: L2Adapter, op: str, fn, *args, default=None):
        try:
            return fn(*args)
        except Exception as exc:  # any adapter failure is a miss plus a metric, never an engine error
            self.metrics.inc("kvtier_l2_errors_total", adapter=adapter.label, op=op)
            log.warning("L2 adapter %s %s failed: %s", adapter.label, op, exc)
            return default

    def _per_name(self, adapter: L2Adapter, op: str, names: list[str], missing) -> list:
        """``adapter.<op>(names)`` as one batch; if the batch fails (e.g. one Redis Cluster node is down),
        name by name, so the names that can still be served are. A failed name gives ``missing``."""
        fn = getattr(adapter, op)
        try:
            return list(fn(names))
        except Exception:  # noqa: BLE001 -- counted per name below
            if len(names) == 1:
                self.metrics.inc("kvtier_l2_errors_total", adapter=adapter.label, op=op)
                return [missing]
        return [self._call(adapter, op, fn, [name], default=[missing])[0] for name in names]

    def lookup(self, keys: Sequence[ChunkKey], probe: bool = True) -> int:
        """How many leading ``keys`` some adapter holds. With ``index_lookups``: from the in-memory indexes only
        (no I/O, never blocks on an adapter); with ``probe``, names past the indexed prefix are probed in the
        background (``contains``), so a record another writer stored is counted by a later lookup. Otherwise:
        asking the adapters. 0 while a ``clear_async`` is pending."""
        if not keys or not self.adapters or self._writes.clearing:
            return 0
        names = [k.name() for k in keys]
        return self.index.held(names, probe) if self.index_lookups else self.index.probe_now(names)

    def holders(self, keys: Sequence[ChunkKey], names: Sequence[str] | None = None) -> list[tuple[str, list[bool]]]:
        """(adapter label, which ``keys`` its in-memory index holds) per adapter in cascade order (no I/O; all
        False while a ``clear_async`` is pending). ``names``: their ``name()``s when the caller has them. For the
        management API's lookup."""
        names = [k.name() for k in keys] if names is None else list(names)
        clearing = self._writes.clearing
        held = self.index.held_each(names) if names and not clearing else [[False] * len(names)] * len(self.adapters)
        return [(adapter.label, [bool(h) for h in hits]) for adapter, hits in zip(self.adapters, held)]

    @property
    def index_may_lag(self) -> bool:
        """Some adapter's index can miss what other writers stored (``L2Adapter.index_may_lag``)."""
        return any(adapter.index_may_lag for adapter in self.adapters)

    def probe(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` some adapter holds, asking the adapters (``contains``: I/O, may block as
        long as an adapter does; never on a request thread). What they find joins their indexes, so a
        following ``lookup`` counts it. Errors are misses plus ``kvtier_l2_errors_total``."""
        if not keys or not self.adapters or self._writes.clearing:
            return 0
        return self.index.probe_now([k.name() for k in keys])

    def read(self, keys: Sequence[ChunkKey], token_ids: Sequence[list[int]]) -> list[L2Payload]:
        """Verified chunks of the leading ``keys`` found in any adapter (stops at the first miss); encoded
        records are decoded by ``L2Payload.copy_into``.

        One batched ``get`` per adapter (adapters fan a batch out in parallel), limited to the leading
        chunks some adapter's index holds (past them, over an L2 other servers write to, the chunks its ``contains``
        finds). A record failing verification is deleted from that adapter,
        counted in ``kvtier_corrupt_records_total`` and treated as a miss there (a later adapter may hit).
        """
        if self._writes.clearing:
            return []
        names = [k.name() for k in keys]
        count = self.index.held(names, probe=False)  # the indexes: no `contains` before the get
        if count < len(names) and self.index_may_lag:  # another writer's records: only the unknown tail is asked
            count += self.index.probe_now(names[count:])
        keys, names = list(keys)[:count], names[:count]
        found: list[L2Payload | None] = [None] * len(keys)
        for index, adapter in enumerate(self.adapters):
            todo = [i for i, payload in enumerate(found) if payload is None]
            if not todo:
                break
            bufs = self._per_name(adapter, "get", [names[i] for i in todo], None)
            self.index.note(adapter, [names[i] for i, buf in zip(todo, bufs) if buf is None], False)
            self.metrics.inc("kvtier_l2_read_chunks_total", sum(1 for buf in bufs if buf is not None),
                             adapter=adapter.label)
            for i, buf in zip(todo, bufs):
                if buf is not None:
                    found[i] = self._verify(adapter, index, keys[i], token_ids[i], buf)
        out: list[L2Payload] = []
        for payload in found:
            if payload is None:
                break
            out.append(payload)
        return out

    def _verify(self, adapter: L2Adapter, index: int, key: ChunkKey, tokens: list[int], buf) -> L2Payload | None:
        name = key.name()
        try:
            header, payload = decode_record(buf, key, tokens, self.record_key)
            if header.encoded and not self.codecs.allowed(header.model, header.encoding):
                raise _LossyRefused(f"record encoded with lossy codec {header.encoding!r}, which "
                                    f"lossy_codecs_allowed does not list for model {header.model!r}")
            if header.encoded:
                get_codec(header.encoding)  # a codec this kvtier lacks: UnknownCodecError here, a kept miss
        except (ForeignRecordError, UnknownCodecError, _LossyRefused) as exc:  # valid elsewhere: kept, a miss here
            metric = {ForeignRecordError: "kvtier_l2_foreign_records_total", UnknownCodecError:
                      "kvtier_l2_unknown_codec_total"}.get(type(exc), "kvtier_l2_lossy_refused_total")
            self.metrics.inc(metric, adapter=adapter.label)
            if not self._refusal_logged:
                self._refusal_logged = True
                log.warning("L2 adapter %s: record %s is not servable here (kept in the store): %s", adapter.label,
                            name, exc)
            self.index.refuse(adapter, [name])
            self._removed_if_gone([name])
            return None
        except CorruptRecordError as exc:
            self.drop_corrupt(adapter, name, exc)
            return None
        return L2Payload(self, adapter, name, header, payload, buf, index)

    def copy_to_faster(self, payloads: Sequence[L2Payload]) -> None:
        """Write each record read from adapter i into adapters 0..i-1 too (``Promotions``, with
        ``l2_promote_to_faster_l2``); a failed write is counted, never raised."""
        for payload in payloads:
            parts = [memoryview(payload.record)]
            for faster in self.adapters[:payload.adapter_index]:
                if self._call(faster, "put", faster.put, [(payload.name, parts)], default=[False])[0]:
                    self.index.note(faster, [payload.name], True)

    def drop_corrupt(self, adapter: L2Adapter, name: str, exc: CorruptRecordError) -> None:
        """A record that fails verification or decoding (here, or in ``L2Payload.copy_into``): deleted from
        ``adapter``, counted, announced if gone."""
        log.warning("L2 adapter %s: dropping bad record %s: %s", adapter.label, name, exc)
        forged = isinstance(exc, RecordAuthError)
        self.metrics.inc("kvtier_l2_auth_failures_total" if forged else "kvtier_corrupt_records_total",
                         adapter=adapter.label)
        self._call(adapter, "delete", adapter.delete, [name])
        self.index.note(adapter, [name], False)
        self._removed_if_gone([name])

    # ---- writes ------------------------------------------------------------------------
    def write_async(self, tokens, items: list[WriteItem], release: Callable[[ChunkKey], None],
                    event_refs: list | None = None, lost: Callable[[int], None] | None = None, hint=None) -> int:
        """Queue ``items`` (consecutive chunks of the prompt ``tokens``) for write-through to every adapter.
        ``hint``: the store's ``RetentionHint``, for the adapters' capacity eviction (``L2Adapter.retain``).

        ``event_refs``: the items' ``kvtier.cache.ChunkRef``s, one per item, so the written chunks are announced
        (BlockStored, medium ``STORAGE``).

        Items that do not fit in the queue are dropped (``kvtier_l2_write_dropped_total``) and
        released at once. ``lost``: called with how many items will not be in L2 (dropped here, or not written
        by any adapter), so a ``Flush`` can say so. Returns how many were queued. Never blocks.
        """
        return self._writes.write_async(tokens, items, release, event_refs, lost, hint)

    def written_bytes(self) -> list[dict]:
        """Per adapter: ``codec``, ``raw_bytes_written``, ``bytes_written`` (records, headers included) and their
        ``ratio``, since start (``/status``)."""
        return self._writes.written_bytes()

    def flush(self, timeout_seconds: float = 30.0) -> bool:
        """Wait at most ``timeout_seconds`` until every queued write is done. Returns False on timeout."""
        return self._writes.flush(timeout_seconds)

    # ---- removal and status ------------------------------------------------------------
    def _on_adapter_evict(self, adapter: L2Adapter, names: list[str]) -> None:
        self.index.note(adapter, names, False)
        self.metrics.inc("kvtier_evicted_chunks_total", len(names), medium=Medium.STORAGE)
        self._removed_if_gone(names)

    def _removed_if_gone(self, names: list[str]) -> None:
        """Emit BlockRemoved(STORAGE) for names no adapter holds any more (the last copy went)."""
        if self.events is None or not names:
            return
        still = [False] * len(names)
        for adapter in self.adapters:
            found = self._call(adapter, "contains", adapter.contains, names, default=[False] * len(names))
            still = [a or bool(b) for a, b in zip(still, found)]
        gone = [n for n, s in zip(names, still) if not s]
        if gone:
            self.events.removed(gone, Medium.STORAGE)

    def delete(self, keys: Sequence[ChunkKey], timeout_seconds: float = 30.0) -> dict[str, int]:
        """Delete ``keys`` from every adapter after the writes queued before the call (waited for at most
        ``timeout_seconds``, so a queued write of one of them cannot land after the delete) and announce the
        names no adapter holds any more (BlockRemoved, medium ``STORAGE``). Returns adapter label -> records it
        deleted; a failing adapter counts 0 (and ``kvtier_l2_errors_total``). Blocks on adapter I/O: never call it
        on a request thread."""
        names = [k.name() for k in keys]
        out = {adapter.label: 0 for adapter in self.adapters}
        if not names or not self.adapters:
            return out
        self.flush(timeout_seconds)
        for adapter in self.adapters:
            out[adapter.label] += self._call(adapter, "delete", adapter.delete, names, default=0) or 0
            self.index.note(adapter, names, False)
        self._removed_if_gone(names)
        return out

    def clear(self, timeout_seconds: float = 30.0) -> int:
        """Delete every record in every adapter (after pending writes) and wait at most ``timeout_seconds``.
        Returns how many were deleted (0 if the wait timed out; the clear still completes later)."""
        job = self.clear_async()
        if job is None or not job.done.wait(timeout_seconds):
            return 0
        return job.deleted

    def clear_async(self) -> ClearJob | None:
        """Queue a clear of every adapter behind the writes already queued and return at once (None without
        adapters). Until it has run, ``lookup`` answers 0 and ``read`` nothing; ``flush`` waits for it too.
        Writes queued after it are kept."""
        if not self.adapters:
            return None
        return self._writes.clear_async()

    def _run_clear(self, job: ClearJob) -> None:
        """Run by the writer thread, in queue order (``L2Writer`` does the bookkeeping)."""
        for i, adapter in enumerate(self.adapters):
            job.deleted += len(self._call(adapter, "clear", adapter.clear, default=[]) or [])
            self.index.forget(adapter)
        if self.events is not None:  # what was announced since the clear was asked for (a race) goes now
            self.events.cleared(Medium.STORAGE)

    def status(self) -> list[dict]:
        """Per adapter: label, type, health, reason, usage (no secrets), and its codec with the bytes written
        before and after it (``written_bytes``)."""
        out = []
        for adapter, written in zip(self.adapters, self.written_bytes()):
            healthy, reason = self._call(adapter, "health", adapter.health, default=(False, "health check failed"))
            usage = self._call(adapter, "usage", adapter.usage, default=None)
            out.append({"name": adapter.label, "type": adapter.config.type, "healthy": healthy, "reason": reason,
                        "used_bytes": usage.used_bytes if usage else None,
                        "num_records": usage.num_records if usage else None,
                        "capacity_bytes": usage.capacity_bytes if usage else None,
                        **{k: v for k, v in written.items() if k != "adapter"}})
        return out

    def close(self, timeout_seconds: float = 10.0) -> bool:
        """Finish queued writes (at most ``timeout_seconds``), stop the writer, close adapters. Returns False if
        writes were cut off."""
        done = self.flush(timeout_seconds)
        self.index.close()
        self._writes.close()
        for adapter in self.adapters:
            self._call(adapter, "close", adapter.close)
        return done
