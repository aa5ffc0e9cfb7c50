"""Local-disk L2 write (with fsync) + read of SmolLM2-sized records versus plain Python file I/O.

Records: SmolLM2-135M KV for one 256-token chunk in fp32 (30 layers x 2 x 256 x 3 KV heads x 64 =
11.25 MiB payload) encoded with ``record.encode_record``. Baseline, on the same bytes and with the
same number of threads: ``open(tmp, "wb")`` + ``write`` + ``fsync`` + ``os.replace`` per record, and
``open(path, "rb").read()``. kvtier also fsyncs the directory after each rename (so a stored record
survives a crash); the last two columns compare against a plain baseline that does the same.
Between the write and the read phase the page cache is dropped when this process may
(``/proc/sys/vm/drop_caches``); otherwise both sides read from the page cache, which is printed.
Each cell is the best of ``--repeat`` alternating runs. GB = 10**9 bytes.

    .venv/bin/python benchmarks/bench_local_disk.py [--records 16] [--threads 4] [--repeat 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.hashing import prefix_hashes
from kvtier.keys import ChunkKey
from kvtier.l2.local_disk import LocalDiskAdapter, LocalDiskConfig
from kvtier.layout import KVLayout
from kvtier.record import decode_record, encode_record, record_size

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M-Instruct
CHUNK_TOKENS = 256


def make_records(n: int) -> list[tuple[str, list]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, 49_152, CHUNK_TOKENS).tolist()
        key = ChunkKey("HuggingFaceTB/SmolLM2-135M-Instruct", LAYOUT.layout_id, "", prefix_hashes(tokens, CHUNK_TOKENS)[0])
        out.append((key.name(), encode_record(key, LAYOUT, tokens, rng.bytes(LAYOUT.chunk_bytes(CHUNK_TOKENS)))))
    return out


def drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def plain_write(directory: str, name: str, parts: list, dir_fsync: bool = False) -> None:
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for p in parts:
            f.write(p)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if dir_fsync:  # makes the rename itself durable, as kvtier does
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def plain_read(directory: str, name: str) -> bytes:
    with open(os.path.join(directory, name), "rb") as f:
        return f.read()


def run_plain(root: str, records, threads: int, drop: bool, dir_fsync: bool = False) -> tuple[float, float]:
    directory = tempfile.mkdtemp(dir=root)
    try:
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(lambda r: plain_write(directory, *r, dir_fsync), records))
            write_seconds = time.perf_counter() - start
            if drop:
                drop_page_cache()
            start = time.perf_counter()
            got = list(pool.map(lambda r: plain_read(directory, r[0]), records))
            read_seconds = time.perf_counter() - start
        assert all(len(g) == record_size(p) for g, (_, p) in zip(got, records))
        return write_seconds, read_seconds
    finally:
        shutil.rmtree(directory)


def run_kvtier(root: str, records, threads: int, direct_io: bool, drop: bool) -> tuple[float, float]:
    directory = tempfile.mkdtemp(dir=root)
    adapter = LocalDiskAdapter(LocalDiskConfig(type="local_disk", path=directory, num_threads=threads,
                                               direct_io=direct_io))
    try:
        start = time.perf_counter()
        ok = adapter.put(records)
        write_seconds = time.perf_counter() - start
        assert all(ok)
        if drop:
            drop_page_cache()
        start = time.perf_counter()
        got = adapter.get([name for name, _ in records])
        read_seconds = time.perf_counter() - start
        decode_record(got[0])  # the bytes are a whole record (checksum verified), not just the right length
        assert all(memoryview(g).nbytes == record_size(p) for g, (_, p) in zip(got, records))
        return write_seconds, read_seconds
    finally:
        adapter.close()
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=16, help="records per run (11.25 MiB each)")
    parser.add_argument("--threads", type=int, default=4, help="N for the N-thread rows")
    parser.add_argument("--repeat", type=int, default=5, help="alternating runs per cell; the best is kept")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    args = parser.parse_args()

    records = make_records(args.records)
    total = sum(record_size(p) for _, p in records)
    drop = drop_page_cache()
    print(f"{args.records} records x {record_size(records[0][1]) / 2**20:.2f} MiB = {total / 1e9:.3f} GB in {args.dir}; "
          + ("page cache dropped before each read phase" if drop else
             "page cache NOT dropped (no permission): buffered reads on both sides come from the page cache"))
    print(f"{'mode':<10} {'threads':>7} {'op':<6} {'plain GB/s':>10} {'kvtier GB/s':>11} {'ratio':>6}   "
          f"{'plain+dir-fsync GB/s':>20} {'ratio':>6}")
    for threads in (1, args.threads):
        runs = {"plain": lambda: run_plain(args.dir, records, threads, drop),
                "plain_dir_fsync": lambda: run_plain(args.dir, records, threads, drop, dir_fsync=True),
                "buffered": lambda: run_kvtier(args.dir, records, threads, False, drop),
                "direct_io": lambda: run_kvtier(args.dir, records, threads, True, drop)}
        best = {name: [float("inf")] * 2 for name in runs}
        for _ in range(args.repeat):  # alternate, so drift on a shared machine hits every side alike
            for name, run in runs.items():
                best[name] = [min(a, b) for a, b in zip(best[name], run())]
        plain, durable = best["plain"], best["plain_dir_fsync"]
        for mode in ("buffered", "direct_io"):
            kv = best[mode]
            for op, i in (("write", 0), ("read", 1), ("both", None)):
                factor, p, d, k = (2, sum(plain), sum(durable), sum(kv)) if i is None else (1, plain[i], durable[i], kv[i])
                print(f"{mode:<10} {threads:>7} {op:<6} {factor * total / p / 1e9:>10.2f} {factor * total / k / 1e9:>11.2f} "
                      f"{p / k:>5.2f}x   {factor * total / d / 1e9:>20.2f} {d / k:>5.2f}x")

if __name__ == "__main__":
    main()
