"""Retention hints in L2 capacity eviction: which records an adapter with a capacity evicts first.

An adapter that evicts by itself (``local_disk``, ``memory`` with ``size_gb``) keeps a ``kvtier.l1.retention``
table of the records a store asked to keep (``L2Adapter.retain``, called by the writer after a record is written:
``priority``, ``ttl_seconds``, ``session_id``, as in L1). Eviction then takes, least recently used first, the
records without a live hint, and only when those do not free enough the hinted ones, lowest priority first. The
capacity is never exceeded; hinted records may hold at most the adapter's ``retention_max_share`` of it (past
that a hint is refused: the record stays an ordinary one). The table is in memory: after a restart every record
found on disk is ordinary until a store hints it again.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.l1.retention import Retention


def victims(sizes: Iterable[tuple[str, int]], need_bytes: int, retention: Retention) -> list[str]:
    """Names to evict to free ``need_bytes`` from ``sizes`` ((name, bytes), least recently used first): records
    without a live hint first, in that order, then hinted ones by rank. Stops as soon as enough is freed (without
    hints it reads only the records it returns). May return fewer bytes than asked when everything is taken."""
    out: list[str] = []
    freed = 0
    now = retention.clock() if len(retention) else None
    protected: list[tuple[int, str, int]] = []
    for name, size in sizes:
        if freed >= need_bytes:
            return out
        rank = None if now is None else retention.protection(name, now)
        if rank is None:
            out.append(name)
            freed += size
        else:
            protected.append((rank, name, size))
    for _, name, size in sorted(protected, key=lambda p: p[0]):
        if freed >= need_bytes:
            break
        out.append(name)
        freed += size
    return out
