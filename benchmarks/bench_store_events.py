"""KVCache.store throughput with a feature on vs off: KV cache events, or L2 record authentication.

SmolLM2-shaped KV (30 layers, 3 KV heads, head dim 64, fp32; 11.25 MiB per 256-token chunk). Each
round stores a fresh prompt into both caches, alternating which goes first; the ratio is the median
over rounds of (time with the feature off / time with it on). Both caches hash at ``--block-size``
(the engine's block size), so the ratio measures the feature alone.

* ``--compare events`` (default): events published over ZMQ vs none; the store into L1 is timed. Target >= 0.95x.
* ``--compare record-auth``: both caches write through to a local-disk L2 (fsync); one signs every record
  (``l2_record_key``, with ``--record-auth blake3`` or ``hmac-sha256``). Timed: store plus ``flush`` (every
  record durable on disk). Target >= 0.9x.

    .venv/bin/python benchmarks/bench_store_events.py [--compare events|record-auth] [--record-auth blake3]
        [--rounds 15] [--tokens 2048] [--block-size 256]
"""

import argparse
import statistics
import tempfile
import time

import torch

from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)
TARGETS = {"events": 0.95, "record-auth": 0.9}


def caches(args, tmp: str) -> tuple[KVCache, KVCache]:
    """(feature off, feature on)."""
    base = {"chunk_size": 256, "block_size": args.block_size, "l1_size_gb": "1GiB"}
    if args.compare == "events":
        on = {**base, "enable_kv_events": True, "kv_events": {"endpoint": f"ipc://{tmp}/events"}}
        return KVCache(build_config(base), "smollm2", LAYOUT), KVCache(build_config(on), "smollm2", LAYOUT)
    off = {**base, "l2_adapters": [{"type": "local_disk", "path": f"{tmp}/off"}]}
    on = {**base, "l2_adapters": [{"type": "local_disk", "path": f"{tmp}/on"}],
          "l2_record_key": "bench-record-key-0123456789abcdef", "l2_record_auth": args.record_auth}
    return KVCache(build_config(off), "smollm2", LAYOUT), KVCache(build_config(on), "smollm2", LAYOUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=sorted(TARGETS), default="events")
    ap.add_argument("--record-auth", choices=["blake3", "hmac-sha256"], default="blake3")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        off, on = caches(args, tmp)
        kv = torch.randn(LAYOUT.chunk_shape(args.tokens))
        ratios, t_off, t_on = [], [], []
        for r in range(args.rounds + 1):
            tokens = torch.randint(0, 49_152, (args.tokens,), generator=torch.Generator().manual_seed(r)).tolist()
            times = {}
            for cache in ((off, on) if r % 2 else (on, off)):
                cache.clear()
                start = time.perf_counter()
                stored = cache.store(tokens, kv)
                if args.compare == "record-auth":
                    assert cache.flush(60.0)
                times[cache is on] = time.perf_counter() - start
                assert stored == args.tokens // 256
            if r == 0:
                continue  # warm-up
            t_off.append(times[False])
            t_on.append(times[True])
            ratios.append(times[False] / times[True])
        extra = f"publisher: {on.tiers.events.publisher.stats()}" if args.compare == "events" else \
            f"L2 writes: off {off.metrics.value('kvtier_l2_writes_total', adapter='local_disk'):.0f}, " \
            f"on {on.metrics.value('kvtier_l2_writes_total', adapter='local_disk'):.0f}"
        off.close()
        on.close()
    gb = LAYOUT.chunk_bytes(args.tokens) / 1e9
    what = "events" if args.compare == "events" else f"record authentication ({args.record_auth})"
    print(f"store{' + flush to local disk' if args.compare == 'record-auth' else ''} of {args.tokens} tokens "
          f"({gb * 1e3:.0f} MB), block_size {args.block_size}, {args.rounds} rounds, torch threads 1")
    print(f"  {what} off: {gb / statistics.median(t_off):6.2f} GB/s (median {statistics.median(t_off) * 1e3:.1f} ms)")
    print(f"  {what} on:  {gb / statistics.median(t_on):6.2f} GB/s (median {statistics.median(t_on) * 1e3:.1f} ms)")
    print(f"  {extra}")
    print(f"RESULT store throughput with {what} / without = {statistics.median(ratios):.3f}x "
          f"(target >= {TARGETS[args.compare]}x)")


if __name__ == "__main__":
    main()
