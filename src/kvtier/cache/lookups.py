"""Lookups: how many leading tokens of a prompt the tiers hold, the one policy for in-process and server lookups.

A part of ``KVCache`` (made by its constructor). ``match`` answers a lookup:

1. the prompt's known chunk refs (``PromptKeys.known_refs``): its longest memoised prefix, or else its first
   chunk (the one holding token ``start``) alone, hashed now;
2. L1 asked once (one lock), then the L2 indexes once about the chunks after L1's (``L2Tier.lookup``; with
   ``probe``, names past an index's prefix are probed in the background);
3. only when every known chunk is held is the rest of the prompt hashed (from the memoised prefix on) and
   asked about the same way.

So a new prompt whose first chunk no tier holds (most lookups of new prompts) costs one chunk's hashing, and a
prompt is never hashed twice (``cache.memo``). The answer is counted once in the lookup metrics (``count``):
``kvtier_lookup_requests_total``, ``kvtier_lookup_tokens_total`` and ``kvtier_lookup_hit_tokens_total`` by medium.
The server defers a lookup over an L2 whose index may lag (``server/lookup.py``) and counts it at reply time.

Thread-safety: as the tiers (L1, the L2 indexes and the memo lock themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.backend import TierHits
from kvtier.cache.prompt_keys import PromptKeys
from kvtier.cache.tickets import ChunkRef
from kvtier.errors import InputError
from kvtier.medium import Medium


@dataclass(slots=True)
class Match:
    """A lookup's answer: the validated ``tokens``, the chunk ``refs`` it was computed over (every chunk's, or
    only the known ones when those were not all held) and the ``hits``. ``partial``: every known chunk is held
    and the rest was not hashed (``match(extend=False)``): not an answer yet."""

    tokens: np.ndarray
    refs: list[ChunkRef]
    hits: TierHits
    partial: bool = False


def refs_from(refs: list[ChunkRef], start: int, chunk_size: int) -> list[ChunkRef]:
    """The refs of the chunks from the one holding token ``start`` on (``KVBackend``'s ``start``). Raises
    InputError for a ``start`` that is not an int >= 0."""
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise InputError(f"start must be an int >= 0 (a token offset), got {start!r}")
    return refs[start // chunk_size:] if start else refs


class Lookups:
    """The lookup policy of one cache (module docstring).

    Args:
        keys: the cache's ``PromptKeys``.
        tiers: the shared ``Tiers`` (``l1``, ``l2``, ``metrics``).
        chunk_size: tokens per chunk.
    """

    def __init__(self, keys: PromptKeys, tiers, chunk_size: int):
        self.keys, self.l1, self.l2, self.metrics = keys, tiers.l1, tiers.l2, tiers.metrics
        self.chunk_size = chunk_size

    def match(self, tokens, namespace: str | None = None, *, extra_keys=None, start: int = 0, probe: bool = True,
              whole: bool = False, count: bool = True, extend: bool = True) -> Match:
        """Answer a lookup of ``tokens`` from ``start``'s chunk on (module docstring); ``whole``: resolve every
        chunk's refs first (the server's deferred lookups probe past the held ones); ``count``: in the lookup
        metrics; ``extend`` False: when the rest of the prompt is needed, return a ``partial`` match instead of
        hashing it (the server hands long ones to its hashing worker). Raises InputError on bad tokens, extra keys
        or ``start``."""
        if whole:
            arr, refs = self.keys.chunk_refs(tokens, namespace, extra_keys=extra_keys)
            complete = True
        else:
            arr, refs, complete = self.keys.known_refs(tokens, namespace, extra_keys=extra_keys,
                                                       min_chunks=_chunk_of(start, self.chunk_size) + 1)
        hits = self.tier_hits(refs, start, probe=probe)
        if not complete and (not refs or hits.num_tokens == refs[-1].end):  # every known chunk held: the rest
            if not extend:
                return Match(arr, refs, hits, partial=True)
            arr, refs = self.keys.chunk_refs(tokens, namespace, extra_keys=extra_keys)
            hits = self.tier_hits(refs, start, probe=probe)
        if count:
            self.count(len(arr), refs, start, hits)
        return Match(arr, refs, hits)

    def tier_hits(self, refs: list[ChunkRef], start: int = 0, *, probe: bool = True) -> TierHits:
        """The ``TierHits`` of a prompt's ``refs`` from ``start``'s chunk on, not counted: L1 asked once, then the
        L2 indexes once about the chunks after L1's. Raises InputError for a bad ``start``."""
        refs = refs_from(refs, start, self.chunk_size)
        n_l1 = self.l1.leading([r.key for r in refs])
        n_l2 = self.l2.lookup([r.key for r in refs[n_l1:]], probe=probe) if n_l1 < len(refs) else 0
        return TierHits(refs[n_l1 + n_l2 - 1].end if n_l1 + n_l2 else 0, refs[n_l1 - 1].end if n_l1 else 0)

    def count(self, num_tokens: int, refs: list[ChunkRef], start: int, hits: TierHits) -> None:
        """Count one lookup of a ``num_tokens`` prompt answered ``hits`` (``tier_hits`` of ``refs`` and ``start``):
        ``kvtier_lookup_hit_tokens_total`` by medium (CPU, STORAGE) from ``start``'s chunk on."""
        refs = refs_from(refs, start, self.chunk_size)
        base = refs[0].start if refs else 0
        l1_tokens, total = hits.num_l1_tokens, hits.num_tokens
        self.metrics.inc_many((("kvtier_lookup_requests_total", 1, ()), ("kvtier_lookup_tokens_total", num_tokens, ()),
                               ("kvtier_lookup_hit_tokens_total", max(0, l1_tokens - base), (Medium.CPU,)),
                               ("kvtier_lookup_hit_tokens_total", total - max(l1_tokens, base if total else 0),
                                (Medium.STORAGE,))))


def _chunk_of(start, chunk_size: int) -> int:
    """The chunk holding token ``start`` (0 for a bad ``start``: ``tier_hits`` refuses it with the reason)."""
    return start // chunk_size if isinstance(start, int) and not isinstance(start, bool) and start > 0 else 0
