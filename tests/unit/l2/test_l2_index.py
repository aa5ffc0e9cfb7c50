"""L2 lookups from the adapters' in-memory indexes: no adapter I/O on a lookup, background probes for records
another writer stored, and asynchronous clears. Real local_disk adapters; the fault-injecting wrapper makes
the adapter's I/O hang, so a lookup that touched it would never return."""

from __future__ import annotations

import threading

import torch

from kvtier.cache import KVCache, Tiers
from kvtier.config import build_config
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)
CHUNK = 16
HANG_SECONDS = 3600.0


def cache_over(spec: dict, index_lookups: bool = True) -> KVCache:
    """A cache whose tiers answer L2 lookups as the server's do (``index_lookups``)."""
    config = build_config({"chunk_size": CHUNK, "l1_size_gb": "16MiB", "l2_adapters": [spec]})
    return KVCache(config, "m", LAYOUT, tiers=Tiers(config, publish_events=False, index_lookups=index_lookups))


def disk(path) -> dict:
    return {"type": "local_disk", "path": str(path)}


def tokens_and_kv(seed: int, chunks: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (chunks * CHUNK,), generator=g).tolist()
    return tokens, torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=g)


def test_lookup_does_no_adapter_io(tmp_path):
    spec = {"type": "faulty", "inner": disk(tmp_path / "l2"), "latency_seconds": HANG_SECONDS, "ops": ["contains", "get"]}
    tokens, kv = tokens_and_kv(1, 3)
    cache = cache_over(spec)
    assert cache.store(tokens, kv) == 3 and cache.flush(30)  # put is not delayed
    cache.tiers.l1.clear()
    assert cache.lookup(tokens) == 3 * CHUNK  # every contains and get would hang: the index answered
    other, _ = tokens_and_kv(2, 2)
    assert cache.lookup(other) == 0  # a miss past the index is probed in the background, not here
    cache.l2.index.close()


def test_a_record_another_writer_stored_is_found_by_a_later_lookup(tmp_path):
    tokens, kv = tokens_and_kv(3, 2)
    writer, reader = cache_over(disk(tmp_path / "shared")), cache_over(disk(tmp_path / "shared"))
    assert writer.store(tokens, kv) == 2 and writer.flush(30)
    assert reader.lookup(tokens) == 0  # not in the reader's index yet: probed in the background
    found = threading.Event()
    for _ in range(600):
        if reader.lookup(tokens) == len(tokens):
            found.set()
            break
        found.wait(0.05)
    assert found.is_set()
    out, n = reader.retrieve(tokens)
    assert n == len(tokens) and torch.equal(out, kv)
    in_process = cache_over(disk(tmp_path / "shared"), index_lookups=False)
    more, more_kv = tokens_and_kv(5, 1)
    assert writer.store(tokens + more, torch.cat([kv, more_kv], dim=2)) == 1 and writer.flush(30)
    assert in_process.lookup(tokens + more) == len(tokens) + CHUNK  # in process: the adapter is asked at once
    for cache in (writer, reader, in_process):
        cache.tiers.close()


def test_clear_async_hides_l2_until_done(tmp_path):
    spec = {"type": "faulty", "inner": disk(tmp_path / "l2"), "latency_seconds": HANG_SECONDS, "ops": ["put"]}
    tokens, kv = tokens_and_kv(4, 2)
    cache = cache_over(spec)
    assert cache.store(tokens, kv) == 2  # the write hangs in the writer thread
    cache.tiers.clear(None, wait=False)  # returns although the clear queues behind that write
    assert cache.lookup(tokens) == 0 and cache.l2.read([], []) == []
    assert cache.flush(0.2) is False  # flush waits for the clear too
