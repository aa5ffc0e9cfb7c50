"""Turns cache actions (chunks stored in / removed from a tier, tiers cleared) into KV cache events.

A chunk of ``chunk_size`` tokens is announced as ``chunk_size / event_block_size`` engine-sized blocks, hashed
with ``kvtier.hashing.prefix_hashes`` at block granularity, so with the engine's block size, hash algorithm and
seed the published hashes equal the engine's own block hashes (reference events-and-hashing.md §2.4).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from kvtier.errors import ConfigError, InputError
from kvtier.events.model import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from kvtier.hashing import as_token_array, event_id, prefix_hashes

MEDIUMS = ("GPU", "CPU", "STORAGE")
_CHAIN_CACHE_SIZE = 65_536  # chunk hash -> last block digest, so a later chunk need not re-hash its prefix


def _as_list(tokens) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


class EventEmitter:
    """The interface the cache calls when chunks appear in or leave a tier.

    Args:
        config: a ``KVTierConfig``; uses ``chunk_size``, ``hash_algorithm``, ``hash_seed`` and ``kv_events``
            (``event_block_size``, ``hash_format``, ``data_parallel_rank``).
        publisher: an object with ``publish(events: list[Event])`` (``EventPublisher``); None keeps events in
            memory for ``take_events()`` (in-process users such as the vLLM connector).

    Raises:
        ConfigError: ``event_block_size`` does not divide ``chunk_size``.

    Per medium, a block announced stored is not announced again until it is removed, so one ``BlockRemoved``
    matches one ``BlockStored``. Thread-safe.
    """

    def __init__(self, config, publisher=None) -> None:
        ev = config.kv_events
        self.chunk_size = int(config.chunk_size)
        self.block_size = int(ev.event_block_size or self.chunk_size)
        if self.chunk_size % self.block_size:
            raise ConfigError(f"kv_events.event_block_size ({self.block_size}) must divide chunk_size "
                              f"({self.chunk_size}); set it to the engine's block size, e.g. 16")
        self.algorithm, self.seed = config.hash_algorithm, config.hash_seed
        self.save_unfull_chunk = bool(getattr(config, "save_unfull_chunk", False))
        self.raw_bytes = ev.hash_format == "bytes"
        self.publisher = publisher
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        # medium -> {chunk prefix hash: tuple of published block ids}
        self._known: dict[str, dict[bytes, tuple]] = {}
        self._chain: OrderedDict[bytes, bytes] = OrderedDict()

    # ------------------------------------------------------------------ helpers
    def _id(self, digest: bytes):
        return digest if self.raw_bytes else event_id(digest)

    def _emit(self, events: list[Event]) -> None:  # called with self._lock held
        if not events:
            return
        if self.publisher is not None:
            self.publisher.publish(events)  # never blocks
        else:
            self._pending.extend(events)

    def _remember_chain(self, chunk_hash: bytes, last_block: bytes) -> None:
        self._chain[chunk_hash] = last_block
        if len(self._chain) > _CHAIN_CACHE_SIZE:
            self._chain.popitem(last=False)

    def _block_digests(self, tokens, arr, off: int, chunk_hashes, lo_chunk: int, end: int,
                       block_hashes=None) -> tuple[bytes | None, list[bytes]]:
        """(digest of the block before, digests of every block in tokens ``[lo_chunk*chunk_size, end)``).

        The last block may be partial. Without re-hashing when blocks are chunks; otherwise the chain state of
        the previous chunk comes from a cache, or (unknown) from hashing the prefix again.
        """
        if self.block_size == self.chunk_size:
            return (chunk_hashes[lo_chunk - 1] if lo_chunk else None), list(chunk_hashes[lo_chunk:])
        start = lo_chunk * self.chunk_size
        skip = start // self.block_size
        if block_hashes is not None and len(block_hashes) >= -(-end // self.block_size):
            return (block_hashes[skip - 1] if skip else None), list(block_hashes[skip:-(-end // self.block_size)])
        parent = self._chain.get(chunk_hashes[lo_chunk - 1]) if lo_chunk else None
        if lo_chunk and parent is None:
            every = prefix_hashes(as_token_array(tokens[:end]), self.block_size, self.algorithm, self.seed,
                                  include_partial=True)
            return every[skip - 1], every[skip:]
        return parent, prefix_hashes(arr[start - off:end - off], self.block_size, self.algorithm, self.seed,
                                     include_partial=True, parent=parent)

    # ------------------------------------------------------------------ the cache calls these
    def stored(self, tokens, first_chunk: int, num_chunks: int, medium: str, lora_name: str | None = None,
               *, chunk_hashes: list[bytes] | None = None, block_hashes: list[bytes] | None = None) -> int:
        """Chunks ``[first_chunk, first_chunk + num_chunks)`` of ``tokens`` became available in ``medium``.

        Args:
            tokens: the full token prefix up to the end of the stored range (1-D ints); a trailing partial chunk
                counts as a chunk only with ``save_unfull_chunk``.
            medium: ``"CPU"`` (L1), ``"STORAGE"`` (L2) or ``"GPU"``.
            chunk_hashes: the cache's prefix hashes of ``tokens`` at ``chunk_size`` (at least up to the range's
                end); passing them avoids re-hashing and re-validating the tokens (the cheap path).
            block_hashes: optional digests of ``tokens`` at ``event_block_size`` (from block 0 to the range's end,
                ``include_partial`` for a partial last chunk); when the caller has them, sub-blocks are not re-hashed.

        Returns:
            number of chunks announced (already-announced chunks of that medium are skipped).

        Raises:
            InputError: bad tokens, or a range beyond the tokens given.
        """
        if num_chunks <= 0:
            return 0
        if not hasattr(tokens, "__len__") or not hasattr(tokens, "__getitem__"):
            raise InputError("tokens must be a 1-D sequence of token ids (list, numpy array or torch tensor)")
        n_tok = len(tokens)
        end_chunk = first_chunk + num_chunks
        n_full = n_tok // self.chunk_size
        n_avail = n_full + (1 if self.save_unfull_chunk and n_tok % self.chunk_size else 0)
        if first_chunk < 0 or end_chunk > n_avail:
            raise InputError(f"stored chunks [{first_chunk}, {end_chunk}) but tokens hold {n_avail} chunk(s) of "
                             f"{self.chunk_size}; pass the token prefix up to the end of the stored range")
        trusted = chunk_hashes is not None and len(chunk_hashes) >= end_chunk
        if not trusted:
            chunk_hashes = prefix_hashes(as_token_array(tokens[: end_chunk * self.chunk_size]), self.chunk_size,
                                         self.algorithm, self.seed, include_partial=end_chunk > n_full)
        end_tok = min(end_chunk * self.chunk_size, n_tok)
        off = first_chunk * self.chunk_size
        # only the stored range is touched; tokens the cache already hashed (chunk_hashes) are not re-validated
        arr = tokens[off:end_tok] if trusted else as_token_array(tokens[off:end_tok])
        with self._lock:
            known = self._known.setdefault(medium, {})
            new = [i for i in range(first_chunk, end_chunk) if chunk_hashes[i] not in known]
            if not new:
                return 0
            parent, blocks = self._block_digests(tokens, arr, off, chunk_hashes[:end_chunk], new[0], end_tok,
                                                 block_hashes)
            per_chunk = self.chunk_size // self.block_size
            base = new[0]
            events: list[Event] = []
            run: list[int] = []
            for i in new:  # one BlockStored per contiguous run of new chunks
                if run and i != run[-1] + 1:
                    events += self._stored_events(arr, off, run, parent, blocks, base, per_chunk, medium, lora_name)
                    run = []
                run.append(i)
                digests = blocks[(i - base) * per_chunk:(i - base + 1) * per_chunk]
                known[chunk_hashes[i]] = tuple(self._id(d) for d in digests)
                if self.block_size != self.chunk_size:  # else the chunk hash is the chain state
                    self._remember_chain(chunk_hashes[i], digests[-1])
            events += self._stored_events(arr, off, run, parent, blocks, base, per_chunk, medium, lora_name)
            self._emit(events)  # under the lock: a later removal is never published before this store
        return len(new)

    def _stored_events(self, arr, off, run, parent, blocks, base, per_chunk, medium,
                       lora_name) -> list[BlockStored]:
        b_lo = (run[0] - base) * per_chunk
        b_hi = min((run[-1] - base + 1) * per_chunk, len(blocks))
        lo_tok = run[0] * self.chunk_size - off  # positions within arr (the stored range)
        hi_tok = min((run[-1] + 1) * self.chunk_size - off, len(arr))
        prev = blocks[b_lo - 1] if b_lo > 0 else parent
        parent = None if prev is None else self._id(prev)
        ids = [self._id(d) for d in blocks[b_lo:b_hi]]
        full_tok = (hi_tok - lo_tok) // self.block_size * self.block_size
        out = []
        n_full = full_tok // self.block_size
        if n_full:
            out.append(BlockStored(ids[:n_full], parent, _as_list(arr[lo_tok:lo_tok + full_tok]), self.block_size,
                                   None, medium, lora_name))
        if n_full < len(ids):  # a partial last block (save_unfull_chunk): its own event, vLLM 0.33 style
            out.append(BlockStored(ids[n_full:], ids[n_full - 1] if n_full else parent,
                                   _as_list(arr[lo_tok + full_tok:hi_tok]), hi_tok - lo_tok - full_tok,
                                   None, medium, lora_name))
        return out

    def removed(self, chunk_prefix_hashes: list[bytes], medium: str) -> int:
        """The last copy in ``medium`` of these chunks is gone (evicted, deleted, corrupt record dropped).

        Emits one BlockRemoved with the blocks announced for them; a chunk never announced (e.g. found in L2
        after a restart) is published as its chunk hash. Returns the number of block hashes published.
        """
        ids: list = []
        with self._lock:
            known = self._known.get(medium, {})
            for h in chunk_prefix_hashes:
                got = known.pop(bytes(h), None)
                ids.extend(got if got is not None else (self._id(bytes(h)),))
            if ids:
                self._emit([BlockRemoved(ids, medium)])
        return len(ids)

    def cleared(self, medium: str | None = None) -> None:
        """Everything is gone (``medium=None``: AllBlocksCleared) or one tier is (BlockRemoved for its blocks)."""
        with self._lock:
            if medium is None:
                self._known.clear()
                events: list[Event] = [AllBlocksCleared()]
            else:
                gone = self._known.pop(medium, {})
                ids = [i for blocks in gone.values() for i in blocks]
                events = [BlockRemoved(ids, medium)] if ids else []
            self._emit(events)

    def take_events(self) -> list[Event]:
        """Drain the events kept in memory (only filled when there is no publisher)."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def take_batch(self, data_parallel_rank: int | None = None) -> EventBatch | None:
        """``take_events()`` wrapped in an EventBatch stamped now, or None when there is nothing."""
        events = self.take_events()
        return EventBatch(time.time(), events, data_parallel_rank) if events else None

    def num_known_chunks(self, medium: str) -> int:
        """Chunks currently announced as stored in ``medium``."""
        with self._lock:
            return len(self._known.get(medium, {}))
