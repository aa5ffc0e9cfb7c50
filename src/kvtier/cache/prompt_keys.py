"""PromptKeys: a prompt's tokens -> validated token array and chunk refs (keys), hashed once.

One concept: how a cache names the chunks of a prompt. Tokens are validated (``hashing.as_token_array``) and
hashed block by block in a chain (vLLM's algorithms, ``hashing.prefix_hashes``); a chunk is keyed by its last
block's digest, with the model, the chunk layout and the namespace (``keys.ChunkKey``).

Hash once: the refs of a prompt are kept in the tiers' memo (``cache.memo``), shared by every cache of a process,
and found again by any whole-chunk prefix. A prompt that starts with a memoised one (the next store of a chunked
prefill, the next turn of a chat) hashes only the blocks after it, chained from its last digest (``parent``); a
prompt that is a prefix of a memoised one (a load, a prefetch) hashes nothing. ``kvtier_hashed_tokens_total``
counts the tokens hashed.
"""

from __future__ import annotations

import numpy as np
import xxhash

from kvtier.cache.memo import FINGERPRINT_TOKENS, LookupMemo, MemoEntry
from kvtier.cache.tickets import ChunkRef, PromptBlocks
from kvtier.config import KVTierConfig
from kvtier.errors import InputError
from kvtier.extra_keys import check_extra_keys, num_blocks_of
from kvtier.hashing import as_token_array, check_token_ids, prefix_hashes
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
        metrics: where ``kvtier_hashed_tokens_total`` is counted (None: nowhere).
        layout_id: the KV layout's own id, for the keys of a ``PageChain``'s pages (``chunk_layout_id`` with the
            page size); None: ``key_layout_id``.

    Every method that takes ``tokens`` also takes a ``kvtier.pages.PageChain`` (an engine's page keys): page i is
    chunk i, tokens ``[i * page_size, (i + 1) * page_size)``, keyed by its own digest; nothing is hashed or
    memoised, and the token array returned is ``PageChain.token_array`` (the chain names no token ids).
    """

    def __init__(self, config: KVTierConfig, model: str, key_layout_id: str, namespace: str, memo: LookupMemo,
                 metrics=None, layout_id: str | None = None):
        self.config, self.model, self.key_layout_id, self.namespace, self.memo = \
            config, model, key_layout_id, namespace, memo
        self.metrics, self.layout_id = metrics, layout_id
        c = config.chunk_size
        self._stride = -(-FINGERPRINT_TOKENS // c) * c  # fingerprints at whole chunks

    def chunk_refs(self, tokens, namespace: str | None = None, *, extra_keys=None,
                   hasher=prefix_hashes) -> tuple[np.ndarray, list[ChunkRef]]:
        """Validate ``tokens`` (and ``extra_keys``) and cut them into chunk refs: full chunks, and the partial
        tail only with ``save_unfull_chunk``. Blocks are hashed in a chain (``hasher``: ``hashing.prefix_hashes``
        or a callable with its signature and results, e.g. the server's ``HashProcess.prefix_hashes``), only
        those after the prompt's longest memoised prefix; a chunk's key is the digest of its last block. In a
        segment namespace (``keys.segment_namespace``) the tokens are one document, cut into chunks with its
        partial tail and chained from the segment root. The refs are memoised. Raises InputError on bad tokens
        or extra keys (and what ``hasher`` raises)."""
        if isinstance(tokens, PageChain):
            return tokens.token_array(), self._page_refs(tokens, namespace, extra_keys)
        arr, refs, _ = self._resolve(tokens, namespace, extra_keys, hasher, None)
        return arr, refs

    def known_refs(self, tokens, namespace: str | None = None, *, extra_keys=None,
                   min_chunks: int = 1) -> tuple[np.ndarray, list[ChunkRef], bool]:
        """``(tokens, refs, whole)``: the refs of the prompt's longest memoised prefix when it has at least
        ``min_chunks`` chunks, else those of its first ``min_chunks`` chunks, hashed now and not memoised;
        ``whole``: the refs are every chunk's. A lookup whose known chunks are not all held needs no more: most
        lookups of new prompts hash one chunk, not the whole prompt. Validates as ``chunk_refs``."""
        if isinstance(tokens, PageChain):
            return tokens.token_array(), self._page_refs(tokens, namespace, extra_keys), True
        return self._resolve(tokens, namespace, extra_keys, prefix_hashes, max(1, min_chunks))

    def unhashed_tokens(self, tokens, namespace: str | None = None, *, extra_keys=None) -> int:
        """How many tokens ``chunk_refs`` would hash (0: the prompt is memoised). Raises InputError as
        ``chunk_refs``."""
        if isinstance(tokens, PageChain):
            return 0  # nothing to hash
        arr, ns, extra = self._checked(tokens, namespace, extra_keys)
        found, _ = self._find(arr, ns, extra)
        return self._end(arr, ns) - (found[1] if found else 0)

    def _end(self, arr: np.ndarray, ns: str) -> int:
        """Tokens of ``arr`` that belong to a chunk: all in a segment namespace (a document's own tokens, stored
        whole) or with ``save_unfull_chunk``, else the full chunks'."""
        c = self.config.chunk_size
        return len(arr) if self.config.save_unfull_chunk or is_segment_namespace(ns) else len(arr) // c * c

    def _checked(self, tokens, namespace, extra_keys) -> tuple[np.ndarray, str, tuple | None]:
        """(token array, namespace, checked extra keys); the ids' sign is checked by ``_resolve``."""
        arr = as_token_array(tokens, check_ids=False)
        ns = self.namespace if namespace is None else namespace
        extra = None if extra_keys is None else check_extra_keys(
            extra_keys, num_blocks_of(len(arr), self.config.effective_block_size))
        return arr, ns, extra

    def _find(self, arr: np.ndarray, ns: str, extra) -> tuple[tuple[MemoEntry, int] | None, list | None]:
        """(the memo's longest prefix of ``arr`` as (entry, end), or None; every fingerprint of ``arr`` when they
        had to be computed, else None). The whole prompt's is asked first: one hash of its tokens."""
        c = self.config.chunk_size
        full = len(arr) // c * c
        if not full:
            return None, []
        scope = (self.model, self.key_layout_id, ns)
        data = np.ascontiguousarray(arr[:full]).view(np.uint8)
        whole = [(full, xxhash.xxh3_128_intdigest(data))]
        found = self.memo.find(scope, whole, extra)
        if found is not None or full <= self._stride:
            return found, whole
        prints, state, pos = [], xxhash.xxh3_128(), 0
        for end in range(self._stride, full, self._stride):
            state.update(data[pos * 8:end * 8])
            prints.append((end, state.intdigest()))
            pos = end
        prints.append(whole[0])
        return self.memo.find(scope, reversed(prints[:-1]), extra), prints

    def _resolve(self, tokens, namespace, extra_keys, hasher, min_chunks) -> tuple[np.ndarray, list[ChunkRef], bool]:
        """(tokens, refs, whole): every chunk's refs (``min_chunks`` None), or at least ``min_chunks``' (see
        ``known_refs``); hashes what the memo does not hold and memoises whole prompts."""
        arr, ns, extra = self._checked(tokens, namespace, extra_keys)
        found, prints = self._find(arr, ns, extra)
        known = found[1] if found else 0
        check_token_ids(arr[known:])  # a memoised prefix's ids were checked when it was memoised
        c, bs = self.config.chunk_size, self.config.effective_block_size
        end = self._end(arr, ns)
        want = end if min_chunks is None else min(end, max(min_chunks * c, known // c * c))
        if found is not None and known >= want:  # a prefix of a memoised prompt: nothing to hash
            return arr, found[0].refs[:want // c], want == end
        before = found[0].refs[known // c - 1].blocks.digests[:known // bs] if found else []
        seed = self.config.hash_seed + SEGMENT_SEED_SUFFIX if is_segment_namespace(ns) else self.config.hash_seed
        digests = before + hasher(arr[known:want], bs, self.config.hash_algorithm, seed,
                                  None if extra is None else extra[known // bs:], include_partial=True,
                                  parent=before[-1] if before else None)
        if self.metrics is not None:
            self.metrics.inc("kvtier_hashed_tokens_total", want - known)
        refs = self._refs(ns, digests, extra, want, found[0].refs[:known // c] if found else [])
        prints = self._fingerprints(arr, prints) if want == end else []
        if prints:  # a whole prompt of at least one full chunk
            self.memo.put(MemoEntry((self.model, self.key_layout_id, ns), prints, refs,
                                    None if extra is None else extra[:len(digests)]), len(digests))
        return arr, refs, want == end

    def _fingerprints(self, arr: np.ndarray, prints: list | None) -> list[tuple[int, int]]:
        """Every fingerprint of ``arr`` (``_find``'s, when it computed them all)."""
        c = self.config.chunk_size
        full = len(arr) // c * c
        if prints is not None and (len(prints) > 1 or full <= self._stride):
            return prints
        data = np.ascontiguousarray(arr[:full]).view(np.uint8)
        out, state, pos = [], xxhash.xxh3_128(), 0
        for end in [*range(self._stride, full, self._stride), full]:
            state.update(data[pos * 8:end * 8])
            out.append((end, state.intdigest()))
            pos = end
        return out

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

    def _refs(self, ns: str, digests: list[bytes], extra, end: int, known: list[ChunkRef]) -> list[ChunkRef]:
        """The refs of the prompt's first ``end`` tokens from its block ``digests`` (the keys of ``known`` refs,
        its memoised prefix's, reused); all share one ``PromptBlocks``."""
        bs, c = self.config.effective_block_size, self.config.chunk_size
        blocks = PromptBlocks(bs, digests, None if extra is None else extra[:len(digests)])
        refs = []
        for i, start in enumerate(range(0, end, c)):
            stop = min(start + c, end)
            key = known[i].key if i < len(known) else \
                ChunkKey(self.model, self.key_layout_id, ns, digests[num_blocks_of(stop, bs) - 1])
            refs.append(ChunkRef(i, key, start, stop, blocks))
        return refs
