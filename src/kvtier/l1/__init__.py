"""L1: the host-memory tier (arena allocator, eviction policies, the chunk store)."""

from kvtier.l1.arena import Arena
from kvtier.l1.policies import ARC, LRU, S3FIFO, make_policy
from kvtier.l1.store import L1Store

__all__ = ["ARC", "LRU", "S3FIFO", "Arena", "L1Store", "make_policy"]
