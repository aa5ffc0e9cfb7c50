"""EventEmitter: block splitting, vLLM-equal hashes (reference events-and-hashing.md §2.4), dedup, removal."""

import numpy as np
import pytest

from kvtier.config import build_config
from kvtier.errors import ConfigError, InputError
from kvtier.events import AllBlocksCleared, BlockIndex, BlockRemoved, BlockStored, EventBatch, EventEmitter
from kvtier.hashing import event_id, prefix_hashes

H0, H1 = 2164874634404590027, 17270480062156288726  # vLLM's own sha256_cbor block hashes, seed "0", §2.4


def emitter(chunk_size=8, block_size=None, **extra):
    kv = {"event_block_size": block_size} if block_size else {}
    kv.update(extra.pop("kv_events", {}))
    return EventEmitter(build_config({"chunk_size": chunk_size, "hash_seed": "0", "kv_events": kv, **extra}))


def test_published_hashes_equal_vllm_block_hashes_section_2_4():
    em = emitter(chunk_size=8, block_size=4)
    assert em.stored(list(range(1, 9)), 0, 1, "CPU") == 1
    [ev] = em.take_events()
    assert ev == BlockStored([H0, H1], None, list(range(1, 9)), 4, None, "CPU", None)


def test_chunk_equal_block_uses_chunk_hashes_and_parent_chain():
    em = emitter(chunk_size=4)
    tokens = list(range(1, 13))
    em.stored(tokens[:4], 0, 1, "CPU")
    em.stored(tokens, 1, 2, "STORAGE")
    first, second = em.take_events()
    assert first.block_hashes == [H0] and first.parent_block_hash is None
    expected = [event_id(d) for d in prefix_hashes(tokens, 4, "sha256_cbor", "0")]
    assert second.block_hashes == expected[1:] and second.parent_block_hash == H0
    assert second.token_ids == tokens[4:] and second.medium == "STORAGE" and second.block_size == 4


def test_sub_blocks_chain_across_calls_and_match_a_single_hash_of_the_whole_prefix():
    tokens = list(range(100, 124))
    expected = [event_id(d) for d in prefix_hashes(tokens, 2, "sha256_cbor", "0")]
    em = emitter(chunk_size=8, block_size=2)
    em.stored(tokens[:8], 0, 1, "CPU")
    em.stored(tokens, 1, 2, "CPU")
    a, b = em.take_events()
    assert a.block_hashes + b.block_hashes == expected
    assert b.parent_block_hash == a.block_hashes[-1]
    # a fresh emitter (no chain state) storing only the last chunk must agree
    fresh = emitter(chunk_size=8, block_size=2)
    fresh.stored(tokens, 2, 1, "CPU")
    [c] = fresh.take_events()
    assert c.block_hashes == expected[8:] and c.parent_block_hash == expected[7] and c.token_ids == tokens[16:]


def test_given_chunk_hashes_give_the_same_events_as_computed_ones():
    tokens = np.arange(40, 72)
    hashes = prefix_hashes(tokens, 8, "sha256_cbor", "0")
    for block_size in (8, 4):
        em1, em2 = emitter(8, block_size), emitter(8, block_size)
        em1.stored(tokens, 1, 3, "CPU")
        em2.stored(tokens, 1, 3, "CPU", chunk_hashes=hashes)
        assert em1.take_events() == em2.take_events()


def test_given_block_hashes_are_used_as_is():
    tokens = np.arange(40, 72)
    chunks = prefix_hashes(tokens, 8, "sha256_cbor", "0")
    blocks = prefix_hashes(tokens, 4, "sha256_cbor", "0")
    em1, em2 = emitter(8, 4), emitter(8, 4)
    em1.stored(tokens, 2, 2, "CPU")
    em2.stored(tokens, 2, 2, "CPU", chunk_hashes=chunks, block_hashes=blocks)
    assert em1.take_events() == em2.take_events()
    fake = [bytes([i]) * 32 for i in range(len(blocks))]  # proves the given digests are what gets published
    em3 = emitter(8, 4)
    em3.stored(tokens, 1, 1, "CPU", chunk_hashes=chunks, block_hashes=fake)
    [ev] = em3.take_events()
    assert ev.block_hashes == [int.from_bytes(f[-8:], "big") for f in fake[2:4]]
    assert ev.parent_block_hash == int.from_bytes(fake[1][-8:], "big")


def test_event_block_size_must_divide_chunk_size():
    with pytest.raises(ConfigError, match="must divide chunk_size"):
        emitter(chunk_size=8, block_size=3)


def test_range_beyond_tokens_is_an_input_error():
    em = emitter(chunk_size=4)
    with pytest.raises(InputError, match="token prefix"):
        em.stored([1, 2, 3, 4, 5], 0, 2, "CPU")


def test_stored_twice_announced_once_and_removed_once_per_medium():
    em = emitter(chunk_size=4)
    tokens = list(range(1, 9))
    assert em.stored(tokens, 0, 2, "CPU") == 2
    assert em.stored(tokens, 0, 2, "CPU") == 0  # already announced in CPU
    assert em.stored(tokens, 0, 2, "STORAGE") == 2  # another medium is another announcement
    events = em.take_events()
    assert [(type(e).__name__, e.medium) for e in events] == [("BlockStored", "CPU"), ("BlockStored", "STORAGE")]
    h = prefix_hashes(tokens, 4, "sha256_cbor", "0")
    assert em.removed([h[1]], "CPU") == 1
    assert em.removed([h[1]], "CPU") == 1  # unknown now: published as the chunk hash itself
    [removed, again] = em.take_events()
    assert removed == BlockRemoved([H1], "CPU") and again == BlockRemoved([event_id(h[1])], "CPU")
    index = BlockIndex()
    index.apply(EventBatch(0.0, events + [removed], 0))
    assert index.contains(H0, "CPU") and not index.contains(H1, "CPU") and index.contains(H1, "STORAGE")
    # once removed, the chunk is announced again when stored again
    assert em.stored(tokens, 0, 2, "CPU") == 1
    [re_stored] = em.take_events()
    assert re_stored.block_hashes == [H1] and re_stored.parent_block_hash == H0


def test_removed_maps_chunks_to_their_sub_blocks_and_unknown_chunks_to_the_chunk_hash():
    em = emitter(chunk_size=8, block_size=4)
    tokens = list(range(1, 17))
    em.stored(tokens, 0, 2, "CPU")
    [stored] = em.take_events()
    chunks = prefix_hashes(tokens, 8, "sha256_cbor", "0")
    stranger = prefix_hashes(list(range(50, 58)), 8, "sha256_cbor", "0")[0]
    assert em.removed([chunks[1], stranger], "CPU") == 3
    [ev] = em.take_events()
    assert ev.block_hashes == stored.block_hashes[2:] + [event_id(stranger)]


def test_middle_chunk_already_known_splits_into_runs_with_correct_parents():
    em = emitter(chunk_size=4)
    tokens = list(range(1, 17))
    em.stored(tokens[:12], 1, 2, "CPU")
    em.take_events()
    em.stored(tokens, 0, 4, "CPU")  # chunks 0 and 3 are new, 1-2 known
    a, b = em.take_events()
    ids = [event_id(d) for d in prefix_hashes(tokens, 4, "sha256_cbor", "0")]
    assert a.block_hashes == [ids[0]] and a.parent_block_hash is None
    assert b.block_hashes == [ids[3]] and b.parent_block_hash == ids[2] and b.token_ids == tokens[12:]


def test_clearing_one_medium_removes_only_its_blocks_and_clearing_all_is_one_event():
    em = emitter(chunk_size=4)
    tokens = list(range(1, 9))
    em.stored(tokens, 0, 2, "CPU")
    em.stored(tokens, 0, 2, "STORAGE")
    em.take_events()
    em.cleared("STORAGE")
    events = em.take_events()
    assert events == [BlockRemoved([H0, H1], "STORAGE")]
    assert em.num_known_chunks("CPU") == 2 and em.num_known_chunks("STORAGE") == 0
    em.cleared("STORAGE")  # nothing left there: no event
    assert em.take_events() == []
    em.cleared()
    assert em.take_events() == [AllBlocksCleared()]
    assert em.num_known_chunks("CPU") == 0


def test_bytes_hash_format_publishes_full_digests():
    em = emitter(chunk_size=4, kv_events={"hash_format": "bytes"})
    tokens = list(range(1, 9))
    em.stored(tokens, 0, 2, "CPU")
    [ev] = em.take_events()
    digests = prefix_hashes(tokens, 4, "sha256_cbor", "0")
    assert ev.block_hashes == digests and all(len(d) == 32 for d in ev.block_hashes)


def test_partial_chunk_with_save_unfull_chunk_is_its_own_short_block():
    em = emitter(chunk_size=8, block_size=4, save_unfull_chunk=True)
    tokens = list(range(1, 15))  # one full chunk + 6 tokens
    em.stored(tokens, 0, 2, "CPU")
    full, partial = em.take_events()
    every = [event_id(d) for d in prefix_hashes(tokens, 4, "sha256_cbor", "0", include_partial=True)]
    assert full.block_hashes == every[:3] and full.block_size == 4 and full.token_ids == tokens[:12]
    assert partial.block_hashes == every[3:] and partial.block_size == 2
    assert partial.parent_block_hash == every[2] and partial.token_ids == tokens[12:]
