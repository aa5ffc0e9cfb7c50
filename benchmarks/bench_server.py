"""Server benchmark: kvtier server + Client vs the in-process KVCache, measured in the same run.

(a) Bandwidth. SmolLM2-135M-shaped fp32 chunks of 256 tokens, (30, 2, 256, 3, 64) = 11.8 MB each.
    Each round stores a new ``--chunks``-chunk prompt and retrieves it, from this process through a
    ``kvtier server`` subprocess (shared memory, and also frames), and with an in-process KVCache;
    rounds alternate between the paths so machine noise hits all of them. A warm-up round touches
    L1 pages first. Figures: GB/s (1 GB = 1e9 bytes) of store, retrieve and both, and the ratio
    server / in-process of the total (target >= 0.6). The server authenticates clients (CurveZMQ, which
    also encrypts every frame); a second server started with ``--no-auth`` serves the same two paths,
    so the cost of authentication is the ratio auth / no-auth of each path.
(b) Lookup round trip for an 8,192-token prompt (32 chunks, all stored): median and p99 over
    ``--lookups`` calls, for the same prompt (hashes memoised) and for fresh 8,192-token prompts
    (hashing included, a miss); the in-process lookup as baseline (target: median <= 1 ms).
(c) Server memory while a client stores 10x the L1 size in new chunks, sampled every 20 ms: the server's
    RSS (psutil) plus the resident pages of its shared L1 file (written by the client, so not in
    the server's own RSS), against ``--rss-l1-gb`` + 300 MB (target).
(d) ``--clients`` client processes doing mixed lookup/store/retrieve for ``--duration`` seconds over a
    shared pool of documents (60 s for the record): errors, unavailable calls and chunks whose bytes
    differ from what was stored (every retrieved chunk is checked) must all be 0.

Run: ``.venv/bin/python benchmarks/bench_server.py`` (defaults: about a minute). For the record:
``--duration 60``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from kvtier_harness.kvtier_server import ServerProcess
from kvtier.cache import KVCache
from kvtier.client import Client
from kvtier.config import build_config
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M, fp32
CHUNK = 256
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


_LOGS = Path(tempfile.mkdtemp(prefix="kvtier-bench-server-"))  # the servers' logs


def start_server(l1_gb: float, *extra: str) -> ServerProcess:
    """A ``kvtier server`` with this benchmark's chunk size and an L1 of ``l1_gb``; ``extra``: more flags."""
    return ServerProcess(_LOGS, CHUNK, str(l1_gb), extra=("--log-level", "WARNING", *extra), startup_timeout_seconds=120)


def tokens_of(doc: int, num_tokens: int) -> list[int]:
    return [doc * 1_000_003 % 49_000 + i for i in range(num_tokens)]


# ---- (a) bandwidth ------------------------------------------------------------------------------
def bandwidth(args) -> dict:
    n_tok = args.chunks * CHUNK
    kv = torch.randn(LAYOUT.chunk_shape(n_tok), generator=torch.Generator().manual_seed(0))
    # one prompt is a fifth of L1: a client may reserve at most a quarter (server.max_reserved_fraction_per_client)
    l1_gb = 5 * args.chunks * CHUNK_BYTES / 1e9
    server, open_server = start_server(l1_gb), start_server(l1_gb, "--no-auth")
    try:
        paths = {"server-shm": Client(server.url, model=MODEL, layout=LAYOUT),
                 "server-frames": Client(server.url, model=MODEL, layout=LAYOUT, shared_memory=False),
                 "no-auth-shm": Client(open_server.url, model=MODEL, layout=LAYOUT),
                 "no-auth-frames": Client(open_server.url, model=MODEL, layout=LAYOUT, shared_memory=False),
                 "in-process": KVCache(build_config({"chunk_size": CHUNK, "l1_size_gb": l1_gb}), MODEL, LAYOUT)}
        times = {name: [0.0, 0.0] for name in paths}
        doc = 0
        for rnd in range(args.rounds + 1):
            for name, cache in paths.items():
                doc += 1
                toks = tokens_of(doc, n_tok)
                t0 = time.perf_counter()
                stored = cache.store(toks, kv)
                t1 = time.perf_counter()
                out, n = cache.retrieve(toks)
                t2 = time.perf_counter()
                assert stored == args.chunks and n == n_tok and torch.equal(out, kv), (name, stored, n, n_tok)
                del out
                if rnd:  # round 0 warms L1 pages up
                    times[name][0] += t1 - t0
                    times[name][1] += t2 - t1
        total = args.rounds * args.chunks * CHUNK_BYTES
        res = {name: {"store_GBps": total / s / 1e9, "retrieve_GBps": total / r / 1e9,
                      "total_GBps": 2 * total / (s + r) / 1e9} for name, (s, r) in times.items()}
        res["ratio_shm_vs_inprocess"] = res["server-shm"]["total_GBps"] / res["in-process"]["total_GBps"]
        res["ratio_frames_vs_inprocess"] = res["server-frames"]["total_GBps"] / res["in-process"]["total_GBps"]
        for path in ("shm", "frames"):
            res[f"ratio_{path}_auth_vs_no_auth"] = (res[f"server-{path}"]["total_GBps"]
                                                    / res[f"no-auth-{path}"]["total_GBps"])
        for cache in paths.values():
            cache.close()
    finally:
        server.stop()
        open_server.stop()
    return res


# ---- (b) lookup latency -------------------------------------------------------------------------
def lookup_latency(args) -> dict:
    n_tok = 8192
    server = start_server(1.2 * 32 * CHUNK_BYTES / 1e9 + 0.05)
    try:
        client = Client(server.url, model=MODEL, layout=LAYOUT)
        local = KVCache(build_config({"chunk_size": CHUNK, "l1_size_gb": 0.5}), MODEL, KVLayout(1, 1, 8))
        toks = tokens_of(1, n_tok)
        kv = torch.zeros(LAYOUT.chunk_shape(n_tok))
        assert client.store(toks, kv) == 32
        del kv
        local.store(toks, torch.zeros(KVLayout(1, 1, 8).chunk_shape(n_tok)))

        def timed(fn, prompts) -> list[float]:
            out = []
            for p in prompts:
                t0 = time.perf_counter()
                fn(p)
                out.append(time.perf_counter() - t0)
            return out

        same = [toks] * args.lookups
        fresh = [tokens_of(100 + i, n_tok) for i in range(args.lookups)]
        assert client.lookup(toks) == n_tok
        res = {}
        for label, prompts in (("same_prompt", same), ("fresh_prompts", fresh)):
            srv = timed(client.lookup, prompts)
            loc = timed(local.lookup, prompts)
            server_median, inprocess_median = 1e3 * statistics.median(srv), 1e3 * statistics.median(loc)
            res[label] = {"server_median_milliseconds": server_median,
                          "server_p99_milliseconds": 1e3 * sorted(srv)[int(0.99 * len(srv)) - 1],
                          "inprocess_median_milliseconds": inprocess_median,
                          "added_by_server_milliseconds": server_median - inprocess_median}
        client.close()
        local.close()
    finally:
        server.stop()
    return res


# ---- (c) server RSS -----------------------------------------------------------------------------
def server_rss(args) -> dict:
    server = start_server(args.rss_l1_gb)
    proc = psutil.Process(server.proc.pid)
    shm = "/dev/shm/" + server.status()["l1"]["shm_name"]

    def resident() -> tuple[int, int]:
        # the L1 pages are written by clients, so they count in the shm file, not in the server's own RSS;
        # RSS + the file's resident pages is an upper bound (a page the server touched counts twice)
        return proc.memory_info().rss, os.stat(shm).st_blocks * 512

    base = resident()
    peak = [sum(base), 0, 0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            own, shared = resident()
            peak[:] = [max(peak[0], own + shared), max(peak[1], own), max(peak[2], shared)]
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        client = Client(server.url, model=MODEL, layout=LAYOUT)
        per_prompt = 4
        kv = torch.randn(LAYOUT.chunk_shape(per_prompt * CHUNK))
        target = 10 * args.rss_l1_gb * 1e9
        stored = doc = 0
        while stored * CHUNK_BYTES < target:
            doc += 1
            stored += client.store(tokens_of(10_000 + doc, per_prompt * CHUNK), kv)
        client.close()
    finally:
        stop.set()
        sampler.join()
        server.stop()
    limit = args.rss_l1_gb * 1e9 + 300e6
    return {"l1_bytes": int(args.rss_l1_gb * 1e9), "stored_bytes": stored * CHUNK_BYTES,
            "server_rss_at_start_MB": base[0] / 1e6, "peak_server_rss_MB": peak[1] / 1e6,
            "peak_shm_resident_MB": peak[2] / 1e6, "peak_rss_MB": peak[0] / 1e6, "limit_MB": limit / 1e6,
            "ratio_peak_vs_limit": peak[0] / limit}


# ---- (d) mixed load -----------------------------------------------------------------------------
_BASE: list[np.ndarray] = []


def expected_chunk(doc: int, index: int) -> np.ndarray:
    """Chunk ``index`` of document ``doc``: a value pattern only that chunk has."""
    if not _BASE:
        _BASE.append(np.arange(np.prod(LAYOUT.chunk_shape(CHUNK)), dtype=np.float32).reshape(LAYOUT.chunk_shape(CHUNK)) * 1e-6)
    return _BASE[0] + np.float32(doc * 1000 + index)


def worker(url: str, seed: int, duration_seconds: float, num_docs: int, queue, barrier) -> None:
    rng = np.random.default_rng(seed)
    stats = {"lookup": 0, "store": 0, "retrieve": 0, "chunks_verified": 0, "bad_chunks": 0, "errors": 0}
    client = Client(url, model=MODEL, layout=LAYOUT, timeout_seconds=30)
    cache_chunks: dict[tuple[int, int], torch.Tensor] = {}
    expected_chunk(0, 0)
    barrier.wait()  # start together, after the imports
    deadline = time.monotonic() + duration_seconds
    while time.monotonic() < deadline:
        doc = int(rng.integers(num_docs))
        n_chunks = int(rng.integers(1, 5))
        toks = tokens_of(doc, n_chunks * CHUNK)
        op = rng.choice(["lookup", "store", "retrieve"], p=[0.4, 0.3, 0.3])
        try:
            if op == "lookup":
                client.lookup(toks)
            elif op == "store":
                kv = torch.cat([cache_chunks.setdefault((doc, i), torch.from_numpy(expected_chunk(doc, i)))
                                for i in range(n_chunks)], dim=2)
                client.store(toks, kv)
                if len(cache_chunks) > 64:
                    cache_chunks.clear()
            else:
                out, n = client.retrieve(toks)
                for i in range(n // CHUNK):
                    ok = np.array_equal(out[:, :, i * CHUNK:(i + 1) * CHUNK].numpy(), expected_chunk(doc, i))
                    stats["chunks_verified"] += 1
                    stats["bad_chunks"] += not ok
            stats[op] += 1
        except Exception as exc:  # noqa: BLE001 -- counted: the figure to reach is zero
            stats["errors"] += 1
            print(f"worker {seed}: {type(exc).__name__}: {exc}", file=sys.stderr)
    stats["unavailable"] = client.metrics.value("kvtier_client_unavailable_total")
    client.close()
    queue.put(stats)


def mixed(args) -> dict:
    server = start_server(args.mixed_l1_gb)
    try:
        ctx = mp.get_context("spawn")
        queue, barrier = ctx.Queue(), ctx.Barrier(args.clients)
        procs = [ctx.Process(target=worker, args=(server.url, i, args.duration, args.docs, queue, barrier))
                 for i in range(args.clients)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=args.duration + 300) for _ in procs]
        for p in procs:
            p.join()
    finally:
        server.stop()
    total = {k: sum(r[k] for r in results) for k in results[0]}
    total["ops_per_second"] = (total["lookup"] + total["store"] + total["retrieve"]) / args.duration
    total["clients"] = args.clients
    total["duration_seconds"] = args.duration
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=8, help="(a) chunks per prompt")
    parser.add_argument("--rounds", type=int, default=5, help="(a) measured rounds per path")
    parser.add_argument("--lookups", type=int, default=300, help="(b) lookups per measurement")
    parser.add_argument("--rss-l1-gb", type=float, default=0.25, help="(c) server L1 size")
    parser.add_argument("--clients", type=int, default=8, help="(d) client processes")
    parser.add_argument("--duration", type=float, default=10.0, help="(d) seconds (60 for the record)")
    parser.add_argument("--docs", type=int, default=40, help="(d) distinct documents")
    parser.add_argument("--mixed-l1-gb", type=float, default=0.5, help="(d) server L1 size")
    parser.add_argument("--only", choices=["a", "b", "c", "d"], action="append", help="run only these parts")
    args = parser.parse_args()
    parts = args.only or ["a", "b", "c", "d"]
    results = {}
    if "a" in parts:
        results["a_bandwidth"] = a = bandwidth(args)
        print(f"(a) store+retrieve {args.chunks}x{CHUNK_BYTES / 1e6:.1f} MB chunks: server(shm) "
              f"{a['server-shm']['total_GBps']:.2f} GB/s, server(frames) {a['server-frames']['total_GBps']:.2f} GB/s, "
              f"in-process {a['in-process']['total_GBps']:.2f} GB/s -> ratio shm/in-process "
              f"{a['ratio_shm_vs_inprocess']:.2f} (target >= 0.6), frames/in-process {a['ratio_frames_vs_inprocess']:.2f}",
              flush=True)
        print(f"(a) authentication (CurveZMQ) vs --no-auth: shm {a['no-auth-shm']['total_GBps']:.2f} GB/s without -> "
              f"ratio {a['ratio_shm_auth_vs_no_auth']:.2f}; frames {a['no-auth-frames']['total_GBps']:.2f} GB/s "
              f"without -> ratio {a['ratio_frames_auth_vs_no_auth']:.2f}", flush=True)
    if "b" in parts:
        results["b_lookup"] = b = lookup_latency(args)
        for label, r in b.items():
            print(f"(b) lookup 8192 tokens, {label}: server median {r['server_median_milliseconds']:.3f} ms "
                  f"(p99 {r['server_p99_milliseconds']:.3f}), in-process {r['inprocess_median_milliseconds']:.3f} ms -> "
                  f"ratio to the 1 ms target {r['server_median_milliseconds'] / 1.0:.2f}", flush=True)
    if "c" in parts:
        results["c_rss"] = c = server_rss(args)
        print(f"(c) server memory storing {c['stored_bytes'] / 1e9:.2f} GB into a {c['l1_bytes'] / 1e9:.2f} GB L1: peak "
              f"{c['peak_rss_MB']:.0f} MB (server RSS {c['peak_server_rss_MB']:.0f} + shared L1 "
              f"{c['peak_shm_resident_MB']:.0f}) vs limit {c['limit_MB']:.0f} MB -> ratio {c['ratio_peak_vs_limit']:.2f} "
              "(target <= 1)", flush=True)
    if "d" in parts:
        results["d_mixed"] = d = mixed(args)
        print(f"(d) {d['clients']} clients x {d['duration_seconds']:.0f} s mixed: {d['ops_per_second']:.0f} ops/s, "
              f"{d['chunks_verified']} chunks verified, bad chunks {d['bad_chunks']}, errors {d['errors']}, "
              f"unavailable {d['unavailable']:.0f} (target: all 0)", flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
