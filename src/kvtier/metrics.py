"""Every kvtier metric, in one table, with exact in-process values.

Values are kept here (thread-safe) so counters are exact and testable without a scrape. The server
exposes them through OpenTelemetry meters and the Prometheus exporter (``kvtier.server.admin.telemetry``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    unit: str = "1"


METRICS: dict[str, MetricSpec] = {m.name: m for m in (
    MetricSpec("kvtier_lookup_requests_total", "counter", "Lookup requests served."),
    MetricSpec("kvtier_lookup_tokens_total", "counter", "Tokens asked about in lookups."),
    MetricSpec("kvtier_lookup_hit_tokens_total", "counter",
               "Leading tokens found by lookups, by the tier that held the chunk.", ("medium",)),
    MetricSpec("kvtier_hashed_tokens_total", "counter",
               "Prompt tokens hashed into chunk keys (a prompt's memoised prefix is not hashed again)."),
    MetricSpec("kvtier_store_chunks_total", "counter", "Chunks newly stored into L1."),
    MetricSpec("kvtier_retention_refused_chunks_total", "counter",
               "Chunks whose retention hint was refused: protected chunks would pass l1_retention_max_share, or the "
               "principal's would pass l1_retention_max_share_per_principal."),
    MetricSpec("kvtier_retrieve_chunks_total", "counter", "Chunks returned by retrieve."),
    MetricSpec("kvtier_l1_usage_bytes", "gauge", "Bytes of L1 in use.", unit="By"),
    MetricSpec("kvtier_l1_capacity_bytes", "gauge", "L1 byte budget.", unit="By"),
    MetricSpec("kvtier_l1_chunks", "gauge", "Chunks held in L1."),
    MetricSpec("kvtier_evicted_chunks_total", "counter", "Chunks evicted, by tier.", ("medium",)),
    MetricSpec("kvtier_l2_errors_total", "counter", "L2 adapter operations that failed (each counted as a miss).", ("adapter", "op")),
    MetricSpec("kvtier_l2_write_dropped_total", "counter", "L2 writes dropped because the write queue was full or the write failed."),
    MetricSpec("kvtier_l2_writes_total", "counter", "Chunk records written to an L2 adapter.", ("adapter",)),
    MetricSpec("kvtier_l2_promoted_chunks_total", "counter", "L2 hits copied into L1."),
    MetricSpec("kvtier_l2_read_chunks_total", "counter", "Chunk records read from an L2 adapter (before "
               "verification).", ("adapter",)),
    MetricSpec("kvtier_l2_promotions_joined_total", "counter", "Server retrieves or prefetches that waited for a "
               "promotion already reading the same chunks from L2 instead of reading them a second time."),
    MetricSpec("kvtier_l2_promote_timeouts_total", "counter", "Server promotions (retrieve or prefetch) not done "
               "within server.promote_timeout_seconds: answered from L1 alone (a miss for the rest)."),
    MetricSpec("kvtier_l2_promotions_refused_total", "counter", "Server promotions not started because "
               "server.max_promotions were already in flight: answered from L1 alone."),
    MetricSpec("kvtier_l2_promotions_in_flight", "gauge", "Server promotions queued or running on the pool."),
    MetricSpec("kvtier_lookup_probes_total", "counter", "Server lookups that waited for an L2 probe (their L1 and "
               "L2 indexes answered short over an L2 other servers write to; server.lookup_probe_timeout_seconds)."),
    MetricSpec("kvtier_lookup_probe_timeouts_total", "counter", "Server lookup probes not done within "
               "server.lookup_probe_timeout_seconds: answered from L1 and the L2 indexes."),
    MetricSpec("kvtier_lookup_probes_skipped_total", "counter", "Server lookups answered from L1 and the L2 indexes "
               "without the probe they called for: stuck (an earlier probe still hangs in an adapter) or pool_full "
               "(server.max_promotions in flight).", ("reason",)),
    MetricSpec("kvtier_l2_probes_skipped_total", "counter", "Lookups past the L2 index whose background probe "
               "was skipped because too many probes were queued."),
    MetricSpec("kvtier_prefetch_requests_total", "counter",
               "Prefetch requests the server received (L2 to L1 promotion ahead of a retrieve)."),
    MetricSpec("kvtier_corrupt_records_total", "counter",
               "L2 records that failed verification (deleted, counted as a miss).", ("adapter",)),
    MetricSpec("kvtier_l2_auth_failures_total", "counter", "L2 records whose authentication tag (l2_record_key) "
               "was missing or wrong (deleted, counted as a miss).", ("adapter",)),
    MetricSpec("kvtier_l2_foreign_records_total", "counter", "L2 records signed with a record key this server does "
               "not hold, or signed while it has none (kept in the store, counted as a miss).", ("adapter",)),
    MetricSpec("kvtier_l2_lossy_refused_total", "counter", "L2 records in a lossy codec that lossy_codecs_allowed "
               "does not list for their model (kept in the store, counted as a miss).", ("adapter",)),
    MetricSpec("kvtier_l2_bytes_written_total", "counter", "Record bytes written to L2 (after the codec).",
               ("adapter", "codec")),
    MetricSpec("kvtier_l2_raw_bytes_written_total", "counter", "KV bytes written to L2 before the codec.",
               ("adapter", "codec")),
    MetricSpec("kvtier_trace_records_total", "counter", "Requests written to the trace file (server.trace_file)."),
    MetricSpec("kvtier_trace_records_dropped_total", "counter", "Requests left out of the trace: queue_full (the "
               "writer fell behind; requests never wait for it), size_limit (server.trace_max_bytes reached), error.",
               ("reason",)),
    MetricSpec("kvtier_trace_bytes", "gauge", "Bytes written to the trace file, header included.", unit="By"),
    MetricSpec("kvtier_l2_compression_ratio", "gauge", "Raw over written bytes since start, per adapter and codec.",
               ("adapter", "codec")),
    MetricSpec("kvtier_codec_seconds_total", "counter", "CPU seconds spent in codecs.", ("codec", "op")),
    MetricSpec("kvtier_codec_errors_total", "counter", "Chunks a codec could not encode (not written).", ("codec",)),
    MetricSpec("kvtier_l2_unknown_codec_total", "counter", "L2 records encoded with a codec this kvtier does not "
               "have (kept in the store, counted as a miss).", ("adapter",)),
    MetricSpec("kvtier_auth_refused_total", "counter", "Connections the ZAP handler refused (unknown key), by "
               "socket: requests (the client port), events (the KV event PUB) or replay (the event replay port).",
               ("socket",)),
    MetricSpec("kvtier_store_seconds", "histogram", "Store latency.", unit="s"),
    MetricSpec("kvtier_retrieve_seconds", "histogram", "Retrieve latency.", unit="s"),
    MetricSpec("kvtier_connected_clients", "gauge", "Clients connected to the server."),
    MetricSpec("kvtier_events_replays_refused_total", "counter",
               "Replay requests refused: their principal had kv_events.max_replays_per_principal in progress."),
    MetricSpec("kvtier_events_dropped_total", "counter", "KV cache events dropped because the event queue was full."),
    MetricSpec("kvtier_events_published_total", "counter", "KV cache events published."),
    MetricSpec("kvtier_client_unavailable_total", "counter", "Client calls answered as a miss because the server was unreachable."),
    MetricSpec("kvtier_connector_errors_total", "counter", "Engine connector calls that failed with an unexpected "
               "error (logged with its traceback, answered as a miss), by operation.", ("op",)),
    MetricSpec("kvtier_connector_load_failed_tokens_total", "counter", "Tokens an engine connector promised but "
               "could not load (reported to the engine, which recomputes them), by reason.", ("reason",)),
    MetricSpec("kvtier_connector_bad_requests_total", "counter", "Requests whose kv_transfer_params the engine "
               "connector refused (logged; served without kvtier)."),
    MetricSpec("kvtier_connector_lookups_total", "counter", "Engine connector lookups; reused=\"true\": answered "
               "from the request's first lookup (the engine asked again while the request waited).", ("reused",)),
    MetricSpec("kvtier_connector_lookup_seconds_total", "counter", "Time the engine connector spent in lookups.",
               unit="s"),
    MetricSpec("kvtier_connector_prefetches_total", "counter", "Prefetches the engine connector's scheduler sent "
               "(a lookup found chunks only L2 held: their promotion into L1 starts before the load)."),
    MetricSpec("kvtier_connector_store_calls_total", "counter", "Store calls the engine connector made."),
    MetricSpec("kvtier_connector_stored_chunks_total", "counter", "Chunks the engine connector's stores added."),
    MetricSpec("kvtier_connector_store_seconds_total", "counter", "Time the engine connector spent storing "
               "(copying from the engine's blocks included).", unit="s"),
    MetricSpec("kvtier_lease_expired_total", "counter", "Server leases that expired before the client confirmed: "
               "store reservations aborted (their slots quarantined), retrieve pins released.", ("kind",)),
    MetricSpec("kvtier_l1_quarantined_bytes", "gauge", "L1 bytes in slots of expired store leases whose client may "
               "still write into them (never reused until it is done or gone).", unit="By"),
    MetricSpec("kvtier_quarantine_released_total", "counter", "Quarantined L1 slots freed, by why: late_commit "
               "(the client finished its copy), bye, process_gone.", ("reason",)),
    MetricSpec("kvtier_changed_after_commit_total", "counter", "Chunks whose bytes changed after they were "
               "committed (seen when writing them to L2): not written, dropped from L1."),
    MetricSpec("kvtier_client_limit_exceeded_total", "counter", "Requests refused because the client reached a "
               "per-client bound (server.*_per_client, max_prompt_tokens), by bound.", ("limit",)),
    MetricSpec("kvtier_prehashed_requests_total", "counter", "Requests whose long prompt was hashed on the "
               "server's hashing worker before they were handled (server.hash_offload_min_tokens)."),
    MetricSpec("kvtier_blend_fallbacks_total", "counter", "Blended prefills (and document ingests) of a model "
               "blending cannot serve (its RoPE or attention), run without blending because the caller passed "
               "allow_fallback=True: prefix reuse only (an ingest stores nothing)."),
    MetricSpec("kvtier_replies_dropped_total", "counter", "Replies not queued because the client left or had "
               "server.max_unread_replies_per_client replies unread.", ("reason",)),
)}

_ARITY = {name: len(spec.labels) for name, spec in METRICS.items()}  # inc_many's check, once per name


class Metrics:
    """Exact values of the metrics above. ``inc``/``set``/``observe`` raise KeyError on unknown names or labels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self._observations: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.listeners: list = []  # callables (name, labels_tuple, value) for histogram exporters

    @staticmethod
    def _key(name: str, labels: dict) -> tuple:
        names = METRICS[name].labels
        if len(labels) == len(names):  # on the request path: no sets to build
            try:
                return tuple([str(labels[k]) for k in names])
            except KeyError:
                pass
        raise KeyError(f"metric {name} takes labels {names}, got {tuple(labels)}")

    def inc(self, name: str, value: float = 1, **labels) -> None:
        key = self._key(name, labels)
        with self._lock:
            self._values[name][key] += value

    def inc_many(self, increments) -> None:
        """Add to several counters under one lock: ``(name, amount, label values)`` each, the values a tuple of
        str in the order of the metric's labels (``()`` for none). Raises KeyError on an unknown name or a
        wrong number of values."""
        for name, _, key in increments:
            if len(key) != _ARITY.get(name, -1):
                raise KeyError(f"metric {name} takes labels {METRICS[name].labels}, got values {key}")
        values = self._values
        with self._lock:
            for name, amount, key in increments:
                values[name][key] += amount

    def set(self, name: str, value: float, **labels) -> None:
        key = self._key(name, labels)
        with self._lock:
            self._values[name][key] = value

    def observe(self, name: str, seconds: float, **labels) -> None:
        key = self._key(name, labels)
        with self._lock:
            obs = self._observations[name][key]
            obs.append(seconds)
            if len(obs) > 10_000:  # keep a bounded window for quantiles; exporters see every value
                del obs[:5_000]
        for listener in self.listeners:
            listener(name, key, seconds)

    def value(self, name: str, **labels) -> float:
        """Current value (0 if never set)."""
        key = self._key(name, labels)
        with self._lock:
            return self._values[name].get(key, 0.0)

    def samples(self, name: str) -> dict[tuple, float]:
        """Every label combination of a counter or gauge and its value."""
        with self._lock:
            return dict(self._values[name])

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{metric: {"label=value,...": value}} of counters and gauges (for /status and tests)."""
        with self._lock:
            return {name: {",".join(f"{label}={v}" for label, v in zip(METRICS[name].labels, key)): val
                           for key, val in series.items()} for name, series in self._values.items()}
