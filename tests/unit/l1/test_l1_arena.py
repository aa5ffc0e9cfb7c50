"""Arena: first-fit allocator with coalescing, lazy memory, and /dev/shm sharing across processes (the client side
maps it with ``kvtier.client.dataplane.SharedMapping``)."""

import gc
import os
import random
import subprocess
import sys
import uuid

import psutil
import pytest

from kvtier.client.dataplane import SharedMapping
from kvtier.errors import ConfigError, InputError, KVTierError
from kvtier.l1.arena import ALIGN_BYTES, Arena, VirtualArena, align_up


def _check_invariants(arena: Arena, live: dict[int, int]) -> None:
    """Allocated blocks are aligned, disjoint, and with the free blocks tile the arena exactly."""
    blocks = sorted([(off, align_up(n), "used") for off, n in live.items()]
                    + [(off, size, "free") for off, size in arena.free_blocks()])
    pos = 0
    for off, size, kind in blocks:
        assert off % ALIGN_BYTES == 0
        assert off == pos, f"gap or overlap at {pos}: next block ({kind}) starts at {off}"
        pos = off + size
    assert pos == arena.capacity_bytes // ALIGN_BYTES * ALIGN_BYTES
    frees = arena.free_blocks()
    for (a, sa), (b, _) in zip(frees, frees[1:]):
        assert a + sa < b, "two adjacent free blocks were not coalesced"
    assert arena.used_bytes == sum(align_up(n) for n in live.values())


def test_random_alloc_free_no_overlap_and_full_coalescing():
    rng = random.Random(1234)
    capacity = 1 << 20
    arena = Arena(capacity)
    live: dict[int, int] = {}
    failures = 0
    for step in range(4000):
        if live and (rng.random() < 0.45 or len(live) > 200):
            off = rng.choice(list(live))
            arena.free(off)
            del live[off]
        else:
            n = rng.randint(1, 40_000)
            off = arena.alloc(n)
            if off is None:
                failures += 1
                assert arena.largest_free_bytes() < align_up(n)
                continue
            assert off not in live
            live[off] = n
        if step % 50 == 0:
            _check_invariants(arena, live)
    assert failures > 0 or len(live) > 0
    for off in list(live):
        arena.free(off)
        del live[off]
    assert arena.free_blocks() == [(0, capacity)]
    assert arena.used_bytes == 0
    arena.close()


def test_bytes_written_in_one_block_do_not_leak_into_others():
    arena = Arena(64 * 1024)
    offsets = [arena.alloc(1000) for _ in range(20)]
    for i, off in enumerate(offsets):
        arena.view(off, 1000)[:] = bytes([i]) * 1000
    for i, off in enumerate(offsets):
        assert bytes(arena.view(off, 1000)) == bytes([i]) * 1000
    arena.close()


def test_first_fit_reuses_lowest_hole_and_merges_both_neighbours():
    arena = Arena(64 * 10)
    a, b, c, d = (arena.alloc(64) for _ in range(4))
    assert (a, b, c, d) == (0, 64, 128, 192)
    arena.free(b)
    assert arena.alloc(10) == b  # first fit: the hole at 64 comes before the tail
    arena.free(b)
    arena.free(a)
    assert arena.free_blocks()[0] == (0, 128)
    assert arena.free(c) == 64 * 3  # merged with the preceding hole
    assert arena.free(d) == 640  # merged with both sides: one block again
    assert arena.free_blocks() == [(0, 640)]


def test_alloc_larger_than_free_returns_none_and_bad_input_raises():
    arena = Arena(4096)
    assert arena.alloc(4097) is None
    off = arena.alloc(4096)
    assert off == 0 and arena.alloc(1) is None
    with pytest.raises(InputError):
        arena.alloc(0)
    with pytest.raises(InputError):
        arena.free(64)
    arena.free(off)
    with pytest.raises(InputError):
        arena.free(off)  # double free
    with pytest.raises(InputError):
        arena.view(4000, 200)
    with pytest.raises(ConfigError):
        Arena(10)
    arena.close()
    with pytest.raises(KVTierError):
        arena.alloc(64)


def test_memory_is_touched_lazily():
    proc = psutil.Process()
    before = proc.memory_info().rss
    arena = Arena(2 << 30)  # 2 GiB of address space
    assert proc.memory_info().rss - before < 64 << 20
    off = arena.alloc(16 << 20)
    arena.view(off, 16 << 20)[:] = b"\x01" * (16 << 20)
    grown = proc.memory_info().rss - before
    assert 16 << 20 <= grown < 256 << 20
    arena.close()


@pytest.fixture
def shm_name():
    name = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


_CHILD = r"""
import sys
from kvtier.client.dataplane import SharedMapping
name, cap, off, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
a = SharedMapping(name, cap)
seen = bytes(a.view(off, n))
assert seen == bytes(range(256)) * (n // 256), "child saw wrong bytes"
a.view(off, n)[:] = bytes(reversed(seen))
a.close()
print("child-ok")
"""


def test_shm_attach_from_second_process(shm_name):
    cap = 1 << 20
    arena = Arena(cap, shm_name=shm_name)
    assert os.path.exists(f"/dev/shm/{shm_name}")
    off = arena.alloc(4096)
    payload = bytes(range(256)) * 16
    arena.view(off, 4096)[:] = payload
    out = subprocess.run([sys.executable, "-c", _CHILD, shm_name, str(cap), str(off), "4096"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "child-ok" in out.stdout
    assert bytes(arena.view(off, 4096)) == bytes(reversed(payload))  # the child's write is visible here
    arena.close()
    arena.unlink()
    assert not os.path.exists(f"/dev/shm/{shm_name}")


def test_shm_create_refuses_existing_and_attach_checks(shm_name):
    arena = Arena(1 << 16, shm_name=shm_name)
    with pytest.raises(ConfigError, match="already exists"):
        Arena(1 << 16, shm_name=shm_name)
    with pytest.raises(ConfigError, match="fewer"):
        SharedMapping(shm_name, 1 << 20)
    attached = SharedMapping(shm_name, 1 << 16)
    with pytest.raises(InputError, match="outside"):
        attached.view((1 << 16) - 8, 64)
    attached.close()
    attached.close()  # idempotent
    with pytest.raises(KVTierError, match="closed"):
        attached.view(0, 8)
    with pytest.raises(ConfigError, match="positive int"):
        SharedMapping(shm_name, 0)
    with pytest.raises(ConfigError, match="invalid shm_name"):
        SharedMapping("../etc/passwd", 4096)
    assert os.path.exists(f"/dev/shm/{shm_name}")  # closing a mapping never removes the server's file
    replaced = Arena(1 << 16, shm_name=shm_name, replace=True)  # stale file from a "crashed" server
    arena.close()
    arena.unlink()  # the old creator must not remove the file that replaced its own
    assert os.path.exists(f"/dev/shm/{shm_name}")
    replaced.close()
    del replaced
    gc.collect()  # a creator dropped without unlink() still removes its file
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    with pytest.raises(ConfigError, match="does not exist"):
        SharedMapping(shm_name, 1 << 16)
    with pytest.raises(ConfigError, match="invalid shm_name"):
        Arena(4096, shm_name="../etc/passwd")


def test_a_virtual_arena_allocates_as_a_real_one_without_memory():
    real, virtual = Arena(64 * 100), VirtualArena(64 * 100)
    for arena in (real, virtual):
        a, b, c = arena.alloc(100), arena.alloc(64), arena.alloc(1000)
        arena.free(b)
        assert (a, b, c) == (0, 128, 192) and arena.alloc(1) == 128  # first fit into the hole
        assert arena.alloc(64 * 100) is None
        arena.free(a)
        assert arena.free_blocks() == [(0, 128), (1216, 64 * 100 - 1216)]
    real.close()
    huge = VirtualArena(10**15)  # a petabyte: only offsets
    assert huge.alloc(10**14) == 0 and huge.used_bytes == 10**14
    assert huge.view(0, 10**14).nbytes == 0  # nothing behind it
