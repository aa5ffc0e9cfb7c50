"""Promotions: how chunks that only L2 holds come back into L1, the one home of the promotion policy.

A part of ``KVCache`` (made by its constructor). The path of a promotion::

    a retrieve or a prefetch finds the chunks after L1's leading ones     (KVCache.begin_retrieve / prefetch)
      -> wanted(refs, n): an L2 index holds the first chunk L1 lacks      (no I/O: the indexes)
      -> promote(tokens, refs, n): L2Tier.read, one batched get per adapter in cascade order, each record
         verified (a bad one is a miss, deleted and counted); every chunk read is copied into a new L1 slot
         (decoded there when encoded) and committed, and announced as CPU in the events; the prefix stops at
         the first chunk that is missing, does not fit or does not decode
      -> with ``l2_promote_to_faster_l2``: a record found in adapter i is also written into adapters 0..i-1
         (``L2Tier.copy_to_faster``)

In process the caller's thread does the I/O. In a server the request thread only asks ``wanted``; the job pool
(``server/jobs.py``) runs ``KVCache.prefetch`` for the request (``server/dataops.py``), and the request is
answered from L1 when the job is done or its deadline passes. A lookup never promotes (read-only).

Thread-safety: as the tiers (L1, L2 and the events lock themselves).
"""

from __future__ import annotations

import numpy as np

from kvtier.cache.tickets import ChunkRef
from kvtier.medium import Medium


class Promotions:
    """The promotion policy of one cache (module docstring).

    Args:
        tiers: the shared ``Tiers`` (``l1``, ``l2``, ``events``, ``metrics``, ``config``).
        layout: the cache's KV layout (a record's size must be its chunk's).
    """

    def __init__(self, tiers, layout):
        self.l1, self.l2, self.tiers, self.metrics = tiers.l1, tiers.l2, tiers, tiers.metrics
        self.layout = layout
        self.to_faster = tiers.config.l2_promote_to_faster_l2

    def wanted(self, refs: list[ChunkRef], n: int) -> bool:
        """Whether the chunks after the first ``n`` of ``refs`` (the ones L1 holds) are worth reading from L2: an
        L2 index holds the next one. Asks the indexes only."""
        return n < len(refs) and bool(self.l2.adapters) and bool(self.l2.lookup([refs[n].key]))

    def promote(self, tokens: np.ndarray, refs: list[ChunkRef], n: int) -> int:
        """Copy the leading L2 hits among ``refs[n:]`` into L1 (module docstring; blocks on L2 I/O). Returns how
        many of ``refs[n:]`` L1 holds now, from the first on."""
        refs = refs[n:]
        if not refs or not self.l2.adapters:
            return 0
        payloads = self.l2.read([r.key for r in refs], [tokens[r.start:r.end].tolist() for r in refs])
        if self.to_faster:
            self.l2.copy_to_faster(payloads)
        count = promoted = 0
        for ref, payload in zip(refs, payloads):
            if payload.nbytes != self.layout.chunk_bytes(ref.end - ref.start):  # the header agreed, the size must too
                break
            view = self.l1.reserve(ref.key, payload.nbytes, ref.end - ref.start)
            if view is None:
                if not self.l1.contains(ref.key):  # no room (everything pinned): stop the prefix here
                    break
            elif payload.copy_into(view):
                self.l1.commit(ref.key)
                promoted += 1
            else:  # the record did not decode (dropped and counted by the tier): the prefix stops here
                self.l1.abort(ref.key)
                break
            count += 1
        if promoted:
            self.metrics.inc("kvtier_l2_promoted_chunks_total", promoted)
            if self.tiers.events is not None:  # copies already in L1 are skipped there
                self.tiers.events.stored(tokens, refs[:count], Medium.CPU)
        return count
