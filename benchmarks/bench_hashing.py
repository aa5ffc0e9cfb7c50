"""Prefix hashing throughput: kvtier.hashing.prefix_hashes vs a plain per-chunk cbor2 + hashlib reference.

Both compute vLLM's sha256_cbor chain over the same tokens (and must agree); the ratio is
reference_time / kvtier_time (>= 1.0 means kvtier is at least as fast).

    .venv/bin/python benchmarks/bench_hashing.py [--num-tokens 1000000] [--chunk-size 256] [--repeats 5]
"""

import argparse
import hashlib
import statistics
import time

import cbor2
import numpy as np

from kvtier.hashing import prefix_hashes, root_hash


def reference(tokens: list[int], chunk_size: int, seed: str) -> list[bytes]:
    parent = root_hash("sha256_cbor", seed)
    out = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(tokens[start:start + chunk_size]), None),
                                            canonical=True)).digest()
        out.append(parent)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-tokens", type=int, default=1_000_000)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, 49_152, args.num_tokens)  # SmolLM2's vocabulary
    tokens = tokens_np.tolist()
    seed = "vllm-none-hash"
    assert prefix_hashes(tokens, args.chunk_size) == reference(tokens, args.chunk_size, seed)
    ref_t, ours_t, ours_np_t = [], [], []
    for _ in range(args.repeats):
        for fn, data, times in ((reference, tokens, ref_t), (prefix_hashes, tokens, ours_t),
                                (prefix_hashes, tokens_np, ours_np_t)):
            start = time.perf_counter()
            fn(data, args.chunk_size) if fn is prefix_hashes else fn(data, args.chunk_size, seed)
            times.append(time.perf_counter() - start)
    ref, ours, ours_np = (statistics.median(x) for x in (ref_t, ours_t, ours_np_t))
    print(f"prefix hashing, {args.num_tokens:,} tokens, chunk {args.chunk_size}, sha256_cbor, median of {args.repeats}")
    print(f"  reference (per-chunk cbor2 + hashlib): {ref * 1e3:8.1f} ms  ({args.num_tokens / ref / 1e6:.1f} M tokens/s)")
    print(f"  kvtier, list input:                    {ours * 1e3:8.1f} ms  ({args.num_tokens / ours / 1e6:.1f} M tokens/s)")
    print(f"  kvtier, numpy input:                   {ours_np * 1e3:8.1f} ms  ({args.num_tokens / ours_np / 1e6:.1f} M tokens/s)")
    print(f"RESULT hashing ratio (reference / kvtier, list input) = {ref / ours:.2f}x  (target >= 1.0x)")


if __name__ == "__main__":
    main()
