"""L1Store: reserve/commit/acquire/release, byte budget, pins, eviction, threads, shared memory."""

import multiprocessing
import os
import random
import threading
import uuid

import numpy as np
import pytest

from kvtier.client.dataplane import SharedMapping
from kvtier.errors import ConfigError, InputError
from kvtier.keys import ChunkKey
from kvtier.l1.arena import align_up
from kvtier.l1.store import L1Store

KB = 1024


def key(i: int) -> ChunkKey:
    return ChunkKey("m", "layout", "", i.to_bytes(32, "big"))


def put(store: L1Store, k, data: bytes, meta=None) -> bool:
    view = store.reserve(k, len(data), meta)
    if view is None:
        return False
    view[:] = data
    store.commit(k)
    return True


def test_store_and_read_back_bytes_and_meta():
    store = L1Store(64 * KB)
    assert put(store, key(1), b"x" * 1000, meta={"tokens": 256})
    assert store.contains(key(1)) and store.num_chunks == 1
    view, meta, at = store.acquire(key(1))
    assert bytes(view) == b"x" * 1000 and meta == {"tokens": 256}
    assert store.meta(key(1)) == {"tokens": 256}
    assert store.offset(key(1)) == at
    store.release(key(1), at)
    assert store.used_bytes == align_up(1000)
    assert store.keys() == [key(1)]
    store.close()


def test_reserved_entry_is_invisible_until_commit_and_abort_frees_it():
    store = L1Store(64 * KB)
    view = store.reserve(key(1), 5000)
    assert view is not None and not store.contains(key(1)) and store.acquire(key(1)) is None
    assert store.reserve(key(1), 5000) is None  # already reserved
    assert store.offset(key(1)) is not None  # the shm data plane needs it before commit
    assert store.abort(key(1)) and store.used_bytes == 0
    assert not store.abort(key(1))
    with pytest.raises(InputError):
        store.commit(key(1))
    assert put(store, key(1), b"a" * 10)
    assert store.reserve(key(1), 10) is None  # already present
    with pytest.raises(InputError):
        store.commit(key(1))  # already committed
    with pytest.raises(InputError):
        store.release(key(1), store.offset(key(1)))  # no acquire
    with pytest.raises(InputError):
        store.reserve(key(2), 0)
    with pytest.raises(InputError):
        store.reserve([1, 2], 10)  # unhashable
    assert store.reserve(key(3), 64 * KB + 1) is None  # larger than the budget
    with pytest.raises(ConfigError):
        L1Store(64 * KB, policy="FIFO-ish")
    store.close()


@pytest.mark.parametrize("policy", ["LRU", "ARC", "S3FIFO"])
def test_budget_never_exceeded_and_bytes_survive_eviction(policy):
    rng = random.Random(5)
    store = L1Store(256 * KB, policy=policy)
    evicted: list = []
    store.on_evict = lambda items: evicted.extend(k for k, _ in items)
    expected = {}
    for i in range(400):
        n = rng.randint(1, 40 * KB)
        data = bytes([i % 251]) * n
        assert put(store, key(i), data, meta=n)  # nothing pinned: there is always room
        expected[key(i)] = data
        assert store.used_bytes <= store.capacity_bytes
        if rng.random() < 0.3:  # re-read an older key if still present
            k = key(rng.randrange(i + 1))
            got = store.acquire(k)
            if got is not None:
                assert bytes(got[0]) == expected[k] and got[1] == len(expected[k])
                store.release(k, got[2])
    present = set(store.keys())
    assert present | set(evicted) == set(expected) and not present & set(evicted)
    assert store.num_chunks == len(present)
    for k in present:
        view, _, at = store.acquire(k)
        assert bytes(view) == expected[k]
        store.release(k, at)
    store.close()


def test_lru_evicts_oldest_and_on_evict_reports_exactly_the_evicted():
    store = L1Store(4 * KB)  # room for four 1 KiB chunks
    calls = []
    store.on_evict = lambda items: calls.append(list(items))
    for i in range(4):
        assert put(store, key(i), b"a" * KB, meta=f"m{i}")
    store.touch([key(0)])  # 0 becomes most recently used; 1 is now the oldest
    assert put(store, key(4), b"b" * KB)
    assert calls == [[(key(1), "m1")]]
    assert put(store, key(5), b"c" * (2 * KB))  # needs two slots: 2 and 3 go
    assert calls[1] == [(key(2), "m2"), (key(3), "m3")]
    assert sorted(store.keys(), key=lambda k: k.prefix_hash) == [key(0), key(4), key(5)]
    store.close()


def test_pinned_entries_are_never_evicted():
    store = L1Store(4 * KB)
    for i in range(4):
        assert put(store, key(i), bytes([i]) * KB)
    pinned = store.acquire(key(0))  # oldest, first in line for eviction
    other = store.acquire(key(1))
    for i in range(4, 40):
        assert put(store, key(i), bytes([i]) * KB)
        assert store.contains(key(0)) and store.contains(key(1))
    assert bytes(pinned[0]) == bytes([0]) * KB
    store.release(key(0), pinned[2])
    store.release(key(1), other[2])
    assert put(store, key(99), b"z" * KB) and not store.contains(key(0))  # unpinned: evictable again
    store.close()


def test_full_with_everything_pinned_returns_none_without_evicting():
    store = L1Store(64 * KB)
    for i in range(64):
        assert put(store, key(i), b"p" * KB)
        store.acquire(key(i))
    reservation = store.reserve(key(1000), KB)  # a reserved slot is pinned too
    assert reservation is None
    evicted = []
    store.on_evict = evicted.append
    done = threading.Event()

    def attempt():
        assert store.reserve(key(1001), KB) is None
        done.set()

    worker = threading.Thread(target=attempt)
    worker.start()
    worker.join(timeout=30)
    assert done.is_set(), "reserve waited instead of returning None"
    assert evicted == [] and store.num_chunks == 64
    store.release(key(7), store.offset(key(7)))
    assert put(store, key(1002), b"q" * KB)
    assert not store.contains(key(7))
    store.close()


def test_fragmentation_keeps_evicting_until_a_contiguous_slot_fits():
    store = L1Store(8 * KB)
    for i in range(8):
        assert put(store, key(i), b"f" * KB)
    # pin every other chunk: 4 KiB are evictable but no two evictable slots are adjacent
    for i in (1, 3, 5, 7):
        store.acquire(key(i))
    assert store.reserve(key(100), 2 * KB) is None  # cannot fit anywhere: gave up, did not wait
    assert store.num_chunks == 4  # it evicted every unpinned entry trying
    store.release(key(1), store.offset(key(1)))
    store.release(key(3), store.offset(key(3)))
    evicted = []
    store.on_evict = lambda items: evicted.extend(k for k, _ in items)
    assert store.reserve(key(101), 3 * KB) is not None  # evicting 1 (LRU) joins [0, 3 KiB)
    assert evicted == [key(1)] and store.offset(key(101)) == 0 and store.contains(key(3))
    assert store.used_bytes <= store.capacity_bytes
    store.close()


def test_remove_of_pinned_entry_defers_the_free_to_the_last_release():
    store = L1Store(4 * KB)
    assert put(store, key(1), b"r" * KB)
    view, _, old = store.acquire(key(1))
    store.acquire(key(1))
    assert store.remove(key(1))
    assert not store.contains(key(1)) and store.acquire(key(1)) is None and store.num_chunks == 0
    assert store.used_bytes == KB  # still held: a reader is copying out of it
    assert not store.remove(key(1))
    # the key is free at once (e.g. stored again after a clear while an L2 write still reads the old slot)
    assert put(store, key(1), b"s" * KB) and store.offset(key(1)) != old and store.used_bytes == 2 * KB
    new = store.acquire(key(1))
    store.release(key(1), old)  # the old slot's pins and the new one's are kept apart
    assert store.used_bytes == 2 * KB and bytes(view) == b"r" * KB and bytes(new[0]) == b"s" * KB
    store.release(key(1), old)
    assert store.used_bytes == KB and bytes(new[0]) == b"s" * KB
    with pytest.raises(InputError):
        store.release(key(1), old)  # freed: no pin left there
    store.release(key(1), new[2])
    assert store.contains(key(1)) and store._entries[key(1)].pins == 0
    store.close()


def test_clear_returns_committed_keys_and_keeps_reservations():
    store = L1Store(16 * KB)
    for i in range(3):
        assert put(store, key(i), b"c" * KB)
    pending = store.reserve(key(9), KB)
    assert sorted(store.clear(), key=lambda k: k.prefix_hash) == [key(0), key(1), key(2)]
    assert store.num_chunks == 0 and store.used_bytes == KB
    pending[:] = b"d" * KB
    store.commit(key(9))
    assert store.keys() == [key(9)]
    store.close()


@pytest.mark.timeout(60)
def test_on_evict_runs_without_the_lock_and_its_errors_do_not_fail_reserve():
    store = L1Store(2 * KB)
    seen = []

    def callback(items):
        seen.append((items, store.num_chunks))  # re-enters the store: deadlocks if the lock were held
        raise RuntimeError("callback bug")

    store.on_evict = callback
    assert put(store, key(0), b"a" * KB) and put(store, key(1), b"b" * KB)
    assert put(store, key(2), b"c" * KB)
    assert seen == [([(key(0), None)], 1)]
    store.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["LRU", "ARC", "S3FIFO"])
def test_threads_reserve_commit_acquire_release(policy):
    store = L1Store(64 * KB, policy=policy)
    errors = []

    def worker(tid: int):
        rng = random.Random(tid)
        try:
            for i in range(600):
                k = key(rng.randrange(120))
                fill = k.prefix_hash[-1]
                size = 1024 + fill * 16
                if rng.random() < 0.5:
                    view = store.reserve(k, size, meta=size)
                    if view is not None:
                        view[:] = bytes([fill]) * size
                        store.commit(k)
                else:
                    got = store.acquire(k)
                    if got is not None:
                        view, meta, at = got
                        assert meta == size and bytes(view) == bytes([fill]) * size, "torn read"
                        store.release(k, at)
                assert store.used_bytes <= store.capacity_bytes
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in store.keys():  # no pins leaked: every committed entry can be evicted now
        assert store._entries[k].pins == 0
    assert store.reserve(key(10_000), 64 * KB) is not None
    assert store.num_chunks == 0
    store.close()


def _child_read_and_write(shm_name: str, capacity: int, offset: int, nbytes: int, queue) -> None:
    arena = SharedMapping(shm_name, capacity)
    data = np.frombuffer(arena.view(offset, nbytes), dtype=np.float32).copy()
    arena.view(offset, nbytes)[:] = (data * 2).tobytes()
    queue.put(float(data.sum()))
    arena.close()


def test_shared_memory_store_is_readable_and_writable_from_another_process():
    name = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    store = L1Store(1 << 20, shm_name=name)
    try:
        values = np.arange(1024, dtype=np.float32)
        assert put(store, key(1), values.tobytes())
        view, _, at = store.acquire(key(1))  # pinned while the other process works on it
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_child_read_and_write,
                            args=(name, store.capacity_bytes, store.offset(key(1)), values.nbytes, queue))
        child.start()
        total = queue.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0
        assert total == float(values.sum())
        assert np.array_equal(np.frombuffer(view, dtype=np.float32), values * 2)
        store.release(key(1), at)
    finally:
        store.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_quarantined_slot_leaves_the_key_space_but_is_never_reused_until_freed():
    store = L1Store(2 * KB)
    view = store.reserve(key(1), KB)
    token = store.quarantine(key(1))
    assert token is not None and store.quarantined_bytes == KB
    assert not store.contains(key(1)) and store.offset(key(1)) is None
    assert put(store, key(1), b"a" * KB)  # the same key, stored again: in the other slot
    view[:] = b"z" * KB  # a late writer changes only its quarantined slot
    got, _, at = store.acquire(key(1))
    assert bytes(got) == b"a" * KB
    assert store.reserve(key(2), KB) is None  # the quarantined slot is not handed out, even under pressure
    store.release(key(1), at)
    assert store.free_quarantined(token) and not store.free_quarantined(token)
    assert store.quarantined_bytes == 0
    assert put(store, key(2), b"b" * KB)
    assert store.quarantine(key(2)) is None  # committed: nothing to quarantine
