"""The worker side of the kvtier vLLM connector: one load path and one save path over ``KVBackend``.

Load: ``retrieve_chunks`` (pinned L1 slots, shared-memory slots or received frames) with the request's
deadline (``connector.load_timeout_seconds``); each chunk is copied straight into vLLM's blocks, or, with
``use_layerwise``, into a staging tensor that ``wait_for_layer_load`` scatters layer by layer. Blocks that
did not load (a miss, a server gone or silent past the deadline, an expired pin, an L2 read error) are
reported by ``get_block_ids_with_load_errors`` and vLLM recomputes exactly those.

Save: ``store_chunks``, whose ``fill`` copies each missing chunk straight from vLLM's blocks (or, with
``use_layerwise``, from the tensor ``save_kv_layer`` filled) into the cache's slot. Nothing waits for L2.
"""

from __future__ import annotations

import logging
import time

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtier.connectors.vllm_cuda_layouts import group_backend, paged_blocks
from kvtier.connectors.vllm_events import to_vllm_events
from kvtier.connectors.vllm_layout import gather_chunk, layer_order, scatter_chunk
from kvtier.connectors.vllm_scheduler import KVTierConnectorMetadata, LoadOp, SaveOp
from kvtier.errors import KVTierError
from kvtier.tensors import as_torch

logger = logging.getLogger("vllm.kvtier_connector")


class WorkerSide:
    """The worker side of ``KVTierConnector`` for a model with one KV cache group: owns vLLM's registered KV caches
    and this step's staged loads, saves, load errors and events. ``vllm_hybrid.HybridWorker`` is the alternative
    for several groups, with the same vLLM-facing methods; the connector's constructor picks one.

    ``link``: the side's ``KVTierLink``; ``layout``: the model's ``KVLayout``; ``layerwise``: ``use_layerwise``;
    ``load_timeout_seconds``: one step's deadline for its loads.
    """

    def __init__(self, link, layout, *, layerwise: bool, load_timeout_seconds: float):
        self.link, self.layout = link, layout
        self.metrics, self.block_size = link.metrics, link.block_size
        self.layerwise, self.load_timeout_seconds = layerwise, load_timeout_seconds
        self._torch_dtype = getattr(torch, layout.dtype)
        self._layer_index: dict[str, int] = {}
        self._blocks = None  # vllm_layout.CPUBlocks or vllm_cuda_layouts.PagedKV (set when the caches are registered)
        self._layer_loads: list[tuple[torch.Tensor, LoadOp, int]] = []  # (tokens [start, ok_end), op, ok_end)
        self._layer_saves: list[tuple[torch.Tensor, SaveOp]] = []
        self._load_errors: set[int] = set()
        self._events: list = []  # vLLM kv_events of this side's stores, for the scheduler

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], backends: dict[str, str]):
        """vLLM's ``{layer name: KV cache}``; ``backends``: each layer's attention backend name
        (``vllm_cuda_layouts.attention_backend_names``)."""
        names = layer_order(kv_caches)
        if len(names) != self.layout.num_layers:
            raise KVTierError(f"vLLM registered {len(names)} KV cache layers, the model config says "
                              f"{self.layout.num_layers}; hybrid or cross-attention models are not supported")
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._blocks = paged_blocks([kv_caches[name] for name in names], names, group_backend(backends, names),
                                    self.layout, self.block_size, host_memory=self.link.shared_memory)

    # ---- load ----------------------------------------------------------------------------------
    def start_load_kv(self, meta) -> None:
        """Load this step's ``meta.loads`` (vLLM's connector metadata for the step)."""
        self._layer_loads = []
        if isinstance(meta, KVTierConnectorMetadata) and meta.loads:
            self._load_all(meta.loads)

    def _load_all(self, loads: list[LoadOp]) -> None:
        deadline = time.monotonic() + self.load_timeout_seconds  # one deadline for the step's loads: none waits longer
        for op in loads:
            started = time.monotonic()
            ok_end = self.link.call("retrieve", self._load, op, deadline, default=op.start)
            if ok_end < op.end:  # fewer tokens than promised: vLLM recomputes these blocks
                late = time.monotonic() > deadline
                self.metrics.inc("kvtier_connector_load_failed_tokens_total", op.end - ok_end,
                                 reason="deadline" if late else "miss")
                self._load_errors.update(op.block_ids[(ok_end - op.start) // self.block_size:])
                logger.warning("kvtier: request %s: loaded %d of %d promised tokens (%s); vLLM recomputes the rest",
                               op.req_id, ok_end - op.start, op.end - op.start,
                               f"past the {self.load_timeout_seconds:g} s deadline" if late else "not available")
            logger.debug("kvtier: request %s: loaded tokens [%d, %d) of [%d, %d) in %.4f s", op.req_id, op.start,
                         ok_end, op.start, op.end, time.monotonic() - started)

    def _load(self, op: LoadOp, deadline: float) -> int:
        """Copy the chunks covering ``[op.start, op.end)`` into vLLM's blocks (or stage them for a layerwise
        load); returns the end of what loaded (``op.start``: nothing usable)."""
        backend = self.link.backend
        if backend is None or time.monotonic() >= deadline:  # no backend here, or no time left this step
            return op.start
        bs = self.block_size
        staged = None
        with backend.retrieve_chunks(op.token_ids, timeout_seconds=max(0.0, deadline - time.monotonic()),
                                     **self.link.op_kw(op)) as got:
            ok_end = max(op.start, min(got.num_tokens, op.end) // bs * bs)
            if self.layerwise and ok_end > op.start:
                staged = torch.empty(self.layout.chunk_shape(ok_end - op.start), dtype=self._torch_dtype)
            for start, view in got.chunks:
                lo, hi = max(start, op.start), min(start + view.shape[2], ok_end)
                if lo >= hi:
                    continue
                chunk = as_torch(view, self._torch_dtype)
                if staged is not None:
                    staged[:, :, lo - op.start:hi - op.start].copy_(chunk[:, :, lo - start:hi - start])
                else:
                    scatter_chunk(self._blocks, op.block_ids[(lo - op.start) // bs:(hi - op.start) // bs],
                                  chunk, lo - start, hi - start)
        if not got.ok:  # a miss, or the pin ran out while copying: nothing copied is trustworthy
            return op.start
        if staged is not None:
            self._layer_loads.append((staged, op, ok_end))
        return ok_end

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        for staged, op, ok_end in self._layer_loads if i is not None else ():
            self._blocks.scatter_layer(i, op.block_ids, staged[i])
        if self._blocks is not None:  # CUDA: the compute stream waits (on the device) for this step's loads
            self._blocks.wait_loaded()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- save ----------------------------------------------------------------------------------
    def save_kv_layer(self, meta, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not self.layerwise or self.link.backend is None:
            return
        i = self._layer_index.get(layer_name)
        if i is None or not isinstance(meta, KVTierConnectorMetadata) or not meta.saves:
            return
        if not self._layer_saves:  # a renewal copies nothing unless a chunk went missing: from the blocks then
            self._layer_saves = [(torch.empty(self.layout.chunk_shape(len(op.token_ids)), dtype=self._torch_dtype), op)
                                 for op in meta.saves if not op.renew]
        for buf, op in self._layer_saves:
            self._blocks.gather_layer(i, op.block_ids, buf[i])

    def wait_for_save(self, meta) -> None:
        """Store this step's ``meta.saves`` (vLLM's connector metadata for the step, or None)."""
        self._layer_loads = []
        if self._blocks is not None:
            self._blocks.wait_loaded()  # a step whose forward read no layer (its loads were not waited for yet)
        staged, self._layer_saves = self._layer_saves, []
        if isinstance(meta, KVTierConnectorMetadata) and meta.saves and self.link.backend is not None:
            self._save_all(meta.saves, staged)
            self.link.report_costs()
            self._events.extend(to_vllm_events(self.link.take_events()))

    def _save_all(self, saves: list[SaveOp], staged: list) -> None:
        started = time.perf_counter()
        sources = staged + [(None, op) for op in saves if op.renew] if self.layerwise else [(None, op) for op in saves]
        stored = 0
        for buf, op in sources:
            stored += self.link.call("store", self.link.backend.store_chunks, op.token_ids, self._filler(op, buf),
                                     default=0, hint=op.hint, **self.link.op_kw(op))
        took = time.perf_counter() - started
        self.metrics.inc("kvtier_connector_store_calls_total", len(sources))
        self.metrics.inc("kvtier_connector_stored_chunks_total", stored)
        self.metrics.inc("kvtier_connector_store_seconds_total", took)
        logger.debug("kvtier: stored %d new chunks of %d requests in %.4f s", stored, len(sources), took)

    def take_events(self) -> list:
        """vLLM ``kv_events`` of this side's stores since the last call."""
        events, self._events = self._events, []
        return events

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Loads finished this step: none (with one group they are synchronous, inside the step)."""
        return KVConnectorTransferResults(finished_recving=set(), failed_recving=set())

    def _filler(self, op: SaveOp, staged: torch.Tensor | None):
        """``fill(start, dst)`` for ``store_chunks``: from vLLM's blocks, or from the layerwise staging tensor."""
        bs, dtype = self.block_size, self._torch_dtype

        def from_blocks(start: int, dst) -> None:
            gather_chunk(self._blocks, op.block_ids[start // bs:], as_torch(dst, dtype))

        def from_staged(start: int, dst) -> None:
            as_torch(dst, dtype).copy_(staged[:, :, start:start + dst.shape[2]])

        return from_blocks if staged is None else from_staged
