"""The kvtier vLLM connector's link to kvtier: its backends, the guard every backend call goes through, and the
sizes both sides share (``KVTierLink``).

One ``KVBackend`` per KV part (one for a plain model; one per attention kind for a hybrid one, ``vllm_groups``): a
``kvtier.client.Client`` of ``connector.server_url`` or, without a server, an in-process ``KVCache`` over an L2
both vLLM processes share. A server may answer another chunk size than configured: ``chunk_size`` is the one in
force once the backends are open. Every call goes through ``call``: a transport or storage failure is a miss, never
a failed vLLM request.
"""

from __future__ import annotations

import logging
import time

import zmq

from kvtier.backend import KVBackend
from kvtier.connectors.vllm_config import check_chunk_size
from kvtier.errors import ConfigError, CorruptRecordError, ProtocolError, StorageError
from kvtier.extra_keys import num_blocks_of

# a child of vLLM's "vllm" logger, so these lines appear in vLLM's own log with its format and level
logger = logging.getLogger("vllm.kvtier_connector")

REPORT_SECONDS = 30.0  # how often each side logs what lookups and stores cost (INFO)
# failures of the cache's transport or storage: a miss (one warning, kvtier_client_unavailable_total)
TRANSPORT_ERRORS = (StorageError, ProtocolError, CorruptRecordError, zmq.ZMQError, OSError)


class KVTierLink:
    """The backends of one connector side, opened at construction (an unreachable server: ``backend`` None, and
    vLLM serves without kvtier).

    ``config`` is the connector's ``KVTierConfig``; ``model_id`` the weights' identity; ``expect`` the hash
    settings a server must share (``VLLMIdentity.hash_settings``); ``layouts`` one ``KVLayout`` per part;
    ``groups`` the model's ``KVGroups`` (None: one part); ``block_size`` vLLM's, in tokens; ``prefault``: this
    process copies KV (the worker). Raises ``ConfigError`` for settings no backend can serve.
    """

    def __init__(self, config, model_id: str, expect: dict, layouts: list, groups, block_size: int, metrics,
                 prefault: bool):
        self.config, self.model_id, self.groups, self.block_size, self.metrics = (
            config, model_id, groups, block_size, metrics)
        self.chunk_size = config.chunk_size
        self.in_process = config.connector.server_url is None
        self._warned = False
        self._reported_at = time.monotonic()
        self.tiers = None  # in process, hybrid: the parts' caches share one L1 and L2
        self.check_chunk_size()  # fail fast, before any connection
        self.backends: list[KVBackend | None] = [self._open(layout, expect, prefault) for layout in layouts]
        self.backend: KVBackend | None = self.backends[0] if all(self.backends) else None

    def check_chunk_size(self) -> None:
        if self.groups is not None:
            self.groups.check_chunk_size(self.chunk_size)
        else:
            check_chunk_size(self.chunk_size, self.block_size)

    def shared_memory(self):
        """The shared-memory L1 this process maps for the first part's backend (a server client's arena), or None
        (in process, or chunks travel as frames): what a CUDA worker registers for its copies."""
        return getattr(self.backends[0], "shared_memory", None)

    def _open(self, layout, expect: dict, prefault: bool) -> KVBackend | None:
        settings = self.config.connector
        if self.in_process:
            return self._open_in_process(layout)
        from kvtier.client import Client

        expect = dict(expect)  # the server hashes exactly like this engine, or refuses
        if "chunk_size" in self.config.model_fields_set:
            expect["chunk_size"] = self.chunk_size
        try:
            # an unreachable server is not an error: the client answers misses (one warning, the
            # kvtier_client_unavailable_total metric) and picks the server up when it appears
            client = Client(settings.server_url, model=self.model_id, layout=layout, expect=expect,
                            metrics=self.metrics, timeout_seconds=settings.timeout_seconds,
                            secret_file=settings.auth_secret_file, prefault=prefault)
        except ProtocolError as exc:
            raise ConfigError(f"{exc} (kvtier connector settings: {self.config.connector})") from None
        except TRANSPORT_ERRORS as exc:  # serve without kvtier
            self.metrics.inc("kvtier_client_unavailable_total")
            logger.warning("kvtier client for %s failed to start (%s: %s); vLLM serves without kvtier",
                           settings.server_url, type(exc).__name__, exc)
            return None
        if client.info is not None:
            self.chunk_size = client.info.chunk_size
            self.check_chunk_size()
        return client

    def _open_in_process(self, layout) -> KVBackend:
        if not self.config.l2_adapters:
            raise ConfigError("the kvtier connector needs kvtier.server_url, or kvtier.local_disk (or "
                              "kvtier.l2_adapters) for an in-process cache: vLLM CPU runs its scheduler and worker "
                              "in separate processes, which share kvtier only through a server or an L2")
        from kvtier.cache import KVCache, Tiers

        if self.groups is None:
            return KVCache(self.config, self.model_id, layout, publish_events=False)
        if self.tiers is None:
            self.tiers = Tiers(self.config, publish_events=False)
        return KVCache(self.config, self.model_id, layout, tiers=self.tiers)

    def call(self, what: str, fn, *args, default=None, **kw):
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

    def take_events(self) -> list:
        """The kvtier events of this side's stores since the last call (one stream: in process the parts share
        their tiers)."""
        return self.call("take_events", self.backend.take_events, default=[]) if self.backend is not None else []

    def ns_kw(self, namespace: str, extra_keys=None, num_tokens: int = 0) -> dict:
        """Keyword arguments naming the request's identity for a backend call on its first ``num_tokens``."""
        kw = {"namespace": namespace} if namespace else {}
        if extra_keys is not None:
            kw["extra_keys"] = extra_keys[:num_blocks_of(num_tokens, self.block_size)]
        return kw

    def op_kw(self, op) -> dict:
        """``ns_kw`` for a ``LoadOp`` or ``SaveOp`` (its namespace, extra keys and tokens)."""
        return self.ns_kw(op.namespace, op.extra_keys, len(op.token_ids))

    def report_costs(self) -> None:
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

    def close(self) -> None:
        for backend in self.backends:
            if backend is not None:
                self.call("close", backend.close)
        if self.tiers is not None:
            self.call("close", self.tiers.close)
