"""Events emitted by the cache itself: every tier, removals, clears, engine-aligned hashes."""

import pytest
import torch

from kvtier.cache import KVCache, Tiers
from kvtier.config import build_config
from kvtier.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.hashing import event_id, prefix_hashes
from kvtier.keys import namespace_of
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)


def make_cache(tmp_path, **overrides):
    cfg = build_config({"chunk_size": 8, "l1_size_gb": "1MiB", "enable_kv_events": True,
                        "l2_adapters": [{"type": "local_disk", "path": str(tmp_path / "disk")}], **overrides})
    return KVCache(cfg, "m", LAYOUT, publish_events=False)


def kv(n):
    return torch.randn(LAYOUT.chunk_shape(n))


def by_type(events, cls, medium=None):
    return [e for e in events if isinstance(e, cls) and (medium is None or e.medium == medium)]


def test_store_emits_cpu_then_storage_with_chained_parents(tmp_path):
    cache = make_cache(tmp_path)
    tokens = list(range(24))
    cache.store(tokens, kv(24))
    cache.flush()
    events = cache.take_events()
    ids = [event_id(h) for h in prefix_hashes(tokens, 8)]
    for medium in ("CPU", "STORAGE"):
        stored = by_type(events, BlockStored, medium)
        assert [h for e in stored for h in e.block_hashes] == ids
        assert stored[0].parent_block_hash is None and stored[0].token_ids == tokens
        assert stored[0].block_size == 8
    # a longer prompt stores only its new chunk, whose parent is the last stored block
    cache.store(tokens + list(range(100, 108)), kv(32))
    cache.flush()
    new = by_type(cache.take_events(), BlockStored, "CPU")
    assert len(new) == 1 and new[0].parent_block_hash == ids[-1] and new[0].token_ids == list(range(100, 108))
    cache.close()


def test_hashes_line_up_with_engine_blocks(tmp_path):
    """block_size = the engine's block size: published hashes equal vLLM's (§2.4 vectors), for both algorithms."""
    for algorithm, ids in (("sha256_cbor", [2164874634404590027, 17270480062156288726]),
                           ("sha256", [10362225831949560093, 12472515041799373675])):
        cache = make_cache(tmp_path, hash_seed="0", hash_algorithm=algorithm, block_size=4, l2_adapters=[])
        cache.store([1, 2, 3, 4, 5, 6, 7, 8], kv(8))
        (event,) = by_type(cache.take_events(), BlockStored, "CPU")
        assert event.block_hashes == ids and event.block_size == 4 and event.extra_keys == [None, None]
        # the chunk's key is the digest of its last block
        (ref,) = cache.chunk_refs([1, 2, 3, 4, 5, 6, 7, 8])[1]
        assert event_id(ref.key.prefix_hash) == ids[-1]
        cache.close()


@pytest.mark.parametrize("other", ["namespace", "model"])
def test_one_block_stored_per_copy_and_no_removal_while_a_copy_holds_the_hash(tmp_path, other):
    """Two copies of the same tokens (under another namespace, or another model's weights) carry the same
    block hashes, as vLLM's would (they hold neither): each copy is announced, and evicting one copy from L1
    publishes no BlockRemoved while the other still holds those hashes."""
    cfg = build_config({"chunk_size": 8, "enable_kv_events": True, "l1_size_gb": f"{LAYOUT.chunk_bytes(8) * 4 + 128}B",
                        "l2_adapters": [{"type": "local_disk", "path": str(tmp_path / "disk")}]})
    tiers = Tiers(cfg, publish_events=False)
    a = KVCache(cfg, "weights@1", LAYOUT, tiers=tiers)
    b = (KVCache(cfg, "weights@2", LAYOUT, tiers=tiers) if other == "model"
         else KVCache(cfg, "weights@1", LAYOUT, namespace=namespace_of(cache_salt="s"), tiers=tiers))
    tokens = list(range(16))
    assert a.store(tokens, kv(16)) == 2 and b.store(tokens, kv(16)) == 2
    tiers.l2.flush()  # chunks stay pinned until written to L2
    ids = [event_id(h) for h in prefix_hashes(tokens, 8)]
    events = a.take_events()
    for medium in ("CPU", "STORAGE"):
        assert [e.block_hashes for e in by_type(events, BlockStored, medium)] == [ids, ids], medium
    assert b.lookup(tokens) == 16 and a.lookup(tokens) == 16  # two copies, neither hides the other
    # L1 holds four chunks: each new one evicts the least recently used (a's tail, a's head, b's tail, ...)
    for i in range(2):
        a.store(list(range(100 + 8 * i, 108 + 8 * i)), kv(8))
        tiers.l2.flush()
    assert not by_type(a.take_events(), BlockRemoved), "a's copies went, b's still hold the hashes"
    assert a.tiers.l1.contains(b.chunk_refs(tokens)[1][0].key)
    a.store(list(range(200, 208)), kv(8))  # now b's tail goes: its hash is held by nobody in L1
    tiers.l2.flush()
    assert by_type(a.take_events(), BlockRemoved) == [BlockRemoved([ids[1]], "CPU")]
    # clearing L2 only: each hash held there is named once, L1 untouched
    tiers.clear("STORAGE")
    [cleared] = a.take_events()
    assert cleared.medium == "STORAGE" and sorted(cleared.block_hashes) == sorted(set(cleared.block_hashes))
    assert set(ids) <= set(cleared.block_hashes)
    tiers.clear()
    assert a.take_events() == [AllBlocksCleared()]
    tiers.close()


def test_eviction_and_clears(tmp_path):
    cache = make_cache(tmp_path, l1_size_gb=f"{LAYOUT.chunk_bytes(8) * 2 + 128}B")
    first = list(range(16))
    cache.store(first, kv(16))
    cache.flush()  # chunks stay pinned until their L2 write is done
    cache.store(list(range(500, 508)), kv(8))  # L1 holds two chunks: the tail of the first prompt goes
    cache.flush()
    events = cache.take_events()
    removed = by_type(events, BlockRemoved, "CPU")
    assert [h for e in removed for h in e.block_hashes] == [event_id(prefix_hashes(first, 8)[1])]
    assert cache.metrics.value("kvtier_evicted_chunks_total", medium="CPU") == 1
    # clearing L2 only: BlockRemoved(STORAGE) for every stored block, no AllBlocksCleared
    cache.clear("STORAGE")
    events = cache.take_events()
    assert not by_type(events, AllBlocksCleared) and not by_type(events, BlockRemoved, "CPU")
    assert len({h for e in by_type(events, BlockRemoved, "STORAGE") for h in e.block_hashes}) == 3
    assert cache.lookup(first) == 8  # L1 untouched
    cache.clear()
    assert by_type(cache.take_events(), AllBlocksCleared)
    assert cache.lookup(first) == 0
    cache.close()


def test_promotion_announces_cpu_again_and_store_twice_once(tmp_path):
    cache = make_cache(tmp_path)
    tokens = list(range(16))
    cache.store(tokens, kv(16))
    cache.store(tokens, kv(16))
    cache.flush()
    events = cache.take_events()
    assert len([h for e in by_type(events, BlockStored, "CPU") for h in e.block_hashes]) == 2
    cache.clear("CPU")
    assert len([h for e in by_type(cache.take_events(), BlockRemoved, "CPU") for h in e.block_hashes]) == 2
    _, n = cache.retrieve(tokens)
    assert n == 16
    again = by_type(cache.take_events(), BlockStored, "CPU")
    assert [h for e in again for h in e.block_hashes] == [event_id(h) for h in prefix_hashes(tokens, 8)]
    cache.close()


def test_disabled_events_cost_nothing(tmp_path):
    cfg = build_config({"chunk_size": 8, "l1_size_gb": "1MiB"})
    cache = KVCache(cfg, "m", LAYOUT)
    cache.store(list(range(16)), kv(16))
    assert cache.take_events() == [] and cache.tiers.events is None
    cache.close()


def test_tiers_delete_removes_from_every_tier_with_events(tmp_path):
    """``Tiers.delete`` (the management API's delete): L1 and the L2 adapter lose exactly those chunks, after the
    writes queued before it; BlockRemoved names their blocks for CPU and STORAGE; the other prompt stays."""
    cache = make_cache(tmp_path)
    gone, kept = list(range(24)), list(range(100, 116))
    cache.store(gone, kv(24))
    cache.store(kept, kv(16))
    _, refs = cache.chunk_refs(gone)
    keys = [r.key for r in refs]
    cache.take_events()
    assert cache.tiers.delete(keys) == {"CPU": 3, "local_disk": 3}  # the queued writes landed first, then went
    assert [hits for _, hits in cache.l2.holders(keys)] == [[False] * 3]
    assert cache.lookup(gone) == 0 and cache.lookup(kept) == 16
    events = cache.take_events()
    ids = [event_id(h) for h in prefix_hashes(gone, 8)]
    for medium in ("CPU", "STORAGE"):
        assert sorted(h for e in by_type(events, BlockRemoved, medium) for h in e.block_hashes) == sorted(ids)
    _, kept_refs = cache.chunk_refs(kept)
    assert [hits for _, hits in cache.l2.holders([r.key for r in kept_refs])] == [[True, True]]
    assert cache.tiers.delete(keys) == {"CPU": 0, "local_disk": 0}
    cache.close()
