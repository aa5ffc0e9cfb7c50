"""KV cache event benchmarks.

(a) Publisher throughput with a subscriber attached (in another process): events/s against the 100,000 events/s
    target, and a check that every event arrived (live or replayed) in order.
    With ``--auth``: the same with CurveZMQ and tenant scoping on (a server's keys, the subscriber holding the
    server's secret) and off, alternating, and the ratio on/off (target >= 0.9x).
(b) Emitter overhead in a store-like loop (block hashing + copying one 256-token chunk of KV into a buffer, as the
    cache does) with events disabled vs enabled, for block_size 256 (= chunk) and 16 (GPU vLLM's blocks).

Usage: python benchmarks/bench_events.py [--events 300000] [--chunks 400] [--auth] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvtier.auth.keyring import KeyRing
from kvtier.auth.secret_file import load_or_create
from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.events import BlockStored, EventEmitter, EventPublisher, Subscriber
from kvtier.hashing import prefix_hashes
from kvtier.layout import KVLayout

TARGET_EVENTS_PER_SECOND = 100_000


def subscriber_main(endpoint: str, replay: str, num_events: int, secret_file: str | None = None) -> None:
    """Child process: count events, check event i carries hash i, report JSON on stdout."""
    sub = Subscriber(endpoint, replay, "kv-events", replay_timeout_seconds=10, secret_file=secret_file)
    print("ready", flush=True)
    expected, in_order, done_at = 0, True, None
    while expected < num_events:
        item = sub.recv(30)
        if item is None:
            break
        for ev in item[1].events:
            h = ev.block_hashes[0]
            if h == 2**63:  # warm-up probe
                continue
            in_order &= h == expected
            expected += 1
    done_at = time.monotonic()  # system-wide clock: comparable with the parent's
    s = sub.stats
    print(json.dumps({"received": expected, "in_order": in_order, "replayed_batches": s.replayed,
                      "missed_batches": s.missed_batches, "live_batches": s.received,
                      "done_at": done_at}), flush=True)
    sub.close()


def bench_publisher(num_events: int, secret_file: str | None = None) -> float:
    """(a) once; returns events/s. ``secret_file``: a server secret file, so the publisher authenticates."""
    cfg = build_config({"kv_events": {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0",
                                      "batch_max_events": 1000, "batch_max_delay_seconds": 0.001}}).kv_events
    keyring = KeyRing(load_or_create(secret_file)[0]) if secret_file else None
    pub = EventPublisher(cfg, auth=keyring)
    child = subprocess.Popen([sys.executable, __file__, "--child", pub.endpoint, pub.replay_endpoint, str(num_events),
                              *([secret_file] if secret_file else [])], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    probe = BlockStored([2**63], None, list(range(16)), 16, None, "CPU", None)
    time.sleep(0.5)  # ZMQ joins asynchronously; probes below absorb the rest
    for _ in range(20):
        pub.publish([probe])
        time.sleep(0.02)
    tokens = list(range(16))
    events = [BlockStored([i], None, tokens, 16, None, "CPU", None) for i in range(num_events)]
    start = time.monotonic()
    i, step = 0, 64
    while i < num_events:  # respect the bounded queue: retry what did not fit
        i += pub.publish(events[i:i + step])
        if pub.stats()["queued_events"] > cfg.max_queue_size // 2:
            time.sleep(0.0005)
    while pub.stats()["queued_events"]:
        time.sleep(0.001)
    queue_drained_seconds = time.monotonic() - start
    result = json.loads(child.stdout.readline())
    child.wait(60)
    pub.close()
    elapsed = result["done_at"] - start  # until the subscriber process had the last event
    rate = num_events / elapsed
    mode = "CurveZMQ + scoping" if secret_file else "plain ZMQ"
    print(f"(a) publisher -> subscriber process, {mode}: {num_events} events (BlockStored, 16 tokens) in {elapsed:.3f} s "
          f"(publisher queue drained after {queue_drained_seconds:.3f} s) = {rate:,.0f} events/s; "
          f"ratio vs {TARGET_EVENTS_PER_SECOND:,}/s target: {rate / TARGET_EVENTS_PER_SECOND:.2f}x")
    ok = result["received"] == num_events and result["in_order"] and result["missed_batches"] == 0
    print(f"    subscriber: {result['received']} events, in order: {result['in_order']}, live batches "
          f"{result['live_batches']}, replayed batches {result['replayed_batches']}, lost {result['missed_batches']}"
          f" -> {'OK' if ok else 'FAILED'}")
    return rate


def bench_auth(num_events: int, rounds: int) -> None:
    """(a) with authentication off and on, alternating; the ratio of the medians."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        secret = os.path.join(tmp, "server.secret")
        rates: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(rounds):
            rates["off"].append(bench_publisher(num_events))
            rates["on"].append(bench_publisher(num_events, secret))
    off, on = (float(np.median(rates[k])) for k in ("off", "on"))
    print(f"(a) authentication: median {on:,.0f} events/s on vs {off:,.0f} off over {rounds} round(s); "
          f"ratio on/off {on / off:.2f}x (target >= 0.9x)")


def bench_emitter(num_chunks: int) -> None:
    chunk, seq_chunks = 256, 8
    # KV of one 256-token chunk for SmolLM2-135M in bf16: 30 layers x 2 x 256 x 3 heads x 64 dims x 2 bytes
    kv = np.random.default_rng(0).integers(0, 255, 30 * 2 * chunk * 3 * 64 * 2, dtype=np.uint8)
    l1 = np.empty_like(kv)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 50_000, seq_chunks * chunk) for _ in range(num_chunks // seq_chunks)]
    print(f"(b) store-like loop: {num_chunks} chunks of 256 tokens per mode (block hashes + 5.9 MB KV copy each), "
          "median per chunk, 5 interleaved passes:")
    for block_size in (256, 16):  # blocks = chunks, and GPU vLLM's engine blocks (hashed either way)
        cfg = build_config({"chunk_size": chunk, "block_size": block_size, "l1_size_gb": "64MiB",
                            "enable_kv_events": True, "kv_events": {"endpoint": "tcp://127.0.0.1:0"}})
        with KVCache(cfg, "bench@0", KVLayout(1, 1, 4), publish_events=False) as cache:
            refs = [cache.chunk_refs(t)[1] for t in seqs]  # what the cache hands the emitter

        def store_loop(emitter) -> list[float]:
            """Seconds per chunk stored (block hashes from the parent, KV copy into L1, the event when enabled)."""
            per_chunk = []
            for tokens, seq_refs in zip(seqs, refs):
                parent = None
                for c in range(seq_chunks):
                    t0 = time.perf_counter()
                    parent = prefix_hashes(tokens[c * chunk:(c + 1) * chunk], block_size, parent=parent)[-1]
                    np.copyto(l1, kv)
                    if emitter is not None:
                        emitter.stored(tokens, seq_refs[c:c + 1], "CPU")
                    per_chunk.append(time.perf_counter() - t0)
            return per_chunk

        publisher = EventPublisher(cfg.kv_events)
        store_loop(None)  # warm-up
        samples: dict[str, list[float]] = {"disabled": [], "enabled": []}
        for _ in range(5):  # interleaved passes: the machine is shared, so compare medians of per-chunk times
            for name in samples:
                samples[name] += store_loop(None if name == "disabled" else EventEmitter(cfg, publisher=publisher))
        publisher.close()
        base, with_events = (float(np.median(samples[k])) for k in ("disabled", "enabled"))
        print(f"    block {block_size:3d}: events disabled {1 / base:8.1f} chunks/s, enabled {1 / with_events:8.1f} "
              f"chunks/s; throughput ratio {base / with_events:.3f}x (target >= 0.95x); emitter cost "
              f"{(with_events - base) * 1e6:+.1f} us/chunk")
        best = float("inf")  # the emitter alone, without the store work around it (best of 20 passes)
        for _ in range(20):
            emitter = EventEmitter(cfg)
            t0 = time.perf_counter()
            for tokens, seq_refs in zip(seqs, refs):
                for c in range(seq_chunks):
                    emitter.stored(tokens, seq_refs[c:c + 1], "CPU")
            best = min(best, (time.perf_counter() - t0) / (len(seqs) * seq_chunks))
        print(f"    emitter.stored alone, block {block_size}: {best * 1e6:.1f} us/chunk = {best / base:.1%} of a "
              f"store-like chunk (ratio {base / (base + best):.3f}x)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        subscriber_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else None)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--chunks", type=int, default=400)
    ap.add_argument("--auth", action="store_true", help="(a) with authentication off and on, and the ratio")
    ap.add_argument("--rounds", type=int, default=2, help="--auth: off/on pairs to take the median of")
    args = ap.parse_args()
    if args.auth:
        bench_auth(args.events, args.rounds)
        return
    bench_publisher(args.events)
    bench_emitter(args.chunks)


if __name__ == "__main__":
    main()
