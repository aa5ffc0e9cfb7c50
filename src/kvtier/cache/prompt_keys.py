"""PromptKeys: a prompt's tokens -> validated token array and chunk refs (keys), memoised.

One concept: how a cache names the chunks of a prompt. Tokens are validated (``hashing.as_token_array``) and
hashed block by block in a chain (vLLM's algorithms, ``hashing.prefix_hashes``); a chunk is keyed by its last
block's digest, with the model, the chunk layout and the namespace (``keys.ChunkKey``). The refs of a prompt are
kept in the tiers' memo (``cache.memo``), shared by every cache of a process, so a prompt asked about again
(lookup, then store, then retrieve) is hashed once.
"""

from __future__ import annotations

import numpy as np
import xxhash

from kvtier.cache.memo import LookupMemo
from kvtier.cache.tickets import ChunkRef, PromptBlocks
from kvtier.config import KVTierConfig
from kvtier.extra_keys import check_extra_keys, num_blocks_of
from kvtier.hashing import as_token_array, check_token_ids, prefix_hashes
from kvtier.errors import InputError
from kvtier.keys import SEGMENT_SEED_SUFFIX, ChunkKey, chunk_layout_id, is_segment_namespace
from kvtier.pages import PageChain


class PromptKeys:
    """Chunk refs of prompts for one (model, chunk layout, default namespace).

    Args:
        config: chunk and block size, hash algorithm and seed, ``save_unfull_chunk``.
        model: the weights' identity (part of every key).
        key_layout_id: ``keys.chunk_layout_id`` of the KV layout and chunk size (part of every key).
        namespace: the default namespace.
        memo: the memo the refs are kept in (thread-safe; shared).
        layout_id: the KV layout's own id, for the keys of a ``PageChain``'s pages (``chunk_layout_id`` with the
            page size); None: ``key_layout_id``.

    Every method that takes ``tokens`` also takes a ``kvtier.pages.PageChain`` (an engine's page keys): page i is
    chunk i, tokens ``[i * page_size, (i + 1) * page_size)``, keyed by its own digest; nothing is hashed or
    memoised, and the token array returned is ``PageChain.token_array`` (the chain names no token ids).
    """

    def __init__(self, config: KVTierConfig, model: str, key_layout_id: str, namespace: str, memo: LookupMemo,
                 layout_id: str | None = None):
        self.config, self.model, self.key_layout_id, self.namespace, self.memo = \
            config, model, key_layout_id, namespace, memo
        self.layout_id = layout_id

    def chunk_refs(self, tokens, namespace: str | None = None, *, extra_keys=None,
                   hasher=prefix_hashes) -> tuple[np.ndarray, list[ChunkRef]]:
        """Validate ``tokens`` (and ``extra_keys``) and cut them into chunk refs: full chunks, and the partial
        tail only with ``save_unfull_chunk``. Blocks are hashed in a chain (``hasher``: ``hashing.prefix_hashes``
        or a callable with its signature and results, e.g. the server's ``HashProcess.prefix_hashes``); a chunk's
        key is the digest of its last block. In a segment namespace (``keys.segment_namespace``) the tokens are
        one document, cut into chunks with its partial tail and chained from the segment root. The refs are
        memoised. Raises InputError on bad tokens or extra keys
        (and what ``hasher`` raises)."""
        if isinstance(tokens, PageChain):
            return tokens.token_array(), self._page_refs(tokens, namespace, extra_keys)
        arr, ns, extra, memo_key, refs = self._recall(tokens, namespace, extra_keys)
        if refs is None:
            refs, num_digests = self._refs(arr, ns, extra, hasher)
            self.memo.put(memo_key, refs, num_digests, extra is not None)
        return arr, refs

    def head_refs(self, tokens, namespace: str | None = None, *,
                  extra_keys=None) -> tuple[np.ndarray, list[ChunkRef], bool]:
        """``(tokens, refs, whole)``: the prompt's memoised refs (``whole`` True), or else the ref of its first
        chunk alone, nothing memoised (``whole`` True only when that is every chunk). Only that chunk's blocks
        are hashed: a lookup whose first chunk no tier holds needs no more, and most lookups of new prompts
        are such. Validates as ``chunk_refs`` and raises what it raises."""
        if isinstance(tokens, PageChain):
            return tokens.token_array(), self._page_refs(tokens, namespace, extra_keys), True
        arr, ns, extra, _, refs = self._recall(tokens, namespace, extra_keys)
        if refs is not None:
            return arr, refs, True
        refs, _ = self._refs(arr, ns, extra, prefix_hashes, max_chunks=1)
        return arr, refs, not refs or refs[-1].end == self._end(arr, ns)

    def _end(self, arr: np.ndarray, ns: str) -> int:
        """Tokens of ``arr`` that belong to a chunk: all in a segment namespace (a document's own tokens, stored
        whole) or with ``save_unfull_chunk``, else the full chunks'."""
        c = self.config.chunk_size
        return len(arr) if self.config.save_unfull_chunk or is_segment_namespace(ns) else len(arr) // c * c

    def _refs(self, arr: np.ndarray, ns: str, extra, hasher, max_chunks: int | None = None) -> tuple[list[ChunkRef], int]:
        """(refs of the first ``max_chunks`` chunks, default all; number of block digests computed). A segment
        namespace is chained from the segment root."""
        cfg = self.config
        bs, c = cfg.effective_block_size, cfg.chunk_size
        end = self._end(arr, ns)
        if max_chunks is not None:
            end = min(end, max_chunks * c)
        seed = cfg.hash_seed + SEGMENT_SEED_SUFFIX if is_segment_namespace(ns) else cfg.hash_seed
        digests = hasher(arr[:end], bs, cfg.hash_algorithm, seed, extra, include_partial=True)
        blocks = PromptBlocks(bs, digests, None if extra is None else extra[:len(digests)])
        refs = []
        for i, start in enumerate(range(0, end, c)):
            stop = min(start + c, end)
            key = ChunkKey(self.model, self.key_layout_id, ns, digests[num_blocks_of(stop, bs) - 1])
            refs.append(ChunkRef(i, key, start, stop, blocks))
        return refs, len(digests)

    def _page_refs(self, chain: PageChain, namespace: str | None, extra_keys) -> list[ChunkRef]:
        """The refs of a ``PageChain``'s pages; its ``parent`` goes with the blocks (the events' first parent)."""
        if extra_keys is not None:
            raise InputError("a PageChain takes no extra_keys: the engine's page keys already hash what it keys on")
        ns = self.namespace if namespace is None else namespace
        p = chain.page_size
        layout_id = self.key_layout_id if self.layout_id is None else chunk_layout_id(self.layout_id, p)
        blocks = PromptBlocks(p, list(chain.hashes), None, chain.parent)
        return [ChunkRef(i, ChunkKey(self.model, layout_id, ns, digest), i * p, (i + 1) * p, blocks)
                for i, digest in enumerate(chain.hashes)]

    def _memo_key(self, tokens, namespace, extra_keys) -> tuple:
        """(token array, namespace, checked extra keys, memo key); the ids' sign is not checked yet."""
        arr = as_token_array(tokens, check_ids=False)
        ns = self.namespace if namespace is None else namespace
        extra = None if extra_keys is None else check_extra_keys(
            extra_keys, num_blocks_of(len(arr), self.config.effective_block_size))
        return arr, ns, extra, (self.model, self.key_layout_id, ns, len(arr), xxhash.xxh3_128_digest(np.ascontiguousarray(arr)),
                                extra)

    def memoised(self, tokens, namespace: str | None = None, *, extra_keys=None) -> bool:
        """Whether ``chunk_refs`` of this prompt would come from the lookup memo (no hashing). Raises
        InputError as ``chunk_refs``."""
        if isinstance(tokens, PageChain):
            return True  # nothing to hash
        return self._recall(tokens, namespace, extra_keys)[4] is not None

    def _recall(self, tokens, namespace, extra_keys) -> tuple:
        """``_memo_key``'s (token array, namespace, checked extra keys, memo key) and the memoised refs, or None
        after the ids' sign was checked (a memoised prompt's ids were checked when it was memoised)."""
        arr, ns, extra, memo_key = self._memo_key(tokens, namespace, extra_keys)
        refs = self.memo.get(memo_key)
        if refs is None:
            check_token_ids(arr)
        return arr, ns, extra, memo_key, refs
