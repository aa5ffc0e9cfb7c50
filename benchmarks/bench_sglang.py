"""SGLang HiCache storage through kvtier: page throughput and ``batch_exists`` latency, against baselines in one run.

    .venv/bin/python benchmarks/bench_sglang.py [--pages 128] [--rounds 5] [--exists-reps 300] [--json]

Starts a ``kvtier server`` (127.0.0.1, free ports), then runs the measurement in the SGLang environment
(``.venv-sglang``, ``scripts/setup-sglang.sh``) with SGLang 0.5.23's real parts: an MHA host pool (``page_first``,
bf16; 16 layers, 8 KV heads, head dim 64, 32-token pages: 1 MiB per page), the kvtier backend made by SGLang's
``dynamic`` factory, and SGLang's own ``file`` backend (``HiCacheFile``, in a temporary folder on this disk). Each
round stores ``--pages`` new pages from the pool and loads them back into other pool slots, the way SGLang's cache
controller calls each backend (kvtier: ``batch_set_v1`` / ``batch_get_v1``; ``file``: flat pages through
``batch_set`` / ``batch_get`` and ``set_from_flat_data_page``, SGLang's path for it). Printed, same run:

* ``vs_file``: kvtier's store+load throughput over ``HiCacheFile``'s on the same pages (target >= 2);
* ``vs_torch_copy``: over a plain torch copy of the same bytes from one host buffer to another and back (>= 0.5);
* ``exists_ratio``: median ``batch_exists`` of 128 pages over the median of the same client's own ``lookup``
  round trip for the same 128 chunks (<= 1.5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvtier_harness/ from this checkout

GIB = 1 << 30
WARMUP_ROUNDS = 9  # more rounds of pages than the server's L1 holds: measured rounds evict, as a full L1 does


def _rate(nbytes: int, seconds: list[float]) -> float:
    """GiB/s of the median round."""
    return nbytes / statistics.median(seconds) / GIB


def inner(url: str, pages: int, rounds: int, exists_reps: int) -> dict:
    """The measurement, in the SGLang environment."""
    import torch

    from kvtier_harness.sglang_pools import attach, fill_pages, mha_pool, page_keys, storage_config

    torch.set_num_threads(1)  # a 2-core machine: the server has the other core
    pool = mha_pool("page_first", num_layers=16, heads=8, head_dim=64, page_size=32, num_pages=2 * pages + 2)
    page = pool.page_size
    src, dst = pool.alloc(pages * page), pool.alloc(pages * page)
    fill_pages(pool, src, 1)
    page_nbytes = pool.get_data_page(0, flat=True).numel() * pool.dtype.itemsize
    moved = 2 * pages * page_nbytes  # stored once, loaded once
    extra = {"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang", "class_name": "KVTierStorage",
             "interface_v1": 1, "kvtier.server_url": url}
    kvtier = attach("dynamic", storage_config(extra, model="bench"), pool)
    folder = tempfile.mkdtemp(prefix="hicache-file-")
    hfile = attach("file", storage_config({"file_storage_path": folder}, model="bench"), pool)

    def keys_of(round_: int, tag: int) -> list[str]:
        return page_keys([(tag * 7919 + round_ * 104729 + i) % 50_000 for i in range(pages * page)], page)

    split = {"set": [], "get": []}

    def kvtier_round(keys):
        started = time.perf_counter()
        assert all(kvtier.batch_set_v1(keys, src))
        split["set"].append(time.perf_counter() - started)
        assert all(kvtier.batch_get_v1(keys, dst))
        split["get"].append(time.perf_counter() - split["set"][-1] - started)

    def file_round(keys):  # SGLang's controller for "file": _generic_page_set / _generic_page_get
        data = [pool.get_data_page(src[i * page]) for i in range(pages)]
        assert hfile.batch_set(keys, data)
        got = hfile.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for i, flat in enumerate(got):
            pool.set_from_flat_data_page(dst[i * page], flat)

    a = torch.empty(pages * page_nbytes, dtype=torch.uint8)
    a.copy_(pool.get_data_page(src[0], flat=True).view(torch.uint8).repeat(pages))
    b = torch.empty_like(a)

    def copy_round(_keys):
        b.copy_(a)
        a.copy_(b)

    times = {"kvtier": [], "file": [], "torch_copy": []}
    for r in range(-WARMUP_ROUNDS, rounds):  # warm-up rounds fill the server's L1 once: later ones reuse its memory
        for name, fn, tag in (("kvtier", kvtier_round, 1), ("file", file_round, 2), ("torch_copy", copy_round, 3)):
            keys = keys_of(r, tag)
            started = time.perf_counter()
            fn(keys)
            if r >= 0:
                times[name].append(time.perf_counter() - started)
    assert bytes(pool.get_data_page(dst[0], flat=True).view(torch.uint8).numpy()) == \
        bytes(pool.get_data_page(src[0], flat=True).view(torch.uint8).numpy())
    # batch_exists of 128 held pages vs the client's own lookup round trip over the same chunks
    keys = keys_of(1, 1)[:128]
    chain = kvtier.pages.chain(keys)
    client = kvtier.backend
    exists_s, lookup_s = [], []
    for _ in range(exists_reps):
        started = time.perf_counter()
        assert kvtier.batch_exists(keys) == len(keys)
        exists_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert client.lookup(chain) == len(keys) * page
        lookup_s.append(time.perf_counter() - started)
    kvtier.close()
    rates = {name: _rate(moved, seconds) for name, seconds in times.items()}
    return {"page_bytes": page_nbytes, "pages": pages, "rounds": rounds, "gib_per_s": rates,
            "kvtier_set_ms": statistics.median(split["set"][WARMUP_ROUNDS:]) * 1e3,
            "kvtier_get_ms": statistics.median(split["get"][WARMUP_ROUNDS:]) * 1e3,
            "vs_file": rates["kvtier"] / rates["file"], "vs_torch_copy": rates["kvtier"] / rates["torch_copy"],
            "exists_us": statistics.median(exists_s) * 1e6, "lookup_us": statistics.median(lookup_s) * 1e6,
            "exists_ratio": statistics.median(exists_s) / statistics.median(lookup_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=128, help="pages stored and loaded per round [128]")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per path [5]")
    parser.add_argument("--exists-reps", type=int, default=300, help="batch_exists / lookup pairs timed [300]")
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")
    parser.add_argument("--inner", help=argparse.SUPPRESS)  # the SGLang-side run, given the server URL
    args = parser.parse_args()
    if args.inner:
        print("RESULT " + json.dumps(inner(args.inner, args.pages, args.rounds, args.exists_reps)), flush=True)
        return
    from kvtier_harness.kvtier_server import ServerProcess
    from kvtier_harness.sglang import run_json

    # 1 MiB pages, 8 rounds of them: L1 fills in the warm-up rounds; a client may reserve a quarter of it at once
    l1 = f"{8 * args.pages}MiB"
    with tempfile.TemporaryDirectory() as work, ServerProcess(Path(work), 256, l1) as server:
        result = run_json([__file__, "--inner", server.url, "--pages", str(args.pages), "--rounds", str(args.rounds),
                           "--exists-reps", str(args.exists_reps)], 1800)
    if args.json:
        print(json.dumps(result))
        return
    r = result["gib_per_s"]
    print(f"{result['pages']} pages of {result['page_bytes'] / (1 << 20):.1f} MiB stored and loaded per round, "
          f"median of {result['rounds']} rounds")
    print(f"  kvtier server   {r['kvtier']:7.2f} GiB/s")
    print(f"  HiCacheFile     {r['file']:7.2f} GiB/s   kvtier / file       = {result['vs_file']:.2f}x (target >= 2)")
    print(f"  torch copy      {r['torch_copy']:7.2f} GiB/s   kvtier / torch copy = {result['vs_torch_copy']:.2f}x "
          "(target >= 0.5)")
    print(f"batch_exists of 128 pages: median {result['exists_us']:.0f} us; the client's lookup of the same 128 chunks: "
          f"{result['lookup_us']:.0f} us; ratio {result['exists_ratio']:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
