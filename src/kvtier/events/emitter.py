"""Turns cache actions (chunks stored in / removed from a tier, tiers cleared) into KV cache events.

Events name blocks: the cache hashes every prompt block by block (``hashing.prefix_hashes`` at the config's
``block_size``, with the engine's per-block extra keys), so with the engine's block size, hash algorithm and
seed the published hashes are the engine's own block hashes (reference events-and-hashing.md §2.4) and nothing
is hashed again here. ``lora_name`` and ``extra_keys`` (vLLM's untagged form, §2.3) come from the blocks'
extra keys.

Bookkeeping is per medium and per copy: a copy is one full ``ChunkKey`` (model, layout, namespace, hash), and
the same block hash can be held by several copies (two models, two namespaces, a partial and a full chunk that
share a block). Each newly held copy publishes its ``BlockStored``; a ``BlockRemoved`` names a block hash only
once no copy holding it is left in that medium (a count per (medium, block hash)).

Scope (with an authenticated publisher, ``kvtier.events.streams``): a copy in a tenant's namespace
(``keys.tenant_namespace``) is also announced on that tenant's stream, whose ``BlockRemoved`` names a block
hash once no copy of that tenant holds it; the operator stream carries every event. The scope of each copy is
remembered with it, so a removal (which names chunks only) reaches the stream its store reached.
"""

from __future__ import annotations

import threading
from collections import Counter

from kvtier.events.model import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvtier.extra_keys import event_extra_keys, lora_name_of
from kvtier.hashing import event_id, sglang_event_id
from kvtier.events.publisher import ALL_STREAMS
from kvtier.keys import namespace_tenant, parse_name
from kvtier.pages import UNKNOWN_TOKEN

class EventEmitter:
    """The interface the cache calls when chunks appear in or leave a tier.

    Args:
        config: a ``KVTierConfig``; uses ``kv_events.hash_format`` (``"int"``: uint64 ids, ``"bytes"``: digests),
            ``kv_events.encoding`` (``"sglang"``: ids are the digests' first 8 bytes, SGLang's block ids; else their
            last 8, vLLM's) and ``kv_events.include_token_ids`` (false: ``BlockStored.token_ids`` is empty; the
            blocks of a ``PageChain`` never carry any).
        publisher: an object with ``publish(events, tenant=None, *, operator=True)`` (``EventPublisher``); None
            keeps the operator stream's events in memory for ``take_events()`` (in-process users such as the
            vLLM connector).

    Thread-safe: events leave in the order the calls were made.
    """

    def __init__(self, config, publisher=None) -> None:
        self.raw_bytes = config.kv_events.hash_format == "bytes"
        # a block's id as its engine derives it: vLLM's low 64 bits, or SGLang's high 64 (its page keys' ids)
        self._id_of = sglang_event_id if config.kv_events.encoding == "sglang" else event_id
        self.include_token_ids = getattr(config.kv_events, "include_token_ids", True)
        self.publisher = publisher
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        # medium -> {chunk name: (its blocks' published ids, its tenant or None)}
        self._known: dict[str, dict[str, tuple[tuple, str | None]]] = {}
        self._held: dict[str | None, dict[str, Counter]] = {}  # tenant (None: all) -> medium -> {id: copies}

    # ------------------------------------------------------------------ helpers
    def _id(self, digest: bytes):
        return digest if self.raw_bytes else self._id_of(digest)

    def _counts(self, tenant: str | None, medium: str) -> Counter:
        return self._held.setdefault(tenant, {}).setdefault(medium, Counter())

    def _emit(self, events: list[Event], tenant: str | None = None, operator: bool = True) -> None:
        # called with self._lock held: streams see the events in the order the calls were made
        if not events:
            return
        if self.publisher is not None:
            self.publisher.publish(events, tenant, operator=operator)  # never blocks
        elif operator:
            self._pending.extend(events)

    # ------------------------------------------------------------------ the cache calls these
    def stored(self, tokens, refs, medium: str) -> int:
        """Chunks became available in ``medium``.

        Args:
            tokens: the prompt's token ids (1-D numpy int array or list), at least up to the last ref's end.
            refs: ``kvtier.cache.ChunkRef``s in chunk order (key, index, token range and the prompt's ``PromptBlocks``).
            medium: ``"CPU"`` (L1), ``"STORAGE"`` (L2) or ``"GPU"``.

        Returns:
            number of chunks announced (copies already held in that medium are skipped).
        """
        with self._lock:
            known = self._known.setdefault(medium, {})
            tenant = namespace_tenant(refs[0].key.namespace) if refs else None  # one prompt: one namespace
            counts = [self._counts(None, medium)] + ([self._counts(tenant, medium)] if tenant else [])
            events: list[Event] = []
            run: list = []
            announced = 0
            for ref in refs:
                name = ref.key.name()
                if name in known:
                    continue
                announced += 1
                ids = tuple(self._id(d) for d in ref.blocks.digests[_first_block(ref):_end_block(ref)])
                known[name] = (ids, tenant)
                for held in counts:
                    held.update(ids)
                if run and (ref.index != run[-1].index + 1 or ref.blocks is not run[-1].blocks):
                    events += self._stored_events(tokens, run, medium)
                    run = []
                run.append(ref)
            if run:
                events += self._stored_events(tokens, run, medium)
            self._emit(events, tenant)  # under the lock: a later removal is never published before this store
        return announced

    def _stored_events(self, tokens, run: list, medium: str) -> list[BlockStored]:
        """One BlockStored for the run's full blocks, one more for a partial last block (vLLM 0.33 style)."""
        blocks = run[0].blocks
        bs = blocks.block_size
        lo, hi = _first_block(run[0]), _end_block(run[-1])
        lo_tok, hi_tok = run[0].start, run[-1].end
        digests, extra = blocks.digests, blocks.extra_keys
        ids = [self._id(d) for d in digests[lo:hi]]
        parent = self._id(digests[lo - 1]) if lo else self._id(blocks.parent) if blocks.parent else None
        per_block = [event_extra_keys(e) for e in extra[lo:hi]] if extra is not None else [None] * len(ids)
        lora_name = lora_name_of(extra[lo]) if extra is not None else None
        token_ids = tokens[lo_tok:hi_tok]
        token_ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        n_full = (hi_tok - lo_tok) // bs
        keep = self.include_token_ids and not (token_ids and token_ids[0] == UNKNOWN_TOKEN)  # a PageChain's: none
        out = []
        if n_full:
            out.append(BlockStored(ids[:n_full], parent, token_ids[:n_full * bs] if keep else [], bs, None, medium,
                                   lora_name, extra_keys=per_block[:n_full]))
        if n_full < len(ids):
            out.append(BlockStored(ids[n_full:], ids[n_full - 1] if n_full else parent,
                                   token_ids[n_full * bs:] if keep else [], len(token_ids) - n_full * bs, None,
                                   medium, lora_name, extra_keys=per_block[n_full:]))
        return out

    def removed(self, names: list[str], medium: str) -> int:
        """The copies ``names`` (``ChunkKey.name()``) left ``medium`` (evicted, deleted, corrupt record dropped).

        Emits one BlockRemoved with the block hashes no remaining copy in ``medium`` holds. A chunk never
        announced (found in L2 after a restart) is published as its own hash (its last block's), unless a held
        copy has that hash. Returns the number of block hashes published.
        """
        with self._lock:
            known = self._known.get(medium, {})
            held = self._counts(None, medium)
            gone: list = []
            tenant_gone: dict[str, list] = {}
            for name in names:
                entry = known.pop(name, None)
                if entry is None:  # its scope is unknown too: the operator stream alone hears of it
                    unknown = self._id(parse_name(name)[1])
                    if not held[unknown]:
                        del held[unknown]
                        gone.append(unknown)
                    continue
                ids, tenant = entry
                gone += _release(held, ids)
                if tenant is not None:
                    tenant_gone.setdefault(tenant, []).extend(_release(self._counts(tenant, medium), ids))
            if gone:
                self._emit([BlockRemoved(list(dict.fromkeys(gone)), medium)])
            for tenant, ids in tenant_gone.items():
                if ids:
                    self._emit([BlockRemoved(list(dict.fromkeys(ids)), medium)], tenant, operator=False)
        return len(set(gone))

    def cleared(self, medium: str | None = None) -> None:
        """Everything is gone (``medium=None``: AllBlocksCleared) or one tier is (BlockRemoved for its blocks)."""
        with self._lock:
            if medium is None:
                self._known.clear()
                self._held.clear()
                self._emit([AllBlocksCleared()], ALL_STREAMS)
                return
            self._known.pop(medium, None)
            for tenant, per_medium in self._held.items():
                ids = list(per_medium.pop(medium, {}))
                if ids:
                    self._emit([BlockRemoved(ids, medium)], tenant, operator=tenant is None)

    def take_events(self) -> list[Event]:
        """Drain the events kept in memory (only filled when there is no publisher)."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def num_known_chunks(self, medium: str) -> int:
        """Copies (full chunk keys) currently announced as stored in ``medium``."""
        with self._lock:
            return len(self._known.get(medium, {}))


def _release(held: Counter, ids) -> list:
    """Drop one copy of each of ``ids`` from ``held``; the ids no copy holds any more."""
    gone = []
    for i in ids:
        held[i] -= 1
        if held[i] <= 0:
            del held[i]
            gone.append(i)
    return gone


def _first_block(ref) -> int:
    return ref.start // ref.blocks.block_size


def _end_block(ref) -> int:
    return -(-ref.end // ref.blocks.block_size)
