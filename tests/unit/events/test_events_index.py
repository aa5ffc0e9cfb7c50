"""BlockIndex: a router's set view of what each medium holds."""

from kvtier.events import AllBlocksCleared, BlockIndex, BlockRemoved, BlockStored, EventBatch


def batch(*events):
    return EventBatch(0.0, list(events), 0)


def stored(hashes, medium="CPU"):
    return BlockStored(hashes, None, [1] * len(hashes), 1, None, medium, None)


def test_a_removal_drops_a_block_however_often_it_was_stored():
    """kvtier announces every stored copy and removes a hash once, with its last copy (the emitter's rule)."""
    index = BlockIndex()
    index.apply(batch(stored([7]), stored([7]), stored([7], "STORAGE")))
    assert index.contains(7, "CPU") and index.stores(7, "CPU") == 2
    index.apply(batch(BlockRemoved([7], "CPU")))
    assert not index.contains(7, "CPU") and index.contains(7, "STORAGE") and index.unknown_removals == 0
    index.apply(batch(BlockRemoved([7], "CPU")))
    assert index.unknown_removals == 1 and len(index) == 1


def test_mediums_are_counted_separately_and_unknown_removals_counted():
    index = BlockIndex()
    index.apply(batch(stored([1, 2], "CPU"), stored([2], "STORAGE")))
    index.apply(batch(BlockRemoved([2], "CPU"), BlockRemoved([99], "CPU"), BlockRemoved([1], "STORAGE")))
    assert index.mediums(2) == {"STORAGE"} and index.mediums(1) == {"CPU"}
    assert index.unknown_removals == 2
    assert index.contains(2) and not index.contains(2, "CPU")


def test_all_blocks_cleared_empties_the_index():
    index = BlockIndex()
    index.apply(batch(stored([1, 2, 3]), AllBlocksCleared(), stored([4])))
    assert len(index) == 1 and index.contains(4) and not index.contains(1)
