"""Tiers: what one process shares between its caches (L1, the L2 cascade, metrics, the event emitter).

A server makes one ``Tiers`` and a ``KVCache`` (``kvtier.cache.cache``) per (model, KV layout) over it; an in-process
``KVCache`` makes its own. L1 (``L1Store``) and ``L2Tier`` are thread-safe; ``Tiers`` adds no lock of its own.
"""

from __future__ import annotations

from kvtier.cache.memo import LookupMemo
from kvtier.codecs.policy import CodecPolicy
from kvtier.config import KVTierConfig
from kvtier.errors import KVTierError
from kvtier.keys import ChunkKey
from kvtier.l1.retention import Retention
from kvtier.l1.store import L1Store
from kvtier.l2 import create_adapter
from kvtier.l2.tier import L2Tier
from kvtier.metrics import Metrics
from kvtier.record import RecordKeys
from kvtier.medium import Medium


class Tiers:
    """What one process shares between caches: L1, the L2 cascade, metrics and the event emitter.
    ``index_lookups``: L2 lookups from the adapters' in-memory indexes only (``L2Tier``; the server sets it)."""

    def __init__(self, config: KVTierConfig, *, metrics: Metrics | None = None, shm_name: str | None = None,
                 publish_events: bool = True, auth=None, index_lookups: bool = False):
        if config.l1_size_bytes <= 0:
            raise KVTierError("l1_size_gb must be > 0: L1 is where every chunk lands first; set e.g. l1_size_gb: 1")
        self.config = config
        self.metrics = metrics or Metrics()
        self.events = None
        if config.enable_kv_events:
            from kvtier.events import EventEmitter, EventPublisher

            # auth: the server's KeyRing, so the replay port accepts only its clients' keys
            publisher = EventPublisher(config.kv_events, metrics=self.metrics, auth=auth) if publish_events else None
            self.events = EventEmitter(config, publisher=publisher)
        adapters = [create_adapter(spec) for spec in config.l2_adapters]
        retention = Retention(config.l1_size_bytes, config.l1_retention_max_share, config.session_ttl_seconds,
                              max_owner_share=config.l1_retention_max_share_per_principal,
                              default_ttl_seconds=config.retention_max_ttl_seconds)
        self.l1 = L1Store(config.l1_size_bytes, config.eviction_policy, shm_name=shm_name, retention=retention)
        self.l1.on_evict = self._on_l1_evict
        self.memo = LookupMemo(config.lookup_memo_max_bytes)
        record_key = RecordKeys(config.l2_record_key.get_secret_value().encode() if config.l2_record_key else None,
                                tuple(k.get_secret_value().encode() for k in config.l2_record_verify_keys),
                                config.l2_accept_signed_records)
        codecs = CodecPolicy([a.config.codec for a in adapters], config.lossy_codecs_allowed,
                             [a.label for a in adapters])
        self.l2 = L2Tier(adapters, self.metrics, self.events, config.l2_write_queue_size, record_key,
                         config.l2_record_auth, index_lookups, codecs)
        self.l2.on_changed = self._on_changed_after_commit
        self.metrics.set("kvtier_l1_capacity_bytes", self.l1.capacity_bytes)

    def _on_l1_evict(self, evicted) -> None:
        self.metrics.inc("kvtier_evicted_chunks_total", len(evicted), medium=Medium.CPU)
        if self.events is not None:
            self.events.removed([key.name() for key, _ in evicted], Medium.CPU)

    def _on_changed_after_commit(self, key: ChunkKey) -> None:
        # its bytes are not what was committed: never serve them again (the L2 write was skipped)
        if self.l1.remove(key) and self.events is not None:
            self.events.removed([key.name()], Medium.CPU)

    def delete(self, keys: list[ChunkKey], timeout_seconds: float = 30.0) -> dict[str, int]:
        """Remove ``keys`` from L1 and every L2 adapter (``L2Tier.delete``: after the writes already queued), with
        their BlockRemoved events (CPU for L1, STORAGE once no adapter holds a chunk). Returns ``{"CPU": chunks
        removed from L1, <adapter label>: records deleted there, ...}``. Blocks on L2 I/O (never on a request
        thread). A promotion already reading one of them may put it back into L1 afterwards."""
        removed = [key for key in keys if self.l1.remove(key)]
        if removed and self.events is not None:
            self.events.removed([key.name() for key in removed], Medium.CPU)
        out = {Medium.CPU: len(removed), **self.l2.delete(keys, timeout_seconds)}
        self.refresh_gauges()
        return out

    def refresh_gauges(self) -> None:
        self.metrics.set("kvtier_l1_usage_bytes", self.l1.used_bytes)
        self.metrics.set("kvtier_l1_quarantined_bytes", self.l1.quarantined_bytes)
        self.metrics.set("kvtier_l1_chunks", self.l1.num_chunks)

    def clear(self, medium: str | None = None, *, wait: bool = True) -> None:
        """Drop everything (``medium=None``: AllBlocksCleared), or only L1 (``"CPU"``) or only L2 (``"STORAGE"``).
        L1 is cleared at once; L2 after its queued writes: waited for (at most 30 s) with ``wait``, else queued
        (``L2Tier.clear_async``: lookups see no L2 chunk meanwhile)."""
        medium = Medium.of_kvtier(medium)
        if self.events is not None:
            self.events.cleared(medium)
        if medium in (None, Medium.CPU):
            self.l1.clear()
        if medium in (None, Medium.STORAGE):
            if wait:
                self.l2.clear()
            else:
                self.l2.clear_async()
        self.refresh_gauges()

    def close(self, timeout_seconds: float = 10.0) -> bool:
        """Finish queued L2 writes (at most ``timeout_seconds``), close adapters, the publisher and L1's memory.
        Returns False when the writes did not finish in time."""
        done = self.l2.close(timeout_seconds)
        if self.events is not None and self.events.publisher is not None:
            self.events.publisher.close()
        self.l1.close()
        return done
