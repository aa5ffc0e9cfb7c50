"""Attach benchmark: a copying client's start-up time and committed memory against the server's L1 size.

For each ``--l1-gb`` value a ``kvtier server`` subprocess (shared memory) is started; then, ``--repeats`` times,
a fresh Python process attaches as an engine worker does (``Client(..., prefault=True)``), stores and retrieves
one ``--chunks``-chunk prompt through the shared L1, and reports:

* attach time: the ``Client`` constructor (connect, handshake, map the arena), median over repeats;
* RSS after the store and retrieve (VmRSS of the client process, which counts the shared pages it touched),
  minus the RSS before the constructor, median over repeats.

The ratios largest L1 / smallest L1 (target <= 1.1 for 8 GB / 1 GB) are printed. For reference, the old
attach cost (prefaulting the whole arena) is measured once on the smallest L1 with ``dataplane.prefault``.

Run: ``.venv/bin/python benchmarks/bench_attach.py --l1-gb 1 8`` (needs the largest L1 free in /dev/shm only as
virtual size: the arena is sparse, the client touches only its slots).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time

import httpx

CHUNK = 256
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

CHILD = r"""
import json, os, sys, time
import torch
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
from kvtier.client import Client
from kvtier.layout import KVLayout
url, chunks, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)
tokens = torch.randint(0, 50000, (256 * chunks,), generator=torch.Generator().manual_seed(os.getpid())).tolist()
kv = torch.randn(layout.chunk_shape(len(tokens)))
before = rss()
t0 = time.perf_counter()
client = Client(url, model=%r, layout=layout, prefault=(mode == "slots"))
attach = time.perf_counter() - t0
if mode == "whole":
    from kvtier.client.dataplane import prefault
    t0 = time.perf_counter()
    prefault(client.transport.arena)
    attach += time.perf_counter() - t0
assert client.uses_shared_memory
client.store(tokens, kv)
out, n = client.retrieve(tokens)
assert n == len(tokens) and torch.equal(out, kv)
used = rss() - before
client.close()
print(json.dumps({"attach_seconds": attach, "rss_bytes": used}))
""" % MODEL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(l1_gb: float):
    port, admin = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvtier", "server", "--port", str(port), "--admin-port", str(admin),
           "--l1-size-gb", str(l1_gb), "--chunk-size", str(CHUNK), "--eviction-policy", "LRU", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{admin}/healthz", timeout=1).status_code == 200:
                return proc, f"tcp://127.0.0.1:{port}"
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def attach_once(url: str, chunks: int, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, url, str(chunks), mode], capture_output=True, text=True,
                         timeout=300)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--l1-gb", type=float, nargs="+", default=[1.0, 8.0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=4, help="chunks stored and retrieved by each client")
    args = ap.parse_args()
    free_gb = shutil.disk_usage("/dev/shm").free / 1e9
    print(f"/dev/shm free: {free_gb:.1f} GB")
    rows = {}
    for l1 in args.l1_gb:
        proc, url = start_server(l1)
        try:
            attach_once(url, args.chunks, "slots")  # warm the page cache of Python and torch
            runs = [attach_once(url, args.chunks, "slots") for _ in range(args.repeats)]
            rows[l1] = {"attach_seconds": statistics.median(r["attach_seconds"] for r in runs),
                        "rss_bytes": statistics.median(r["rss_bytes"] for r in runs)}
            if l1 == min(args.l1_gb):
                rows["whole"] = attach_once(url, args.chunks, "whole")
        finally:
            proc.terminate()
            proc.wait(60)
    for l1 in args.l1_gb:
        r = rows[l1]
        print(f"L1 {l1:g} GB: attach {r['attach_seconds'] * 1e3:.1f} ms, client RSS +{r['rss_bytes'] / 1e6:.1f} MB")
    lo, hi = rows[min(args.l1_gb)], rows[max(args.l1_gb)]
    w = rows["whole"]
    print(f"reference, old attach (prefault the whole {min(args.l1_gb):g} GB arena): "
          f"{w['attach_seconds'] * 1e3:.0f} ms, RSS +{w['rss_bytes'] / 1e6:.0f} MB")
    print(f"ratio {max(args.l1_gb):g} GB / {min(args.l1_gb):g} GB: attach {hi['attach_seconds'] / lo['attach_seconds']:.2f}x, "
          f"RSS {hi['rss_bytes'] / lo['rss_bytes']:.2f}x (target <= 1.1)")


if __name__ == "__main__":
    main()
