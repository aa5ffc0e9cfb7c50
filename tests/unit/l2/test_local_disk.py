"""Local-disk adapter specifics (the shared behaviour is in tests/contract/l2/)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from kvtier.errors import ConfigError, InputError, StorageError
from kvtier.foreground import BACKGROUND_NICENESS
from kvtier.hashing import prefix_hashes
from kvtier.keys import ChunkKey
from kvtier.l2 import create_adapter
from kvtier.l2 import local_disk
from kvtier.l2.faulty import FaultyAdapter
from kvtier.l2.local_disk import LocalDiskAdapter
from kvtier.layout import KVLayout
from kvtier.record import decode_record, encode_record, record_size

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16)  # 512 bytes per token in fp32


def record(seed: int, num_tokens: int = 8, layout: KVLayout = LAYOUT):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1000, 50_000, num_tokens).tolist()
    key = ChunkKey("test-model", layout.layout_id, "", prefix_hashes(tokens, num_tokens)[0])
    payload = rng.bytes(layout.chunk_bytes(num_tokens))
    return key, tokens, encode_record(key, layout, tokens, payload), payload


def check(buf, key, tokens, payload) -> None:
    assert buf is not None
    _, got = decode_record(buf, key=key, token_ids=tokens)
    assert bytes(got) == payload


def disk(path, **fields) -> LocalDiskAdapter:
    return create_adapter({"type": "local_disk", "path": str(path), **fields})


@contextlib.contextmanager
def mounted(target, fstype: str, options: str | None = None):
    target.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(target)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("the mount command is not installed")
    if proc.returncode != 0:
        pytest.skip(f"mounting a {fstype} needs root with CAP_SYS_ADMIN: {proc.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_temp_file_is_never_visible(tmp_path, monkeypatch):
    writer, other = disk(tmp_path), disk(tmp_path)
    key, tokens, parts, payload = record(1)
    seen = {}
    real_replace = os.replace

    def observe_then_replace(src, dst):
        # the moment before publication: the data is complete in the temp file, the name is absent
        seen["temp_bytes"] = os.path.getsize(src)
        seen["temp_name"] = os.path.basename(src)
        seen["visible"] = (other.contains([key.name()]), other.get([key.name()]), other.list_names())
        real_replace(src, dst)

    monkeypatch.setattr(local_disk.os, "replace", observe_then_replace)
    assert writer.put([(key.name(), parts)]) == [True]
    monkeypatch.undo()
    assert seen["temp_bytes"] == record_size(parts)
    assert seen["temp_name"].startswith(f".{key.name()}.") and seen["temp_name"].endswith(".tmp")
    assert seen["visible"] == ([False], [None], [])
    check(other.get([key.name()])[0], key, tokens, payload)
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_startup_deletes_stale_temp_files_and_ignores_foreign_files(tmp_path):
    adapter = disk(tmp_path)
    key, tokens, parts, payload = record(2)
    adapter.put([(key.name(), parts)])
    shard = tmp_path / key.name().split("-")[1][:2]
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = adapter._host
    crashed = shard / f".{key.name()}.{host}.{dead.pid}.0.tmp"  # writer process gone
    old = shard / f".{key.name()}.0badc0de.1.0.tmp"  # another host, hours old
    live = shard / f".{key.name()}.{host}.{os.getpid()}.7.tmp"  # a write in flight in this process
    for path in (crashed, old, live):
        path.write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    foreign = [tmp_path / "README", tmp_path / "0123456789abcdef-XYZ", shard / "notes.txt"]
    for path in foreign:
        path.write_bytes(b"not a record")

    restarted = disk(tmp_path)
    assert restarted.list_names() == [key.name()]
    assert restarted.usage().used_bytes == record_size(parts)
    assert not crashed.exists() and not old.exists()
    assert live.exists()
    assert all(p.exists() for p in foreign)
    check(restarted.get([key.name()])[0], key, tokens, payload)


def test_restart_rebuilds_index_in_mtime_order(tmp_path):
    adapter = disk(tmp_path)
    recs = [record(i) for i in range(4)]
    adapter.put([(k.name(), parts) for k, _, parts, _ in recs])
    size = record_size(recs[0][2])
    for age, (key, *_rest) in zip([400, 100, 300, 200], recs):  # recs[0] is the oldest
        path = adapter._path(key.name())
        os.utime(path, (time.time() - age, time.time() - age))
    adapter.close()

    restarted = disk(tmp_path, size_gb=f"{3 * size + 10}B")  # smaller capacity: evicts at startup
    names = restarted.list_names()
    assert recs[0][0].name() not in names and len(names) == 3
    evicted = []
    restarted.on_evict = evicted.extend
    restarted.put([(record(9)[0].name(), record(9)[2])])
    assert evicted == [recs[2][0].name()]  # next oldest by mtime
    assert restarted.usage().used_bytes <= 3 * size + 10


def test_file_deleted_by_hand_is_a_miss(tmp_path):
    adapter = disk(tmp_path)
    key, tokens, parts, payload = record(3)
    adapter.put([(key.name(), parts)])
    os.unlink(adapter._path(key.name()))
    assert adapter.contains([key.name()]) == [True]  # the index has not noticed yet
    assert adapter.get([key.name()]) == [None]
    assert adapter.contains([key.name()]) == [False]
    assert adapter.usage().used_bytes == 0
    assert adapter.put([(key.name(), parts)]) == [True]
    check(adapter.get([key.name()])[0], key, tokens, payload)


def test_records_written_by_another_adapter_on_the_same_directory_are_hits(tmp_path):
    reader, writer = disk(tmp_path), disk(tmp_path)  # reader's index is built before the write
    key, tokens, parts, payload = record(4)
    writer.put([(key.name(), parts)])
    assert reader.contains([key.name()]) == [True]
    check(reader.get([key.name()])[0], key, tokens, payload)
    assert reader.usage().num_records == 1


def test_unwritable_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="a-file/kv.*not usable.*create and write"):
        disk(blocker / "kv")
    with mounted(tmp_path / "ro", "tmpfs", "ro,size=1m") as ro:
        with pytest.raises(ConfigError, match="ro/kv"):
            disk(ro / "kv")


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_sharded_layout(tmp_path, depth):
    adapter = disk(tmp_path, shard_depth=depth)
    key, tokens, parts, payload = record(5)
    adapter.put([(key.name(), parts)])
    digest = key.name().split("-")[1]
    expected = tmp_path.joinpath(*[digest[2 * i:2 * i + 2] for i in range(depth)], key.name())
    assert expected.is_file() and expected.stat().st_size == record_size(parts)
    assert disk(tmp_path, shard_depth=depth).list_names() == [key.name()]


def test_other_shard_depth_is_ignored_with_a_warning(tmp_path, caplog):
    key, _, parts, _ = record(6)
    disk(tmp_path, shard_depth=2).put([(key.name(), parts)])
    with caplog.at_level(logging.WARNING, logger="kvtier.l2.local_disk"):
        assert disk(tmp_path, shard_depth=1).list_names() == []
    assert "another shard_depth" in caplog.text


def test_names_that_are_not_chunk_names_are_refused(tmp_path):
    adapter = disk(tmp_path)
    _, _, parts, _ = record(7)
    for bad in ["../../etc/passwd", "0123456789abcdef-../x", "0123456789abcdef-ab/cd12345678", "", "x" * 20]:
        with pytest.raises(InputError, match="ChunkKey.name"):
            adapter.put([(bad, parts)])
        with pytest.raises(InputError):
            adapter.get([bad])
    assert list(tmp_path.rglob("*")) == [] or all(p.is_dir() for p in tmp_path.rglob("*"))


def test_direct_io_on_a_file_system_that_supports_it(tmp_path):
    adapter = disk(tmp_path, direct_io=True)
    assert adapter._direct, "ext4 accepts O_DIRECT"
    for num_tokens in (1, 7, 8, 9, 1000):  # record sizes around and off the 4 KiB alignment
        key, tokens, parts, payload = record(num_tokens, num_tokens)
        assert adapter.put([(key.name(), parts)]) == [True]
        assert os.path.getsize(adapter._path(key.name())) == record_size(parts)  # padding truncated
        check(adapter.get([key.name()])[0], key, tokens, payload)


def test_direct_io_falls_back_with_one_warning_where_refused(tmp_path, caplog):
    # ramfs has no O_DIRECT (recent kernels accept it on tmpfs, so /dev/shm is not a reliable refuser)
    with mounted(tmp_path / "ramfs", "ramfs") as root:
        with caplog.at_level(logging.WARNING, logger="kvtier.l2.local_disk"):
            adapter = disk(root / "kv", direct_io=True)
            recs = [record(i) for i in range(3)]
            assert adapter.put([(k.name(), parts) for k, _, parts, _ in recs]) == [True] * 3
            for buf, (key, tokens, _, payload) in zip(adapter.get([r[0].name() for r in recs]), recs):
                check(buf, key, tokens, payload)
        adapter.close()
    warnings = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1 and not adapter._direct


def test_disk_full_drops_writes_and_keeps_reads(tmp_path, caplog):
    big = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64)  # 8 KiB per token
    with mounted(tmp_path / "small", "tmpfs", "size=2m") as root:
        adapter = disk(root / "kv", num_threads=1)
        recs = [record(i, 64, big) for i in range(6)]  # 512 KiB each: the fourth cannot fit
        with caplog.at_level(logging.WARNING, logger="kvtier.l2.local_disk"):
            results = [adapter.put([(k.name(), parts)])[0] for k, _, parts, _ in recs]
        assert results[0] and not results[-1]
        stored = [r for r, ok in zip(recs, results) if ok]
        assert adapter.usage().used_bytes == sum(record_size(r[2]) for r in stored)
        for key, tokens, _, payload in stored:
            check(adapter.get([key.name()])[0], key, tokens, payload)
        assert not list(root.rglob("*.tmp")), "a failed write must not leave its temp file"
        assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
        adapter.close()


def test_capacity_from_a_size_string(tmp_path):
    adapter = disk(tmp_path, size_gb="3KiB")
    assert adapter.usage().capacity_bytes == 3072
    evicted = []
    adapter.on_evict = evicted.extend
    recs = [record(i, 1) for i in range(6)]  # ~620 bytes each
    for key, _, parts, _ in recs:
        assert adapter.put([(key.name(), parts)]) == [True]
    assert adapter.usage().used_bytes <= 3072
    assert evicted and evicted == [r[0].name() for r in recs[:len(evicted)]]
    assert not any(os.path.exists(adapter._path(n)) for n in evicted)


def test_parallel_batch_round_trip(tmp_path):
    adapter = disk(tmp_path, num_threads=4, direct_io=True)
    recs = [record(i, 300) for i in range(12)]
    assert adapter.put([(k.name(), parts) for k, _, parts, _ in recs]) == [True] * 12
    names = [r[0].name() for r in reversed(recs)]
    for buf, (key, tokens, _, payload) in zip(adapter.get(names), reversed(recs)):
        check(buf, key, tokens, payload)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread priority here")
def test_parallel_writes_run_at_a_lower_priority_than_reads(tmp_path, monkeypatch):
    adapter = disk(tmp_path, num_threads=2)
    seen = {"put": set(), "get": set()}

    def priority():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    put_one, get_one = adapter._put_one, adapter._get_one
    monkeypatch.setattr(adapter, "_put_one", lambda *a: (seen["put"].add(priority()), put_one(*a))[1])
    monkeypatch.setattr(adapter, "_get_one", lambda *a: (seen["get"].add(priority()), get_one(*a))[1])
    recs = [record(i) for i in range(4)]
    assert adapter.put([(k.name(), parts) for k, _, parts, _ in recs]) == [True] * 4
    assert all(buf is not None for buf in adapter.get([k.name() for k, *_ in recs]))
    mine = priority()
    assert seen["get"] == {mine}  # a retrieve waits for reads: they keep the caller's priority
    assert seen["put"] == {min(19, mine + BACKGROUND_NICENESS)}  # writes yield the cores to requests


def test_directory_removed_under_the_adapter_is_a_storage_error(tmp_path):
    adapter = disk(tmp_path / "kv")
    shutil.rmtree(tmp_path / "kv")
    key, _, parts, _ = record(8)
    with pytest.raises(StorageError, match="whole directory"):
        adapter.put([(key.name(), parts)])
    assert adapter.health()[0] is False
    assert not (tmp_path / "kv").exists(), "the adapter must not recreate a vanished root"


def test_aliases_and_config_errors(tmp_path):
    cases = {"POSIX": (False, 4), "HF3FS": (False, 4), "GDS": (True, 4), "GDS_MT": (True, 8)}
    for alias, (direct, threads) in cases.items():
        adapter = create_adapter({"type": alias, "path": str(tmp_path / alias)})
        assert isinstance(adapter, LocalDiskAdapter)
        assert (adapter.config.direct_io, adapter.config.num_threads) == (direct, threads)
        adapter.close()
    with pytest.raises(ConfigError, match="did you mean 'shard_depth'"):
        disk(tmp_path, shard_dept=2)
    with pytest.raises(ConfigError, match="size_gb"):
        disk(tmp_path, size_gb="-1GB")
    with pytest.raises(ConfigError, match="missing required field 'path'"):
        create_adapter({"type": "local_disk"})


def test_faulty_spec_over_local_disk_forwards_evictions(tmp_path):
    key, tokens, parts, payload = record(1)
    size = record_size(parts)
    faulty = create_adapter({"type": "faulty", "seed": 3, "error_rate": 1.0, "ops": ["get"],
                             "inner": {"type": "local_disk", "path": str(tmp_path), "size_gb": f"{size}B"}})
    evicted = []
    faulty.on_evict = evicted.extend
    assert faulty.put([(key.name(), parts)]) == [True]
    with pytest.raises(StorageError):
        faulty.get([key.name()])
    other = record(2)
    assert faulty.put([(other[0].name(), other[2])]) == [True]
    assert evicted == [key.name()]
    assert faulty.root == str(tmp_path)  # other attributes come from the inner adapter
    check(faulty.inner.get([other[0].name()])[0], *other[:2], other[3])


def test_faulty_latency_applies_to_selected_ops(tmp_path):
    # a lower bound only: sleeping guarantees it, so this cannot flake on a slow machine
    faulty = FaultyAdapter.wrap(disk(tmp_path), latency_seconds=0.03, ops=["contains"])
    start = time.monotonic()
    assert faulty.contains(["0123456789abcdef-0123456789abcdef"]) == [False]
    assert time.monotonic() - start >= 0.03


def test_records_and_folders_are_private_and_older_ones_are_tightened(tmp_path):
    root = tmp_path / "l2"
    adapter = disk(root)
    key, tokens, parts, payload = record(1)
    assert adapter.put([(key.name(), parts)]) == [True]
    path = adapter._path(key.name())
    shard = os.path.dirname(path)

    def modes():
        return [os.stat(p).st_mode & 0o777 for p in (path, shard, root)]

    assert modes() == [0o600, 0o700, 0o700]
    adapter.close()
    for p, mode in ((path, 0o644), (shard, 0o755), (root, 0o755)):  # as kvtier left them before
        os.chmod(p, mode)
    reopened = disk(root)
    assert modes() == [0o600, 0o700, 0o700]
    check(reopened.get([key.name()])[0], key, tokens, payload)
    reopened.close()
