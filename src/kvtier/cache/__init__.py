"""The in-process cache: ``KVCache`` (lookup / store / retrieve over L1 and the L2 cascade, a ``KVBackend``) over
``Tiers`` (what one process shares: L1, L2, metrics, events), the refs and tickets it hands out (``tickets``)
and the lookup memo (``memo``). A server makes one ``Tiers`` and a ``KVCache`` per (model, layout, namespace)."""

from kvtier.cache.cache import KVCache
from kvtier.cache.memo import LookupMemo
from kvtier.cache.tickets import ChunkRef, L1Slot, PromptBlocks, RetrieveTicket, StoreTicket
from kvtier.cache.tiers import Tiers

__all__ = ["ChunkRef", "KVCache", "L1Slot", "LookupMemo", "PromptBlocks", "RetrieveTicket", "StoreTicket", "Tiers"]
