"""KVCache: lookup / store / retrieve / clear over L1 and the L2 cascade.

``KVCache`` is the in-process ``KVBackend`` (``kvtier.backend``). One storage path: ``store_chunks`` and
``retrieve_chunks`` (zero-copy views over L1 slots) are built from the chunk-level primitives
(``begin_store``/``commit_store``, ``begin_retrieve``/``end_retrieve``) that the server also uses to let
clients copy through shared memory; ``store`` and ``retrieve`` (whole tensors) wrap them. The tiers a cache
works over are ``kvtier.cache.tiers.Tiers``; the refs and tickets it hands out are in ``kvtier.cache.tickets``.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import xxhash

from kvtier.backend import Fill, Retrieved, TierHits
from kvtier.cache.lookups import Lookups, refs_from
from kvtier.cache.promotions import Promotions
from kvtier.cache.prompt_keys import PromptKeys
from kvtier.cache.tickets import ChunkRef, L1Slot, RetrieveTicket, StoreTicket
from kvtier.cache.tiers import Tiers
from kvtier.config import KVTierConfig
from kvtier.errors import InputError, KVTierError
from kvtier.hashing import as_token_array, prefix_hashes
from kvtier.hints import RetentionHint, check_ttl_bound
from kvtier.keys import chunk_layout_id
from kvtier.l2.tier import WriteItem
from kvtier.layout import KVLayout
from kvtier.tensors import as_numpy, chunk_view, copy_from, join_chunks
from kvtier.medium import Medium


class KVCache:
    """A KV cache for one (model, KV layout) over shared tiers.

    Args:
        config: the configuration tree (chunk and block size, hashing, L1 size, L2 adapters, events).
        model: the weights' identity (``identity.model_identity``, or a model id that changes with the
            weights); part of every key.
        layout: the KV layout; part of every key (so different dtypes or TP splits never mix).
        namespace: default namespace (LoRA identity / cache_salt, see ``keys.namespace_of``).
        tiers: shared tiers (a server passes one for all its caches); created from ``config`` if None.

    Every method that takes tokens also takes ``extra_keys``: None, or one entry per block of ``block_size``
    tokens (a trailing partial block included), each None or a tuple of the engine's extra keys for that block
    (``extra_keys.block_extra_keys``; vLLM's ``generate_block_hash_extra_keys``). They enter the hashes, so a
    LoRA, salted or multimodal request never shares chunks with another. Bad ones raise InputError.
    """

    def __init__(self, config: KVTierConfig, model: str, layout: KVLayout, *, namespace: str = "",
                 tiers: Tiers | None = None, publish_events: bool = True):
        if not isinstance(model, str) or not model:
            raise InputError("model must be a non-empty model id string")
        self.config = config
        self.model = model
        self.layout = layout
        self.namespace = namespace
        self._owns_tiers = tiers is None
        self.tiers = tiers or Tiers(config, publish_events=publish_events)
        self.l1, self.l2, self.metrics = self.tiers.l1, self.tiers.l2, self.tiers.metrics
        try:
            self.l2.codecs.check_writer(model)  # no tier fills with lossy records this model may not be served
        except KVTierError:
            if self._owns_tiers:
                self.tiers.close()
            raise
        self.keys = PromptKeys(config, model, chunk_layout_id(layout.layout_id, config.chunk_size), namespace,
                               self.tiers.memo, self.metrics, layout.layout_id)
        self.lookups = Lookups(self.keys, self.tiers, config.chunk_size)
        self.promotions = Promotions(self.tiers, layout)

    # ---- keys and lookups ------------------------------------------------------------
    def chunk_refs(self, tokens, namespace: str | None = None, *, extra_keys=None,
                   hasher=prefix_hashes) -> tuple[np.ndarray, list[ChunkRef]]:
        """``PromptKeys.chunk_refs`` (validated tokens and the prompt's chunk refs, hashed once)."""
        return self.keys.chunk_refs(tokens, namespace, extra_keys=extra_keys, hasher=hasher)

    def unhashed_tokens(self, tokens, namespace: str | None = None, *, extra_keys=None) -> int:
        """``PromptKeys.unhashed_tokens``."""
        return self.keys.unhashed_tokens(tokens, namespace, extra_keys=extra_keys)

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk (``config.chunk_size``)."""
        return self.config.chunk_size

    def lookup(self, tokens, namespace: str | None = None, *, extra_keys=None, start: int = 0) -> int:
        """Number of leading tokens whose KV is available (L1, then L2). Read-only: nothing is promoted."""
        return self.lookups.match(tokens, namespace, extra_keys=extra_keys, start=start).hits.num_tokens

    def lookup_tiers(self, tokens, namespace: str | None = None, *, extra_keys=None, start: int = 0) -> TierHits:
        """``lookup`` split by tier (``KVBackend.lookup_tiers``; ``Lookups.match``, counted)."""
        return self.lookups.match(tokens, namespace, extra_keys=extra_keys, start=start).hits

    # ---- store -------------------------------------------------------------------------
    def begin_store(self, tokens, namespace: str | None = None, *, extra_keys=None,
                    max_bytes: int | None = None, start: int = 0, hint: RetentionHint | None = None) -> StoreTicket:
        """Reserve L1 slots for the chunks of ``tokens`` not yet stored, from ``start``'s chunk on (stops at the
        first chunk that cannot get space, or that would take the reserved bytes past ``max_bytes``: then
        ``ticket.limited``). The slots are invisible until ``commit_store``. ``hint`` (``retention.check_hint``)
        is applied at commit to every chunk of the prompt L1 then holds, already-stored ones and those before
        ``start`` included. Raises InputError (before anything is reserved) for a hint whose TTL passes
        ``retention_max_ttl_seconds``, and what ``chunk_refs`` raises."""
        check_ttl_bound(hint, self.config.retention_max_ttl_seconds)
        arr, prompt_refs = self.chunk_refs(tokens, namespace, extra_keys=extra_keys)
        refs = refs_from(prompt_refs, start, self.chunk_size)
        ticket = StoreTicket(arr, refs, hint=hint)
        if hint is not None and hint.protects and len(refs) < len(prompt_refs):
            ticket.hinted_before = [ref.key for ref in prompt_refs[:len(prompt_refs) - len(refs)]]
        reserved = 0
        for ref in refs:
            if self.l1.contains(ref.key):
                continue
            nbytes = self.layout.chunk_bytes(ref.end - ref.start)
            if max_bytes is not None and reserved + nbytes > max_bytes:
                ticket.limited = True
                break
            reserved += nbytes
            view = self.l1.reserve(ref.key, nbytes, ref.end - ref.start)
            if view is None:
                if self.l1.contains(ref.key):  # stored meanwhile by another writer
                    continue
                break
            ticket.slots.append(L1Slot(ref, self.l1.offset(ref.key), nbytes, view))
        return ticket

    def commit_store(self, ticket: StoreTicket, ok: bool = True) -> int:
        """Publish (``ok``) or drop the reserved slots; queue L2 writes and emit events. Returns chunks stored."""
        if not ok:
            for slot in ticket.slots:
                self.l1.abort(slot.ref.key)
            return 0
        # the L2 record's checksum is taken from the bytes as committed: if they change later, the L2 writer
        # sees it (and skips the write), and a record written from changed bytes fails verification on read
        checksums = {slot.ref.index: xxhash.xxh3_64_intdigest(slot.view) for slot in ticket.slots} \
            if self.l2.adapters else {}
        for slot in reversed(ticket.slots):  # tail inserted first: the policy evicts tails before heads
            self.l1.commit(slot.ref.key)
        self.metrics.inc("kvtier_store_chunks_total", len(ticket.slots))
        if ticket.hint is not None and ticket.hint.protects:
            refused = self.l1.hint(ticket.hinted_before + [ref.key for ref in ticket.refs], ticket.hint)[1]
            self.metrics.inc("kvtier_retention_refused_chunks_total", refused)
        for run in _runs(ticket.slots):
            if self.tiers.events is not None:
                self.tiers.events.stored(ticket.tokens, [slot.ref for slot in run], Medium.CPU)
            items, refs, offsets = [], [], {}
            for slot in run:
                pinned = self.l1.acquire(slot.ref.key, count_access=False)  # keep the bytes until written
                if pinned is None:
                    break
                items.append(WriteItem(slot.ref.key, self.layout,
                                       ticket.tokens[slot.ref.start:slot.ref.end].tolist(), pinned[0],
                                       checksums.get(slot.ref.index)))
                refs.append(slot.ref)
                offsets[slot.ref.key] = pinned[2]
            if len(items) < len(run) and self.l2.adapters and ticket.on_lost is not None:
                ticket.on_lost(len(run) - len(items))  # evicted before it could be written
            self.l2.write_async(ticket.tokens, items, lambda key, at=offsets: self.l1.release(key, at[key]), refs,
                                lost=ticket.on_lost, hint=ticket.hint)
        self.tiers.refresh_gauges()
        return len(ticket.slots)

    def quarantine_store(self, ticket: StoreTicket) -> list[tuple[int, int]]:
        """Drop the ticket's reservations (nothing becomes visible) but keep their slots out of use: a writer
        that may still be copying into them (a stalled client past its lease) cannot touch anyone's chunk.
        Returns ``(token, nbytes)`` per slot, for ``L1Store.free_quarantined`` once the writer is gone."""
        out = []
        for slot in ticket.slots:
            token = self.l1.quarantine(slot.ref.key)
            if token is not None:
                out.append((token, slot.nbytes))
        ticket.slots.clear()
        return out

    def store_chunks(self, tokens, fill: Fill, namespace: str | None = None, *, extra_keys=None, start: int = 0,
                     hint: RetentionHint | None = None) -> int:
        """``KVBackend.store_chunks`` in process: ``dst`` is the reserved L1 slot itself (``begin_store``), so
        the KV is copied once, by ``fill``. The chunks are published by ``commit_store`` (L2 writes queued,
        events emitted) only after every ``fill`` returned; chunks that got no L1 space are not asked for.

        Returns the number of chunks newly stored. Raises InputError for bad tokens; whatever ``fill`` raises
        frees the reserved slots (nothing is stored) and is raised.
        """
        started = time.perf_counter()
        ticket = self.begin_store(tokens, namespace, extra_keys=extra_keys, start=start, hint=hint)
        dtype = self.layout.numpy_dtype()
        try:
            for slot in ticket.slots:
                fill(slot.ref.start, chunk_view(slot.view, self.layout, slot.ref.end - slot.ref.start, dtype))
        except BaseException:
            self.commit_store(ticket, ok=False)
            raise
        stored = self.commit_store(ticket)
        self.metrics.observe("kvtier_store_seconds", time.perf_counter() - started)
        return stored

    def store(self, tokens, kv, namespace: str | None = None, *, extra_keys=None,
              hint: RetentionHint | None = None) -> int:
        """Store the KV of ``tokens`` through ``store_chunks``: only chunks not yet in L1 are written.

        Args:
            tokens: 1-D token ids, length T.
            kv: torch tensor or numpy array ``(num_layers, 2, T, num_kv_heads, head_dim)`` in the layout dtype.
            hint: retention hint for the prompt's chunks (``kvtier.l1.retention.check_hint``), or None.

        Returns:
            the number of chunks newly stored.

        Raises:
            InputError: bad tokens, or ``kv`` not of the layout's shape and dtype.
        """
        arr = as_token_array(tokens)
        self.layout.validate_kv(kv, len(arr))
        return self.store_chunks(arr, copy_from(as_numpy(kv)), namespace, extra_keys=extra_keys, hint=hint)

    # ---- retrieve ----------------------------------------------------------------------
    def l1_prefix(self, refs: list[ChunkRef]) -> int:
        """How many leading ``refs`` L1 holds now (no L2 access; one lock)."""
        return self.l1.leading([r.key for r in refs])

    def prefetch(self, tokens, namespace: str | None = None, *, extra_keys=None, wait: bool = True,
                 start: int = 0) -> int:
        """``KVBackend.prefetch`` in process: promote the leading L2 hits of ``tokens`` that L1 lacks into L1 (L2
        I/O: this call blocks on the adapters whatever ``wait`` says; the server runs it on its promotion
        pool). Returns the leading tokens L1 holds afterwards.
        A chunk gone from L2 (evicted, deleted) ends the prefix: a miss, never an error. Raises InputError for
        bad tokens. ``start``: as for ``KVBackend``, from that token's chunk on."""
        arr, refs = self.chunk_refs(tokens, namespace, extra_keys=extra_keys)
        refs = refs_from(refs, start, self.chunk_size)
        n = self.l1_prefix(refs)
        n += self.promotions.promote(arr, refs, n)
        return refs[n - 1].end if n else 0

    def begin_retrieve(self, tokens, namespace: str | None = None, *, extra_keys=None,
                       promote: bool = True, start: int = 0) -> RetrieveTicket:
        """Pin the leading available chunks (from ``start``'s chunk on) in L1, promoting L2 hits into L1 first
        (``Promotions.promote``; ``promote`` False: only what L1 holds now, with no L2 access, as on a server's
        request thread)."""
        arr, refs = self.chunk_refs(tokens, namespace, extra_keys=extra_keys)
        refs = refs_from(refs, start, self.chunk_size)
        n = self.l1_prefix(refs)
        if promote:
            n += self.promotions.promote(arr, refs, n)
        ticket = RetrieveTicket()
        # acquire tail first so the head ends up most recently used: tails are evicted before heads
        for ref in reversed(refs[:n]):
            got = self.l1.acquire(ref.key)
            if got is None:  # evicted meanwhile: keep only what precedes it
                for slot in ticket.slots:
                    self.l1.release(slot.ref.key, slot.offset)
                ticket.slots.clear()
                continue
            view, _, offset = got
            ticket.slots.append(L1Slot(ref, offset, view.nbytes, view))
        ticket.slots.reverse()
        self.metrics.inc("kvtier_retrieve_chunks_total", len(ticket.slots))
        return ticket

    def end_retrieve(self, ticket: RetrieveTicket) -> None:
        """Unpin the ticket's slots."""
        for slot in ticket.slots:
            self.l1.release(slot.ref.key, slot.offset)
        ticket.slots.clear()

    @contextlib.contextmanager
    def retrieve_chunks(self, tokens, namespace: str | None = None, *, extra_keys=None,
                        timeout_seconds: float | None = None, start: int = 0):
        """``KVBackend.retrieve_chunks`` in process: the views are the L1 slots themselves, pinned by
        ``begin_retrieve`` (L2 hits promoted into L1 first) and unpinned when the ``with`` block ends. Pins
        never expire here, so ``ok`` is True whenever ``num_tokens`` > 0, unless pinning took longer than
        ``timeout_seconds`` (a slow L2): then the answer is a miss. Raises InputError for bad tokens."""
        started = time.perf_counter()
        ticket = self.begin_retrieve(tokens, namespace, extra_keys=extra_keys, start=start)
        if timeout_seconds is not None and time.perf_counter() - started > timeout_seconds:
            self.end_retrieve(ticket)  # too late for the caller's deadline: answer a miss
        got = Retrieved(ticket.num_tokens, ok=ticket.num_tokens > 0)
        try:
            dtype = self.layout.numpy_dtype()
            for slot in ticket.slots:
                view = chunk_view(slot.view, self.layout, slot.ref.end - slot.ref.start, dtype)
                view.flags.writeable = False  # the slot is the cache's copy: a reader must never write it
                got.chunks.append((slot.ref.start, view))
            yield got
        finally:
            got.chunks = []  # the views die with the pins
            self.end_retrieve(ticket)
            self.metrics.observe("kvtier_retrieve_seconds", time.perf_counter() - started)

    def retrieve(self, tokens, namespace: str | None = None, *, extra_keys=None):
        """KV of the leading available tokens of ``tokens``, through ``retrieve_chunks``.

        Returns:
            (kv, num_tokens): kv a torch tensor ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)``
            in the layout dtype; ``num_tokens <= lookup(tokens)``. Bytes are never wrong: L2 records are
            verified before use.

        Raises:
            InputError: bad tokens. KVTierError: torch is not installed.
        """
        with self.retrieve_chunks(tokens, namespace, extra_keys=extra_keys) as got:
            out = join_chunks(self.layout, got.num_tokens, got.chunks)
        return out, got.num_tokens

    # ---- housekeeping ------------------------------------------------------------------
    def clear(self, medium: str | None = None) -> None:
        """Drop stored KV from every tier (or only ``"CPU"`` = L1, or ``"STORAGE"`` = L2; waits for L2)."""
        self.tiers.clear(medium)

    def flush(self, timeout_seconds: float = 30.0) -> bool:
        """Wait at most ``timeout_seconds`` for queued L2 writes. Returns False on timeout."""
        return self.l2.flush(timeout_seconds)

    def take_events(self) -> list:
        """Events not yet published (in-process users hand them to the engine's own publisher)."""
        return self.tiers.events.take_events() if self.tiers.events is not None else []

    def stats(self) -> dict:
        """Counters and gauges (see kvtier.metrics)."""
        self.tiers.refresh_gauges()
        return self.metrics.snapshot()

    def close(self, timeout_seconds: float = 10.0) -> bool:
        """Flush L2 writes (at most ``timeout_seconds``) and release resources if this cache created its
        tiers. Returns False when the writes did not finish in time."""
        if self._owns_tiers:
            return self.tiers.close(timeout_seconds)
        return self.flush(timeout_seconds)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _runs(slots: list[L1Slot]) -> list[list[L1Slot]]:
    """Split slots into runs of consecutive chunk indexes."""
    runs: list[list[L1Slot]] = []
    for slot in slots:
        if runs and runs[-1][-1].ref.index + 1 == slot.ref.index:
            runs[-1].append(slot)
        else:
            runs.append([slot])
    return runs
