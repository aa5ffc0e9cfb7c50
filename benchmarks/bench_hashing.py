"""Prefix hashing throughput: kvtier.hashing.prefix_hashes vs plain per-block reference loops, in the same run.

The references are what vLLM itself runs per block (``hash_block_tokens``): ``pickle.dumps`` + hashlib for
``sha256`` (kvtier's default, vLLM 0.32's default), ``cbor2.dumps(canonical=True)`` + hashlib for
``sha256_cbor``. Both sides hash the same tokens block by block and must agree; each ratio is
reference_time / kvtier_time (>= 1.0 means kvtier is at least as fast). Block sizes: 16 (GPU vLLM) and 128
(vLLM CPU) by default. The last lines compare kvtier's two algorithms with each other.

    .venv/bin/python benchmarks/bench_hashing.py [--num-tokens 1000000] [--block-sizes 16,128] [--repeats 5]
"""

import argparse
import hashlib
import pickle
import statistics
import time

import cbor2
import numpy as np

from kvtier.hashing import prefix_hashes, root_hash

SEED = "vllm-none-hash"


def reference(tokens: list[int], block_size: int, algorithm: str) -> list[bytes]:
    """vLLM's per-block loop: H(serialize((parent, tuple(block), None)))."""
    parent, out = root_hash(algorithm, SEED), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        obj = (parent, tuple(tokens[start:start + block_size]), None)
        data = pickle.dumps(obj, protocol=5) if algorithm == "sha256" else cbor2.dumps(obj, canonical=True)
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-tokens", type=int, default=1_000_000)
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, 49_152, args.num_tokens)  # SmolLM2's vocabulary
    tokens = tokens_np.tolist()
    n = args.num_tokens
    print(f"prefix hashing, {n:,} tokens, block by block, seed {SEED!r}, median of {args.repeats}")
    ours_by = {}
    for block_size in (int(b) for b in args.block_sizes.split(",")):
        for algorithm in ("sha256", "sha256_cbor"):
            assert prefix_hashes(tokens, block_size, algorithm, SEED) == reference(tokens, block_size, algorithm)
            ref = median_seconds(lambda: reference(tokens, block_size, algorithm), args.repeats)
            ours = median_seconds(lambda: prefix_hashes(tokens, block_size, algorithm, SEED), args.repeats)
            ours_np = median_seconds(lambda: prefix_hashes(tokens_np, block_size, algorithm, SEED), args.repeats)
            ours_by[(block_size, algorithm)] = ours
            label = "pickle.dumps" if algorithm == "sha256" else "cbor2.dumps"
            print(f"  block {block_size:4d} {algorithm:11s}: reference ({label} + hashlib) {ref * 1e3:8.1f} ms "
                  f"({n / ref / 1e6:5.1f} M tokens/s); kvtier list {ours * 1e3:8.1f} ms ({n / ours / 1e6:5.1f} M tokens/s),"
                  f" numpy {ours_np * 1e3:8.1f} ms")
            print(f"RESULT hashing ratio, block {block_size}, {algorithm} (reference / kvtier, list input) = "
                  f"{ref / ours:.2f}x  (target >= 1.0x)")
    for (block_size, algorithm), ours in ours_by.items():
        if algorithm == "sha256":
            cbor = ours_by[(block_size, "sha256_cbor")]
            print(f"RESULT block {block_size}: kvtier sha256 (default) time / kvtier sha256_cbor time = {ours / cbor:.2f}")


if __name__ == "__main__":
    main()
