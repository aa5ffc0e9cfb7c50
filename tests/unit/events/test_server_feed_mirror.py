"""BlockMirror: a kvtier server's events turned into one engine's events (no sockets)."""

from kvtier.connectors.block_mirror import BlockMirror
from kvtier.connectors.server_feed import engine_subscribe_endpoint
from kvtier.events.model import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def stored(hashes, parent=None, medium="CPU", first_token=0, block_size=BS):
    n = len(hashes) * block_size
    return BlockStored(list(hashes), parent, list(range(first_token, first_token + n)), block_size, None, medium, None)


def test_a_block_stored_twice_is_announced_once_and_a_removal_forgets_it():
    m = BlockMirror(BS)
    assert m.apply([stored([1, 2])]) == [stored([1, 2])]
    assert m.apply([stored([1, 2])]) == []  # a second copy (another worker's store, another namespace)
    # the server names a block in BlockRemoved once its last copy in that medium is gone
    assert m.apply([BlockRemoved([1, 2, 8], "CPU")]) == [BlockRemoved([1, 2], "CPU")]
    assert m.apply([BlockRemoved([1], "CPU")]) == []
    assert m.num_blocks("CPU") == 0


def test_only_new_blocks_of_a_store_are_forwarded_with_their_parent():
    m = BlockMirror(BS)
    m.apply([stored([1, 2])])
    out = m.apply([stored([1, 2, 3, 4])])
    assert out == [BlockStored([3, 4], 2, list(range(8, 16)), BS, None, "CPU", None)]


def test_partial_blocks_and_other_mediums_are_dropped():
    m = BlockMirror(BS)
    assert m.apply([stored([9], block_size=2), stored([5], medium="GPU")]) == []
    assert m.dropped_blocks == 1 and m.num_blocks("CPU") == 0


def test_announce_rebuilds_parent_linked_runs_per_medium():
    m = BlockMirror(BS)
    m.apply([stored([1, 2]), stored([3], parent=2, first_token=8), stored([7], first_token=100),
             stored([1], medium="STORAGE")])
    assert m.announce() == [BlockStored([1, 2, 3], None, list(range(12)), BS, None, "CPU", None),
                            BlockStored([7], None, list(range(100, 104)), BS, None, "CPU", None),
                            BlockStored([1], None, list(range(4)), BS, None, "STORAGE", None)]


def test_a_server_clear_is_a_removal_never_an_all_blocks_cleared():
    m = BlockMirror(BS)
    m.apply([stored([1]), stored([2], medium="STORAGE")])
    out = m.apply([AllBlocksCleared()])
    assert out == [BlockRemoved([1], "CPU"), BlockRemoved([2], "STORAGE")]
    assert m.announce() == []


def test_engine_endpoint_to_subscribe_to():
    assert engine_subscribe_endpoint("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert engine_subscribe_endpoint("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert engine_subscribe_endpoint("ipc:///tmp/x") == "ipc:///tmp/x"
    assert engine_subscribe_endpoint("inproc://x") is None
    assert engine_subscribe_endpoint("tcp://10.1.2.3:5557") is None  # vLLM connects there: nothing to subscribe to
