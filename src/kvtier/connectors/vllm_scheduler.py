"""The scheduler side of the kvtier vLLM connector: what to load and store, planned per step.

``get_num_new_matched_tokens`` asks kvtier (``KVBackend.lookup_tiers``) how many leading prompt tokens it
holds, and in which tier, and offers the part beyond vLLM's own prefix-cache hit, capped at the last whole
block before the final prompt token (vLLM must compute at least one token) and at the request's
``max_load_tokens``. ``get_external_cache_hit_sources`` splits the offered tokens into host (kvtier's L1)
and disk (kvtier's L2), exactly as the lookup counted them in ``kvtier_lookup_hit_tokens_total``.
``build_connector_meta`` turns the plan into ``LoadOp`` / ``SaveOp`` for the worker (``vllm_worker``).
When the lookup finds chunks only kvtier's L2 holds, the scheduler sends the server a ``Prefetch`` at once (no
reply awaited), so the promotion into L1 overlaps vLLM's scheduling instead of starting with the worker's load.

The save plan costs as little as the scheduler can make it (issue 12): vLLM asks ``get_num_new_matched_tokens``
again at every scheduling attempt of a request that waits for KV blocks, so the first lookup of a request is kept
and reused until the request is scheduled (``kvtier_connector_lookups_total{reused="true"}``); chunks the lookup
found in kvtier are never offered for saving (the worker copies only what lies past them), except that a request
with a retention hint whose whole chunks kvtier all holds is stored once anyway, to renew its hint (a store of
held chunks copies nothing); and with
``connector.store_after_seen`` N > 1 a chunk is stored only once N prompts have contained it (counted by vLLM's
own block hashes), so a prefix seen once costs no copy at all.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connectors.vllm_config import NO_TRANSFER, RequestControls, request_controls
from kvtier.errors import ConfigError
from kvtier.hints import RetentionHint

logger = logging.getLogger("vllm.kvtier_connector")

SEEN_CAPACITY = 1 << 18  # chunk keys counted for store_after_seen (about 40 MB at most); the oldest are forgotten


@dataclass
class LoadOp:
    """Copy tokens ``[start, end)`` of ``token_ids`` (the prompt up to the end of the chunk holding ``end``) from
    kvtier into ``block_ids`` (the blocks of that range)."""
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
    hint: RetentionHint | None = None  # the request's retention hint (kv_transfer_params)
    renew: bool = False  # kvtier held every chunk already: the store only renews the hint (nothing staged)


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """One step's plan: ``LoadOp`` / ``SaveOp``, or for a model with several KV cache groups ``vllm_hybrid``'s
    ``HybridLoad`` / ``HybridSave`` (the scheduler and the worker of one connector are of the same kind)."""

    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


@dataclass
class _Lookup:
    """What the scheduler learned about a request before its blocks were allocated."""
    num_computed: int  # vLLM's own hit
    end: int  # the load ends here (block-aligned)
    hit: int  # leading tokens kvtier holds
    l1_hit: int  # of which in kvtier's L1
    namespace: str
    extra_keys: list | None
    controls: RequestControls
    num_prompt: int = 0  # prompt tokens the lookup was made for (a changed prompt is looked up again)
    seen_upto: int | None = None  # store_after_seen > 1: leading tokens of chunks seen often enough to store


@dataclass
class _Track:
    token_ids: list[int]
    namespace: str
    block_ids: list[int]
    stored_upto: int  # tokens kvtier already holds (or that this connector already asked to store)
    store_limit: int  # store no chunk ending after this token (the request's max_offload_tokens)
    extra_keys: list | None = None  # per block of the prompt
    hint: RetentionHint | None = None
    renew: bool = False  # a hinted prompt kvtier already holds whole: one store of it still renews the hint


def scheduled_again(scheduler_output, tables: dict[str, list[list[int]]]):
    """Walk vLLM's ``scheduled_cached_reqs`` (running or resumed requests scheduled again) for the requests in
    ``tables`` (req_id -> block ids per KV cache group; others are skipped).

    Mutates ``tables``' lists in place: a resumed request's are replaced by its new block ids (emptied when vLLM
    sent none), a running one's extended by the blocks allocated this step. Yields ``(req_id, tokens computed
    before this step, tokens computed after it)``.
    """
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        if req_id not in tables:
            continue
        new_ids = cached.new_block_ids[i]
        resumed = req_id in cached.resumed_req_ids
        for g, table in enumerate(tables[req_id]):
            ids = new_ids[g] if new_ids else []
            if resumed:
                table[:] = ids
            else:
                table.extend(ids)
        before = cached.num_computed_tokens[i]
        yield req_id, before, before + scheduler_output.num_scheduled_tokens[req_id]


class SchedulerSide:
    """The scheduler side of ``KVTierConnector`` for a model with one KV cache group: owns the requests' lookups,
    planned loads and save tracks. ``vllm_hybrid.HybridScheduler`` is the alternative for several groups, with the
    same vLLM-facing methods; the connector's constructor picks one.

    ``link``: the side's ``KVTierLink``; ``identity``: the ``VLLMIdentity`` naming a request's namespace and extra
    keys; ``can_load`` / ``can_store``: the connector's role allows them; ``store_after_seen``: the
    ``connector.store_after_seen`` setting.
    """

    reuses_lookups = True  # a retry while the request waits for blocks gets the first lookup's answer

    def __init__(self, link, identity, *, can_load: bool, can_store: bool, store_after_seen: int):
        self.link, self.identity = link, identity
        self.metrics, self.chunk_size, self.block_size = link.metrics, link.chunk_size, link.block_size
        self.can_load, self.can_store = can_load, can_store
        self._lookups: dict[str, _Lookup] = {}
        self._loads: dict[str, tuple[int, int, int]] = {}  # req_id -> (start, end, l1 hit)
        self._tracks: dict[str, _Track] = {}
        self._store_after_seen = store_after_seen
        self._seen: OrderedDict = OrderedDict()  # chunk key -> prompts that held it (LRU, SEEN_CAPACITY keys)

    def _controls(self, request) -> RequestControls:
        try:
            return request_controls(request.kv_transfer_params)
        except ConfigError as exc:  # a request mistake must not stop the engine: served without kvtier
            self.metrics.inc("kvtier_connector_bad_requests_total")
            logger.error("kvtier: request %s served without kvtier (no load, no store): %s", request.request_id, exc)
            return NO_TRANSFER

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        tokens = request.prompt_token_ids or []
        look = self._lookups.get(request.request_id)
        if look is not None and look.num_prompt == len(tokens) and self.reuses_lookups:
            # a retry while the request waits for blocks: kvtier was asked moments ago, and a chunk evicted
            # since is a failed load that vLLM recomputes (kv_load_failure_policy "recompute")
            look.num_computed = num_computed_tokens
            self.metrics.inc("kvtier_connector_lookups_total", reused="true")
            return max(0, look.end - num_computed_tokens), False
        ns, extra = self.identity.request_keys(request)
        controls = self._controls(request)
        look = _Lookup(num_computed_tokens, 0, 0, 0, ns, extra, controls, len(tokens))
        self._lookups[request.request_id] = look
        if self._store_after_seen > 1:
            look.seen_upto = self._count_sighting(request, ns, len(tokens))
        if not self.can_load or self.link.backend is None or controls.max_load_tokens == 0:
            return 0, False
        return self._match(request, look, list(tokens))

    def _match(self, request, look: _Lookup, tokens: list[int]) -> tuple[int, bool]:
        """Ask kvtier about ``tokens`` and complete ``look``: ``(tokens to load, load asynchronously)``."""
        backend, ns, extra, num_computed_tokens = self.link.backend, look.namespace, look.extra_keys, look.num_computed
        started = time.perf_counter()
        hits = self.link.call("lookup", backend.lookup_tiers, tokens, default=(0, 0),
                              **self.link.ns_kw(ns, extra, len(tokens)))
        self.metrics.inc("kvtier_connector_lookup_seconds_total", time.perf_counter() - started)
        self.metrics.inc("kvtier_connector_lookups_total", reused="false")
        look.hit, look.l1_hit = hits[0] // self.chunk_size * self.chunk_size, min(hits[1], hits[0])
        controls = look.controls
        limit = (len(tokens) - 1) if controls.max_load_tokens is None else min(len(tokens) - 1, controls.max_load_tokens)
        look.end = min(look.hit, limit // self.block_size * self.block_size)
        if look.hit > look.l1_hit and look.end > num_computed_tokens and not self.link.in_process:
            # start the L2 -> L1 promotion now, on the server's pool, while vLLM finds blocks for the request
            # and schedules it: the worker's retrieve then finds the chunks in L1 (or joins a promotion in
            # flight). In process, a prefetch would block this scheduler on L2 I/O, so none is sent.
            self.link.call("prefetch", backend.prefetch, tokens[:look.hit], **self.link.ns_kw(ns, extra, look.hit))
            self.metrics.inc("kvtier_connector_prefetches_total")
        if look.hit:
            logger.info("kvtier: request %s: %d prompt tokens, vLLM has %d, kvtier has %d (%d in L1), loading %d",
                        request.request_id, len(tokens), num_computed_tokens, look.hit, look.l1_hit,
                        max(0, look.end - num_computed_tokens))
        return max(0, look.end - num_computed_tokens), False

    def _count_sighting(self, request, namespace: str, num_tokens: int) -> int:
        """Count one more prompt holding each whole chunk of ``request``; returns the leading tokens whose
        chunks have now been seen ``store_after_seen`` times (only those may be stored). A chunk's key is vLLM's
        hash of its last block (chained over the whole prefix, with LoRA and salt) or, without vLLM's hashes
        (prefix caching off), Python's hash of the prefix's tokens (a collision only stores a chunk early)."""
        c, bs = self.chunk_size, self.block_size
        hashes = getattr(request, "block_hashes", None) or []
        tokens = request.prompt_token_ids or []
        upto = 0
        for end in range(c, num_tokens // c * c + 1, c):
            key = (namespace, hashes[end // bs - 1]) if len(hashes) >= end // bs else (namespace, hash(tuple(tokens[:end])))
            n = self._seen.pop(key, 0) + 1
            self._seen[key] = n
            if n >= self._store_after_seen and upto == end - c:
                upto = end
        while len(self._seen) > SEEN_CAPACITY:
            self._seen.popitem(last=False)
        return upto

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        look = self._lookups.get(request.request_id)
        if look is not None and num_external_tokens > 0:
            self._loads[request.request_id] = (look.end - num_external_tokens, look.end, look.l1_hit)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """Tokens ``[start, end)`` being loaded, split: those inside kvtier's L1 hit are HOST, the rest DISK."""
        if num_external_tokens == 0:
            return {}
        start, end, l1_hit = self._loads.get(request.request_id, (0, num_external_tokens, 0))
        host = max(0, min(l1_hit, end) - start)
        split = {CacheHitSource.HOST: host, CacheHitSource.DISK: num_external_tokens - host}
        return {source: n for source, n in split.items() if n > 0}

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVTierConnectorMetadata()
        bs = self.block_size
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            look = self._lookups.pop(new.req_id, None) or _Lookup(0, 0, 0, 0, "", None, RequestControls())
            limit = len(tokens) if look.controls.max_store_tokens is None else look.controls.max_store_tokens
            if look.seen_upto is not None:
                limit = min(limit, look.seen_upto)
            track = _Track(tokens, look.namespace, list(new.block_ids[0]), look.hit, limit, look.extra_keys,
                           look.controls.hint)
            track.renew = bool(track.hint and track.hint.protects) and look.hit >= min(len(tokens), limit) // \
                self.chunk_size * self.chunk_size > 0
            if new.req_id in self._loads:
                start, end, _ = self._loads.pop(new.req_id)
                # the tokens up to the end of the chunk holding ``end``: a chunk's key needs all its tokens (vLLM
                # always computes the last prompt token, so a load often ends inside the prompt's last chunk)
                upto = min(len(tokens), -(-end // self.chunk_size) * self.chunk_size)
                meta.loads.append(LoadOp(new.req_id, tokens[:upto], look.namespace, start, end,
                                         track.block_ids[start // bs:end // bs], look.extra_keys))
            self._tracks[new.req_id] = track
            self._plan_save(meta, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        tables = {req_id: [track.block_ids] for req_id, track in self._tracks.items()}
        for req_id, _, computed_end in scheduled_again(scheduler_output, tables):
            self._plan_save(meta, req_id, computed_end)
        for req_id in scheduler_output.finished_req_ids:
            self._tracks.pop(req_id, None)
        self.link.report_costs()
        return meta

    def _plan_save(self, meta: KVTierConnectorMetadata, req_id: str, computed_end: int) -> None:
        """Plan the store of the whole chunks computed by ``computed_end`` that kvtier lacks. A hinted prompt whose
        chunks kvtier all held at the lookup (a turn that added less than a chunk) is stored once all of them are
        in vLLM's blocks: nothing is copied unless a chunk was evicted meanwhile, and the hint is renewed."""
        track = self._tracks[req_id]
        c = self.chunk_size
        last = min(len(track.token_ids), track.store_limit) // c * c
        end = min(computed_end, last) // c * c
        can = self.can_store and self.link.backend is not None
        renew = can and track.renew and end == last
        if can and (end > track.stored_upto or renew):
            nb = -(-end // self.block_size)
            meta.saves.append(SaveOp(req_id, track.token_ids[:end], track.namespace, track.block_ids[:nb],
                                     track.extra_keys, track.hint, renew=renew))
            track.stored_upto, track.renew = max(track.stored_upto, end), False
        if (track.stored_upto >= last and not track.renew) or not self.can_store:
            self._tracks.pop(req_id, None)  # nothing more to store for this prompt

    def request_finished(self, request, block_ids):
        self._tracks.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None  # saves are synchronous: the blocks may be freed at once

    def request_finished_all_groups(self, request, block_ids):
        """vLLM's hybrid KV cache manager (``SupportsHMA``): ``block_ids`` per KV cache group."""
        return self.request_finished(request, block_ids)

    def loads_failed(self, req_ids) -> None:
        """The worker's failed receives (``update_connector_output``): none with one group (its loads are
        synchronous; a failed block is recomputed by vLLM)."""

    def reset_cache(self) -> None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: kvtier keeps its data (it is shared with other
        engines and survives restarts; its keys carry the model identity, so changed weights never hit old
        KV); clear kvtier itself with ``kvtier`` admin ``/clear``. Returns None, vLLM's "nothing to reset here"
        (False would make the whole reset fail after vLLM's own prefix cache was reset: Dynamo's
        ``clear_kv_blocks`` answers "KV cache reset failed")."""
        logger.warning("kvtier: vLLM asked the connector to reset its cache; kvtier keeps its data (shared with "
                       "other engines, keyed by model identity). To drop it, POST /clear to the kvtier server's "
                       "admin port (or delete the in-process cache's L2 folder)")
        return None
