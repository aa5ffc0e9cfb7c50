"""Gather and scatter of one chunk for every vLLM CUDA attention layout, against a torch copy of the same bytes.

Each case is an attention backend of ``connectors.vllm_cuda_layouts`` (FlashAttention, FlashInfer and Triton keep
keys and values; the MLA backends one latent vector), a vLLM ``KVCacheLayout`` (the six stride orders) and a KV
dtype (bf16; fp8, one byte per element; fp16 copies exactly as bf16). The caches are laid out as vLLM allocates
them (``allocate_paged``) on CPU for a model shape (Llama-3-8B: 32 layers x 8 KV heads x 128; and for
MLA DeepSeek-V3, 61 layers x 576), the backend's smallest block size (16 tokens, or its fixed size), each cache
holding ``--cache-chunks`` chunks of ``--chunk-tokens`` tokens.

Per case, ``--repeat`` rounds, each timing back to back: the baseline, a ``torch`` copy of as many bytes from a random
place of a buffer as large as the cache (as cold in the CPU caches as the blocks are) into a chunk-sized buffer;
``PagedKV.gather_chunk`` (paged -> chunk) and ``PagedKV.scatter_chunk`` (chunk -> paged), each on fresh block ids:
``random`` distinct ids (vLLM's free list after a while) or one ``run`` of consecutive ids (a fresh free list).
Reported: baseline seconds / op seconds from the best of the rounds of each (>= 1: as fast as the copy; best-of
because other jobs share the machine), and the op's GB/s (10**9 bytes of KV per second). Every case also round-trips
once: gather, scatter into other blocks of another cache, gather again: bit-exact or the script exits 1.

    .venv/bin/python benchmarks/bench_layouts.py [--repeat 15] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvtier.connectors.vllm_cuda_layouts import ATTENTION_BACKENDS, KV_CACHE_LAYOUTS, PagedKV, allocate_paged
from kvtier.layout import KVLayout

MODELS = {"kv": ("Llama-3-8B", 32, 8, 128), "latent": ("DeepSeek-V3 (MLA)", 61, 1, 576)}
DTYPES = {"bfloat16": (torch.bfloat16, "bfloat16"), "fp8": (torch.uint8, "float8_e4m3fn")}
KERNEL_BLOCK = 16


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_case(name: str, kv_cache_layout: str, dtype: str, args, gen: torch.Generator) -> dict:
    backend = ATTENTION_BACKENDS[name]
    _, layers, heads, head_dim = MODELS[backend.packing]
    torch_dtype, kv_dtype = DTYPES[dtype]
    layout = KVLayout(layers, heads, head_dim, kv_dtype, latent=backend.packing == "latent")
    block_size = max(KERNEL_BLOCK, min(backend.block_sizes or (KERNEL_BLOCK,)))
    tokens = args.chunk_tokens
    nb = tokens // block_size
    blocks = args.cache_chunks * nb
    caches = [allocate_paged(layout, backend, kv_cache_layout, blocks, block_size, cache_dtype=torch_dtype)
              for _ in range(2)]
    for cache in caches:  # random bytes in every block
        torch.tensor([], dtype=torch.uint8).set_(cache[0].untyped_storage()).random_(0, 256, generator=gen)
    paged = [PagedKV(c, name, layout, block_size) for c in caches]
    chunk = torch.empty(layout.chunk_shape(tokens), dtype=getattr(torch, kv_dtype))
    pool = torch.tensor([], dtype=torch.uint8).set_(caches[1][0].untyped_storage())  # the baseline's source
    nbytes = layout.chunk_bytes(tokens)
    dst = torch.empty(nbytes, dtype=torch.uint8)

    def ids() -> list[int]:
        if args.ids == "run":
            first = int(torch.randint(0, blocks - nb + 1, (1,), generator=gen))
            return list(range(first, first + nb))
        return torch.randperm(blocks, generator=gen)[:nb].tolist()

    def copy() -> None:
        start = int(torch.randint(0, pool.numel() - nbytes, (1,), generator=gen))
        dst.copy_(pool[start:start + nbytes])

    first, second = ids(), ids()  # round trip: gather, scatter into other blocks of the other cache, gather again
    paged[0].gather_chunk(first, chunk)
    back = torch.empty_like(chunk)
    paged[1].scatter_chunk(second, chunk, 0, tokens)
    paged[1].gather_chunk(second, back)
    exact = torch.equal(chunk.view(torch.uint8), back.view(torch.uint8))
    best = {"copy": float("inf"), "gather": float("inf"), "scatter": float("inf")}
    for _ in range(args.repeat):
        g_ids, s_ids = ids(), ids()
        for key, fn in (("copy", copy), ("gather", lambda: paged[0].gather_chunk(g_ids, chunk)),
                        ("scatter", lambda: paged[1].scatter_chunk(s_ids, chunk, 0, tokens))):
            best[key] = min(best[key], timed(fn))
    return {"backend": name, "layout": kv_cache_layout, "dtype": dtype, "ids": args.ids, "chunk_bytes": nbytes,
            "block_size": block_size, "exact": exact, "gather_vs_copy": best["copy"] / best["gather"],
            "scatter_vs_copy": best["copy"] / best["scatter"], "copy_gb_s": nbytes / best["copy"] / 1e9,
            "gather_gb_s": nbytes / best["gather"] / 1e9, "scatter_gb_s": nbytes / best["scatter"] / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--cache-chunks", type=int, default=8, help="each paged cache holds this many chunks")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: per core)")
    parser.add_argument("--backends", default=",".join(ATTENTION_BACKENDS))
    parser.add_argument("--ids", choices=("random", "run"), default="random",
                        help="the chunk's blocks: random distinct ids, or one run of consecutive ids")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{args.ids} block ids, {args.threads} thread(s)")
    print(f"{'backend':15} {'layout':6} {'dtype':8} {'MB':>6} {'copy GB/s':>9} {'gather':>7} {'scatter':>7} exact")
    for name in args.backends.split(","):
        for kv_cache_layout in KV_CACHE_LAYOUTS:
            for dtype in DTYPES:
                if (dtype == "fp8") and "fp8" not in ATTENTION_BACKENDS[name].kv_cache_dtypes:
                    continue
                row = run_case(name, kv_cache_layout, dtype, args, gen)
                rows.append(row)
                print(f"{name:15} {kv_cache_layout:6} {dtype:8} {row['chunk_bytes'] / 1e6:6.1f} {row['copy_gb_s']:9.2f} "
                      f"{row['gather_vs_copy']:6.2f}x {row['scatter_vs_copy']:6.2f}x {row['exact']}", flush=True)
    worst = min(min(r["gather_vs_copy"], r["scatter_vs_copy"]) for r in rows)
    print(f"worst gather/scatter vs copy: {worst:.2f}x over {len(rows)} cases; all bit-exact: "
          f"{all(r['exact'] for r in rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
