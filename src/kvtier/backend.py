"""KVBackend: the one interface an engine connector talks to, whether the cache is in-process or a server.

Two implementations: ``kvtier.cache.KVCache`` (L1 and L2 inside the engine process) and
``kvtier.client.Client`` (a ``kvtier server`` on this host or across the network). A connector written
against ``KVBackend`` works with both and never needs to probe which one it holds. ``tests/contract/backend/`` runs
one set of behavioural tests against both.

Words and units:
  * ``tokens``: 1-D token ids (a list of ints, a numpy or torch integer array), length T; validated by
    ``kvtier.hashing.as_token_array`` (InputError on anything else). Or a ``kvtier.pages.PageChain``: a prompt
    named by its pages' digests as the engine computed them (SGLang's page keys), each page one chunk of
    ``page_size`` tokens keyed by its digest; then no ``extra_keys`` and no ``start``.
  * A chunk is ``chunk_size`` consecutive tokens starting at a multiple of ``chunk_size``; chunk keys are
    prefix hashes, so chunk i is only found after chunks 0..i-1. Only whole chunks are stored (the partial
    tail too when the cache's ``save_unfull_chunk`` is on).
  * KV of ``n`` tokens is an array ``(num_layers, 2, n, num_kv_heads, head_dim)`` (``KVLayout.chunk_shape``),
    2 = keys then values, C-contiguous, element type ``KVLayout.numpy_dtype()`` (float32 / float16 as
    themselves; bfloat16 as uint16 and fp8 as uint8 bit patterns).
  * ``namespace``: None means the backend's default namespace (set when it was opened); otherwise the
    namespace of this call (``kvtier.keys.namespace_of``: LoRA name, cache_salt). KV of one namespace is
    never served to another.
  * ``start`` (a token offset, default 0): the call concerns only the chunks from the one holding token
    ``start`` on; earlier chunks are still hashed (keys are prefix hashes) but neither looked up, stored nor
    retrieved. A lookup from there answers the end of the run of held chunks that begins at that chunk (an
    absolute token count, 0 when that chunk is missing). Used for a sliding-window attention group, which
    keeps only the tokens of its window (``connectors.vllm_groups``).

New keyword arguments may be added to these methods later (always with a default), so call them with
``namespace=...`` and further options by keyword.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

Fill = Callable[[int, np.ndarray], None]
"""``fill(start, dst)``: write the KV of tokens ``[start, start + dst.shape[2])`` into ``dst`` in place."""


class TierHits(NamedTuple):
    """What ``lookup_tiers`` answers: leading tokens held, and how many of them are in L1 (host memory).

    ``num_tokens - num_l1_tokens`` leading tokens after the L1 ones are in L2 only (disk, object storage...).
    Both are whole chunks (a multiple of ``chunk_size``, except a stored partial tail) and
    ``0 <= num_l1_tokens <= num_tokens``.
    """

    num_tokens: int
    num_l1_tokens: int


class Retrieved:
    """What ``retrieve_chunks`` yields.

    Attributes:
        num_tokens: leading tokens whose KV the chunks hold (0 on a miss or when the backend is unavailable);
            a multiple of ``chunk_size`` except for a stored partial tail.
        chunks: ``[(start, view)]`` in token order, ``start`` the chunk's first token, ``view`` a read-only
            numpy array ``(num_layers, 2, n, num_kv_heads, head_dim)`` of the layout's ``numpy_dtype``
            covering tokens ``[start, start + n)``. The views point into the cache's own memory (an L1
            slot, a shared-memory slot or a received frame): valid only inside the ``with`` block, emptied
            when it ends.
        ok: True when the views hold the KV of ``num_tokens`` tokens. Read it after the ``with`` block: a
            server client turns it False when the server's pin ran out while the caller was copying (the
            slot may have been reused), and then the copy must be thrown away. False on a miss.
    """

    __slots__ = ("num_tokens", "chunks", "ok")

    def __init__(self, num_tokens: int = 0, chunks: list | None = None, ok: bool = False):
        self.num_tokens = num_tokens
        self.chunks = [] if chunks is None else chunks
        self.ok = ok

    def __repr__(self) -> str:
        return f"Retrieved(num_tokens={self.num_tokens}, chunks={len(self.chunks)}, ok={self.ok})"


@runtime_checkable
class KVBackend(Protocol):
    """The engine-facing cache: lookup, store and retrieve by chunk, flush, events, close.

    A backend is opened for one (model, KV layout, default namespace). Only caller mistakes raise
    (``InputError``: bad tokens); a cache that cannot answer (server gone, L2 failure) answers as a miss,
    never with wrong KV.

    Every method that takes a prompt also takes ``extra_keys``: None, or one entry per engine block of the
    prompt (vLLM's per-block extra keys: multimodal hashes, LoRA name, cache salt; ``kvtier.extra_keys``), hashed
    into each block's digest so a chunk is only ever served to a prompt with the same ones. ``start``: a token
    offset; the call concerns the chunks from the one holding ``start`` on.
    """

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk (an int > 0; a server client that has not reached its server yet says 0)."""
        ...

    def lookup(self, tokens, namespace: str | None = None, *, extra_keys=None, start: int = 0) -> int:
        """Number of leading tokens of ``tokens`` whose KV the cache holds now (whole chunks). Read-only:
        nothing is promoted between tiers. 0 when unavailable. Raises InputError for bad tokens."""
        ...

    def lookup_tiers(self, tokens, namespace: str | None = None, *, extra_keys=None, start: int = 0) -> TierHits:
        """``lookup`` split by tier: ``TierHits(num_tokens, num_l1_tokens)``. Counted in the cache's
        ``kvtier_lookup_hit_tokens_total{medium="CPU"|"STORAGE"}`` exactly as answered. (0, 0) when unavailable.
        Raises InputError for bad tokens."""
        ...

    def store_chunks(self, tokens, fill: Fill, namespace: str | None = None, *, extra_keys=None, start: int = 0,
                     hint=None) -> int:
        """Store the KV of the chunks of ``tokens`` that the cache lacks, letting ``fill`` write each in place.

        ``fill(start, dst)`` is called once per missing chunk, in token order: ``start`` is the chunk's first
        token, ``dst`` a writable numpy array ``(num_layers, 2, n, num_kv_heads, head_dim)`` (``n`` tokens, the
        layout's ``numpy_dtype``) that ``fill`` must overwrite entirely; it is the cache's own slot where the
        backend allows (no intermediate copy). Chunks already held are never asked for. The chunks become
        visible to ``lookup`` / ``retrieve_chunks`` only once every one was filled and committed.

        ``hint``: None or a ``kvtier.hints.RetentionHint`` (priority, TTL, session) for every chunk of the prompt
        the cache holds after the store, already-held ones included (``kvtier.l1.retention`` says what it does).

        Returns the number of chunks newly stored (0 when unavailable, or when nothing was stored).
        Raises InputError for bad tokens; whatever ``fill`` raises aborts the store (nothing is stored) and
        is raised.
        """
        ...

    def retrieve_chunks(self, tokens, namespace: str | None = None, *, extra_keys=None,
                        timeout_seconds: float | None = None, start: int = 0) -> AbstractContextManager[Retrieved]:
        """Zero-copy access to the KV of the leading available tokens of ``tokens``, chunk by chunk.

        A context manager yielding a ``Retrieved``; the chunks stay pinned (cannot be evicted) until the
        ``with`` block ends, so copy them out and leave. L2 hits are brought into L1 first. Read ``ok``
        after the block. ``timeout_seconds``: the longest the backend waits on its server for this call
        (pinning, and unpinning at the end); past it the answer is a miss (or ``ok`` False). In process,
        a retrieve that took longer than it answers a miss. Raises InputError for bad tokens.
        """
        ...

    def prefetch(self, tokens, namespace: str | None = None, *, extra_keys=None, wait: bool = False) -> int:
        """Hint: bring the leading chunks of ``tokens`` that only L2 holds into L1 ahead of ``retrieve_chunks``
        (a connector sends it as soon as the scheduler knows a prompt). A server client returns 0 at once
        unless ``wait``; with ``wait`` (and always in process) it returns the leading tokens L1 holds after the
        promotion. Chunks gone meanwhile are a miss, never an error. Raises InputError for bad tokens."""
        ...

    def flush(self, timeout_seconds: float = 30.0) -> bool:
        """Wait at most ``timeout_seconds`` until queued L2 writes are done (durable). False on timeout or
        when unavailable."""
        ...

    def take_events(self) -> list:
        """KV cache events (``kvtier.events.model``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
        vLLM's field names) produced since the last call and not published by the cache itself; removes
        them. [] when there are none."""
        ...

    def close(self) -> None:
        """Release what the backend holds (bounded wait for queued writes where it owns them). Idempotent."""
        ...
