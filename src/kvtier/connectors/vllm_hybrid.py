"""The kvtier vLLM connector for hybrid models: several KV cache groups (sliding-window and full attention).

With vLLM's hybrid KV cache manager (the connector declares ``SupportsHMA``) a model such as Gemma-3 has several
KV cache groups, each with its own block table per request (``connectors.vllm_groups``). kvtier stores each
*part* (the groups of one attention kind and window) as its own chunks, through its own backend opened with the
part's ``KVLayout`` (whose ``group`` enters every chunk key, so keys never mix groups):

* a full-attention part stores and loads every chunk of the prompt;
* a sliding-window part stores only the chunks of the window a later load of this prompt needs (before the last
  block vLLM would load, ``KVPart.load_span``), and only while vLLM still holds their blocks
  (``KVPart.store_span``); a load writes only the blocks vLLM allocated, the window before the load's end. Its
  backend calls pass ``start`` (``KVBackend``): the chunks before it are hashed, never stored nor read.

Loads are asynchronous for vLLM (``get_num_new_matched_tokens`` answers ``(n, True)``): vLLM 0.32 refuses
block-level load errors with more than one group (``Scheduler._handle_invalid_blocks`` raises), so a load that
fails is reported as a failed receive (``get_transfer_results``) and vLLM recomputes the request. The worker
copies the KV in the step that carries the load and reports it finished in that same step. ``use_layerwise`` does
not apply (the copy happens outside the forward pass). ``HybridScheduler`` and ``HybridWorker`` are the
alternatives to the plain ``SchedulerSide`` and ``WorkerSide`` (their subclasses: the same vLLM-facing methods),
picked once by the connector's constructor when the model has several groups.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtier.connectors.vllm_cuda_layouts import group_backend, paged_blocks
from kvtier.connectors.vllm_layout import gather_chunk, scatter_chunk
from kvtier.connectors.vllm_scheduler import KVTierConnectorMetadata, SchedulerSide, scheduled_again
from kvtier.connectors.vllm_worker import WorkerSide
from kvtier.errors import InputError
from kvtier.hints import RetentionHint
from kvtier.tensors import as_torch

logger = logging.getLogger("vllm.kvtier_connector")


@dataclass
class PartLoad:
    """Tokens ``[lo, hi)`` of one part, into ``block_ids`` (one list per group of the part, blocks of ``[lo, hi)``)."""
    part: int
    lo: int
    hi: int
    block_ids: list[list[int]]


@dataclass
class HybridLoad:
    """One request's load: every part's span, or ``parts`` None when vLLM's blocks did not match the plan."""
    req_id: str
    token_ids: list[int]
    namespace: str
    extra_keys: list | None
    parts: list[PartLoad] | None


@dataclass
class HybridSave:
    """Store the chunks ``[lo, len(token_ids))`` of one part; ``block_ids`` per group of the part, from token 0
    (entries before ``lo`` are not read: they may be stale or the null block)."""
    req_id: str
    part: int
    token_ids: list[int]
    namespace: str
    extra_keys: list | None
    lo: int
    block_ids: list[list[int]]
    hint: RetentionHint | None = None  # the request's retention hint (kv_transfer_params)


@dataclass
class _HybridTrack:
    token_ids: list[int]
    namespace: str
    extra_keys: list | None
    tables: list[list[int]]  # per vLLM group, as the scheduler handed them out
    stored_upto: list[int]  # per part: chunks before this are held (or asked for)
    store_limit: int
    keep_from: list[int] = field(default_factory=list)  # per part: the first chunk worth storing
    hint: RetentionHint | None = None


class HybridScheduler(SchedulerSide):
    """The load and save plan of a model with several KV cache groups (module docstring).

    ``link``: the side's ``KVTierLink`` (one backend per part of ``groups``, the model's ``KVGroups``); the
    other arguments are ``SchedulerSide``'s.
    """

    reuses_lookups = False  # loads are asynchronous: a request is asked about anew once its load is done

    def __init__(self, link, identity, groups, *, can_load: bool, can_store: bool, store_after_seen: int):
        super().__init__(link, identity, can_load=can_load, can_store=can_store, store_after_seen=store_after_seen)
        self.groups = groups
        self._pending: list[HybridLoad] = []  # planned after the allocation, handed to the next step's metadata
        self._load_failed: set[str] = set()  # requests whose load failed: recomputed, never offered again

    def loads_failed(self, req_ids) -> None:
        """The worker's failed receives (``update_connector_output``): vLLM recomputes these requests from
        scratch and asks the connector again; kvtier must then answer 0, or the request loops on the same failure."""
        self._load_failed.update(req_ids or ())

    def _load_end(self, tokens: list[int], num_computed: int, limit: int, kw: dict) -> tuple[int, int]:
        """``(end, l1_end)``: where a load from kvtier ends (every part holds what it needs up to there; block
        aligned; ``end <= num_computed``: nothing to load) and where the full-attention part's L1 run ends."""
        bs, c = self.groups.block_size, self.chunk_size
        end = limit // bs * bs
        seen: dict[tuple[int, int], tuple[int, int]] = {}
        l1_end = 0
        for _ in range(4):  # each round only lowers ``end``; a sliding window moves back with it
            before = end
            for i, part in enumerate(self.groups.parts):
                lo, _ = part.load_span(num_computed, end)
                if lo >= end:
                    continue
                first = lo // c * c
                if (i, first) not in seen:
                    seen[i, first] = self.link.call("lookup", self.link.backends[i].lookup_tiers, tokens, default=(0, 0),
                                                start=first, **kw)
                hit, l1 = seen[i, first]
                if i == 0:
                    l1_end = min(l1, hit)
                end = min(end, hit // bs * bs)
            if end == before or end <= num_computed:
                break
        return end, l1_end

    def _match(self, request, look, tokens: list[int]) -> tuple[int, bool]:
        """Ask every part about ``tokens`` and complete ``look`` (a new ``_Lookup``): ``(tokens, True)``."""
        if request.request_id in self._load_failed:
            return 0, False
        limit = len(tokens) - 1
        if look.controls.max_load_tokens is not None:
            limit = min(limit, look.controls.max_load_tokens)
        kw = self.link.ns_kw(look.namespace, look.extra_keys, len(tokens))
        end, l1_end = self._load_end(tokens, look.num_computed, limit, kw)
        if end <= look.num_computed:
            return 0, False
        look.end = look.hit = end
        look.l1_hit = min(l1_end, end)
        logger.info("kvtier: request %s: %d prompt tokens, vLLM has %d, kvtier has every part up to %d (%d in L1), "
                    "loading %d", request.request_id, len(tokens), look.num_computed, end, look.l1_hit,
                    end - look.num_computed)
        return end - look.num_computed, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        look = self._lookups.get(request.request_id)
        if look is None or num_external_tokens <= 0:
            return
        start, end = look.end - num_external_tokens, look.end
        tables = blocks.get_block_ids()
        tokens = list(request.prompt_token_ids or [])
        parts: list[PartLoad] | None = []
        try:
            for i, part in enumerate(self.groups.parts):
                lo, hi = part.load_span(start, end)
                if lo < hi:
                    parts.append(PartLoad(i, lo, hi, part.block_ids(tables, lo, hi)))
        except InputError as exc:  # vLLM allocated otherwise than planned: fail the load, vLLM recomputes
            logger.warning("kvtier: request %s: %s; its load is reported failed", request.request_id, exc)
            parts = None
        end_chunk = min(len(tokens), -(-end // self.chunk_size) * self.chunk_size)
        self._pending.append(HybridLoad(request.request_id, tokens[:end_chunk], look.namespace, look.extra_keys,
                                        parts))

    def build_connector_meta(self, scheduler_output) -> KVTierConnectorMetadata:
        """This step's ``HybridLoad``s and ``HybridSave``s; pops the scheduled requests' lookups and planned loads."""
        meta = KVTierConnectorMetadata(loads=self._pending)
        self._pending = []
        for load in meta.loads:
            self._loads.pop(load.req_id, None)  # only for the hit sources, asked right after the allocation
        for new in scheduler_output.scheduled_new_reqs:
            look = self._lookups.pop(new.req_id, None)
            self._loads.pop(new.req_id, None)
            tokens = list(new.prompt_token_ids or [])
            limit = len(tokens)
            ns, extra, loaded, hint = "", None, 0, None
            if look is not None:
                ns, extra, loaded, hint = look.namespace, look.extra_keys, look.end, look.controls.hint
                if look.controls.max_store_tokens is not None:
                    limit = look.controls.max_store_tokens
                if look.seen_upto is not None:  # connector.store_after_seen
                    limit = min(limit, look.seen_upto)
            done = loaded // self.chunk_size * self.chunk_size
            track = _HybridTrack(tokens, ns, extra, [list(t) for t in new.block_ids],
                                 [done] * len(self.groups.parts), limit, hint=hint)
            track.keep_from = self._keep_from(track)
            self._tracks[new.req_id] = track
            self._plan_part_saves(meta, new.req_id, new.num_computed_tokens,
                                  new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        tables = {req_id: track.tables for req_id, track in self._tracks.items()}
        for req_id, before, after in scheduled_again(scheduler_output, tables):
            self._plan_part_saves(meta, req_id, before, after)
        for req_id in scheduler_output.finished_req_ids:
            self._tracks.pop(req_id, None)
        self.link.report_costs()
        return meta

    def _keep_from(self, track: _HybridTrack) -> list[int]:
        """Per part, the first chunk worth storing: 0 for full attention; for a sliding window, the chunk holding
        the first token of the window a load of this very prompt would need (a longer prompt's load ends later and
        needs a later window, which these chunks also cover)."""
        c, bs = self.chunk_size, self.groups.block_size
        last = min(len(track.token_ids), track.store_limit) // c * c
        load_end = min(last, (len(track.token_ids) - 1) // bs * bs)
        return [part.load_span(0, load_end)[0] // c * c for part in self.groups.parts]

    def _plan_part_saves(self, meta, req_id: str, before: int, after: int) -> None:
        """Plan each part's store of what vLLM computed from ``before`` to ``after`` (``HybridSave``)."""
        track = self._tracks[req_id]
        c = self.chunk_size
        last = min(len(track.token_ids), track.store_limit) // c * c
        if self.can_store and self.link.backend is not None:
            for i, part in enumerate(self.groups.parts):
                span_lo, span_hi = part.store_span(before, after, c)
                lo = max(span_lo, track.keep_from[i], track.stored_upto[i])
                hi = min(span_hi, last)
                if hi <= lo:
                    continue
                nb = -(-hi // part.block_size)
                meta.saves.append(HybridSave(req_id, i, track.token_ids[:hi], track.namespace,
                                                    track.extra_keys, lo,
                                                    [list(track.tables[g][:nb]) for g in part.group_ids], track.hint))
                track.stored_upto[i] = hi
        if not self.can_store or all(s >= last for s in track.stored_upto):
            self._tracks.pop(req_id, None)

    def request_finished(self, request, block_ids):
        self._load_failed.discard(request.request_id)
        return super().request_finished(request, block_ids)


class HybridWorker(WorkerSide):
    """The loads and saves of a model with several KV cache groups (module docstring).

    ``link``: the side's ``KVTierLink``; ``layout``: the model's ``KVLayout`` (the dtype of the blocks);
    ``groups``: its ``KVGroups``; ``load_timeout_seconds``: one step's deadline for its loads.
    """

    def __init__(self, link, layout, groups, *, load_timeout_seconds: float):
        super().__init__(link, layout, layerwise=False, load_timeout_seconds=load_timeout_seconds)
        self.groups, self.chunk_size = groups, link.chunk_size
        self._group_blocks: dict[int, list] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()

    def register_kv_caches(self, kv_caches, backends: dict[str, str]) -> None:
        """vLLM's ``{layer name: KV cache}``; ``backends``: each layer's attention backend name."""
        self.groups.check_kv_caches(kv_caches)
        for part in self.groups.parts:
            for g, names in part.groups:
                self._group_blocks[g] = paged_blocks([kv_caches[name] for name in names], names,
                                                     group_backend(backends, names), part.layout, part.block_size,
                                                     host_memory=self.link.shared_memory)

    def _load_all(self, loads: list[HybridLoad]) -> None:
        deadline = time.monotonic() + self.load_timeout_seconds
        for op in loads:
            ok = op.parts is not None and self.link.call("retrieve", self._load, op, deadline, default=False)
            self._recv_done.add(op.req_id)
            if not ok:
                self._recv_failed.add(op.req_id)
                late = time.monotonic() > deadline
                self.metrics.inc("kvtier_connector_load_failed_tokens_total",
                                 max((p.hi for p in op.parts or []), default=0), reason="deadline" if late else "miss")
                logger.warning("kvtier: request %s: the load from kvtier failed (%s); vLLM recomputes the request",
                               op.req_id, f"past the {self.load_timeout_seconds:g} s deadline" if late else
                               "not available")
        for blocks in self._group_blocks.values():  # read in a later step: the compute stream waits for them now
            blocks.wait_loaded()

    def _load(self, op: HybridLoad, deadline: float) -> bool:
        """Copy every part's span of ``op`` into vLLM's blocks; True when all of it loaded."""
        c = self.chunk_size
        for pl in op.parts:
            part, backend = self.groups.parts[pl.part], self.link.backends[pl.part]
            if backend is None or time.monotonic() >= deadline:
                return False
            bs, slices = part.block_size, part.layer_slices()
            with backend.retrieve_chunks(op.token_ids, timeout_seconds=max(0.0, deadline - time.monotonic()),
                                         start=pl.lo // c * c, **self.link.ns_kw(op.namespace, op.extra_keys,
                                                                             len(op.token_ids))) as got:
                if got.num_tokens < pl.hi:
                    return False
                for first, view in got.chunks:
                    lo, hi = max(first, pl.lo), min(first + view.shape[2], pl.hi)
                    if lo >= hi:
                        continue
                    chunk = as_torch(view, self._torch_dtype)
                    for (g, layers), ids in zip(slices, pl.block_ids):
                        scatter_chunk(self._group_blocks[g], ids[(lo - pl.lo) // bs:(hi - pl.lo) // bs],
                                      chunk[layers], lo - first, hi - first)
            if not got.ok:  # a pin ran out while copying: nothing copied is trustworthy
                return False
        return True

    def _save_all(self, saves: list[HybridSave], staged: list) -> None:
        for op in saves:
            backend = self.link.backends[op.part]
            if backend is not None:
                self.link.call("store", backend.store_chunks, op.token_ids, self._filler(op), default=0,
                               start=op.lo, hint=op.hint,
                               **self.link.ns_kw(op.namespace, op.extra_keys, len(op.token_ids)))

    def _filler(self, op: HybridSave):
        part = self.groups.parts[op.part]
        bs, slices, dtype = part.block_size, part.layer_slices(), self._torch_dtype

        def fill(start: int, dst) -> None:
            out = as_torch(dst, dtype)
            for (g, layers), ids in zip(slices, op.block_ids):
                gather_chunk(self._group_blocks[g], ids[start // bs:], out[layers])

        return fill

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads finished this step (hybrid models): failed ones also among the finished, as vLLM asks."""
        done, failed = self._recv_done, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)
