"""The blocks one kvtier server holds per medium (``CPU`` = L1, ``STORAGE`` = L2), mirrored from its KV events, and
the engine-side events they become (``ServerFeed`` in ``kvtier.connectors.server_feed`` feeds it).

Rules (why):

- Each block hash is forwarded once per medium while the server holds it: the server publishes one
  ``BlockStored`` per stored copy (several workers or namespaces storing the same prefix) but a
  ``BlockRemoved`` only once no copy in that medium holds the block (``kvtier.events.emitter``), so a
  store of a held block is skipped and a removal forgets the block.
- Blocks whose ``block_size`` is not the engine's (a partial last block) are dropped: the router drops
  them too and would then see a broken parent chain.
- The server's own ``AllBlocksCleared`` and a server restart become ``BlockRemoved`` for the mirrored
  blocks of that server, never ``AllBlocksCleared`` (which would also wipe the engine's GPU tier).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.events.model import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvtier.medium import Medium

SERVER_MEDIUMS = (Medium.CPU, Medium.STORAGE)  # what a kvtier server holds blocks in (L1, L2)


@dataclass
class _Block:
    parent: int | None
    token_ids: list[int]
    extra_key: object
    lora_name: str | None


class BlockMirror:
    """Blocks one kvtier server holds per medium, fed with its events; emits the engine-side events.

    Not thread-safe: ``ServerFeed`` serialises the calls.
    """

    def __init__(self, block_size: int, mediums=SERVER_MEDIUMS) -> None:
        self.block_size = block_size
        self.mediums = tuple(mediums)
        self.blocks: dict[str, dict[int, _Block]] = {m: {} for m in self.mediums}
        self.dropped_blocks = 0  # partial blocks or other block sizes, never forwarded

    def apply(self, events: list[Event]) -> list[Event]:
        """Apply the server's events in order; return the events the engine must publish for them."""
        out: list[Event] = []
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                out += self.forget()
            elif ev.medium not in self.blocks:
                continue
            elif isinstance(ev, BlockStored):
                out += self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                out += self._removed(ev)
        return out

    def _stored(self, ev: BlockStored) -> list[Event]:
        if ev.block_size != self.block_size or len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
            self.dropped_blocks += len(ev.block_hashes)
            return []
        held, bs, out = self.blocks[ev.medium], ev.block_size, []
        run: list[int] = []
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            prev = ev.block_hashes[i - 1] if i else ev.parent_block_hash
            if h in held:
                if run:
                    out.append(self._event(ev.medium, run, parent))
                    run = []
                continue
            if not run:
                parent = prev
            extra = ev.extra_keys[i] if ev.extra_keys is not None and i < len(ev.extra_keys) else None
            held[h] = _Block(prev, list(ev.token_ids[i * bs:(i + 1) * bs]), extra, ev.lora_name)
            run.append(h)
        if run:
            out.append(self._event(ev.medium, run, parent))
        return out

    def _removed(self, ev: BlockRemoved) -> list[Event]:
        held, gone = self.blocks[ev.medium], []
        for h in ev.block_hashes:
            if held.pop(h, None) is not None:
                gone.append(h)
        return [BlockRemoved(gone, ev.medium)] if gone else []

    def _event(self, medium: str, hashes: list[int], parent) -> BlockStored:
        held = self.blocks[medium]
        tokens: list[int] = []
        for h in hashes:
            tokens += held[h].token_ids
        extra = [held[h].extra_key for h in hashes]
        return BlockStored(list(hashes), parent, tokens, self.block_size, None, medium, held[hashes[0]].lora_name,
                           extra_keys=extra if any(e is not None for e in extra) else None)

    def announce(self) -> list[Event]:
        """``BlockStored`` for every held block (runs of parent-linked blocks), e.g. after the engine's clear."""
        out: list[Event] = []
        for medium, held in self.blocks.items():
            run: list[int] = []
            for h, block in held.items():  # insertion order: a block comes after its parent
                if run and block.parent != run[-1]:
                    out.append(self._event(medium, run, held[run[0]].parent))
                    run = []
                run.append(h)
            if run:
                out.append(self._event(medium, run, held[run[0]].parent))
        return out

    def resync(self) -> list[Event]:
        """``BlockRemoved`` for every held block, then ``announce()``: the router's view of these blocks becomes
        exactly what is held, whatever part of it the router had seen before."""
        return [BlockRemoved(list(held), m) for m, held in self.blocks.items() if held] + self.announce()

    def forget(self) -> list[Event]:
        """Drop every block (the server lost them); ``BlockRemoved`` per medium that held any."""
        out: list[Event] = [BlockRemoved(list(held), m) for m, held in self.blocks.items() if held]
        self.blocks = {m: {} for m in self.mediums}
        return out

    def num_blocks(self, medium: str) -> int:
        return len(self.blocks.get(medium, ()))
