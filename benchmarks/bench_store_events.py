"""KVCache.store throughput with KV cache events enabled (publishing over ZMQ) vs disabled.

SmolLM2-shaped KV (30 layers, 3 KV heads, head dim 64, fp32; 11.25 MiB per 256-token chunk). Each
round stores a fresh prompt into both caches, alternating which goes first; the ratio is the median
over rounds of (time without events / time with events). Target >= 0.95x.

    .venv/bin/python benchmarks/bench_store_events.py [--rounds 15] [--tokens 2048] [--block-size 256]

Both caches hash at ``--block-size`` (the engine's block size), so the ratio measures the events alone.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = {"chunk_size": 256, "block_size": args.block_size, "l1_size_gb": "1GiB"}
        plain = KVCache(build_config(base), "smollm2", LAYOUT)
        events = KVCache(build_config({**base, "enable_kv_events": True, "kv_events": {
            "endpoint": f"ipc://{tmp}/events"}}), "smollm2", LAYOUT)
        kv = torch.randn(LAYOUT.chunk_shape(args.tokens))
        ratios, t_plain, t_events = [], [], []
        for r in range(args.rounds + 1):
            tokens = torch.randint(0, 49_152, (args.tokens,), generator=torch.Generator().manual_seed(r)).tolist()
            times = {}
            for cache in ((plain, events) if r % 2 else (events, plain)):
                cache.clear()
                start = time.perf_counter()
                stored = cache.store(tokens, kv)
                times[cache is events] = time.perf_counter() - start
                assert stored == args.tokens // 256
            if r == 0:
                continue  # warm-up
            t_plain.append(times[False])
            t_events.append(times[True])
            ratios.append(times[False] / times[True])
        published = events.tiers.events.publisher.stats()
        plain.close()
        events.close()
    gb = LAYOUT.chunk_bytes(args.tokens) / 1e9
    print(f"store of {args.tokens} tokens ({gb * 1e3:.0f} MB), block_size {args.block_size}, "
          f"{args.rounds} rounds, torch threads 1")
    print(f"  events disabled: {gb / statistics.median(t_plain):6.2f} GB/s (median {statistics.median(t_plain) * 1e3:.1f} ms)")
    print(f"  events enabled:  {gb / statistics.median(t_events):6.2f} GB/s (median {statistics.median(t_events) * 1e3:.1f} ms)")
    print(f"  publisher: {published}")
    print(f"RESULT store throughput with events / without = {statistics.median(ratios):.3f}x (target >= 0.95x)")


if __name__ == "__main__":
    main()
