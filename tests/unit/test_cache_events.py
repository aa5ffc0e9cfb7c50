"""Events emitted by the cache itself: every tier, removals, clears, engine-aligned hashes."""

import torch

from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.hashing import event_id, prefix_hashes
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
    """event_block_size = the engine's block size: published hashes equal vLLM's (§2.4 vectors)."""
    cache = make_cache(tmp_path, hash_seed="0", kv_events={"event_block_size": 4}, l2_adapters=[])
    cache.store([1, 2, 3, 4, 5, 6, 7, 8], kv(8))
    (event,) = by_type(cache.take_events(), BlockStored, "CPU")
    assert event.block_hashes == [2164874634404590027, 17270480062156288726]
    assert event.block_size == 4
    cache.close()


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
