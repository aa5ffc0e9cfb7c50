"""BlockIndex: which blocks each medium holds, as a router that reads KV cache events keeps it (the tests' and
the benchmarks' router view; kvtier's own events keep its invariants: one BlockRemoved when the last copy leaves)."""

from __future__ import annotations

from kvtier.events.model import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


class BlockIndex:
    """A router's view of which blocks each medium holds, fed with event batches: a set per medium, as routers
    keep it (NVIDIA Dynamo's KV router, vLLM's consumers).

    ``BlockStored`` adds (hash, medium), again or not; ``BlockRemoved`` drops it, however often it was stored
    (kvtier publishes one ``BlockStored`` per stored copy and one ``BlockRemoved`` when the last copy of a hash
    leaves a medium: ``kvtier.events.emitter``); ``AllBlocksCleared`` empties the index. Hashes are used as
    given (use the decoder's normalised uint64 ints to mix producers). ``stores(hash, medium)`` counts the
    ``BlockStored`` seen since the hash was last removed (how many copies were announced).
    """

    def __init__(self) -> None:
        self._refs: dict[object, dict[str, int]] = {}
        self.unknown_removals = 0  # removals of blocks never stored (or already gone)

    def apply(self, batch: EventBatch) -> None:
        """Apply every event of ``batch`` in order."""
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    per = self._refs.setdefault(h, {})
                    per[ev.medium] = per.get(ev.medium, 0) + 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    per = self._refs.get(h)
                    if not per or ev.medium not in per:
                        self.unknown_removals += 1
                        continue
                    del per[ev.medium]
                    if not per:
                        del self._refs[h]
            elif isinstance(ev, AllBlocksCleared):
                self._refs.clear()

    def contains(self, block_hash, medium: str | None = None) -> bool:
        """Whether ``block_hash`` is held (in ``medium``, or anywhere when None)."""
        per = self._refs.get(block_hash)
        return bool(per) and (medium is None or medium in per)

    def mediums(self, block_hash) -> set[str]:
        return set(self._refs.get(block_hash, ()))

    def stores(self, block_hash, medium: str) -> int:
        return self._refs.get(block_hash, {}).get(medium, 0)

    def __len__(self) -> int:
        return len(self._refs)
