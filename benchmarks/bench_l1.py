"""L1 benchmark: copy bandwidth through L1Store vs plain torch copies, and peak memory under churn.

(a) Bandwidth. SmolLM2-135M-shaped chunks of 256 tokens, fp32, shape (30, 2, 256, 3, 64)
    (11.25 MiB each). Store: reserve + ``Tensor.copy_`` into the slot view + commit. Retrieve:
    acquire + ``copy_`` out into a preallocated tensor + release. Every round stores new keys into
    slots freed by the previous round (untimed remove; eviction is timed in part (b)). Baseline:
    ``copy_`` of the same bytes between preallocated, already-touched torch tensors, alternating
    with the L1 copies chunk by chunk so that noise from other processes hits both. Figures: GB/s
    over all measured chunks (1 GB = 1e9 bytes; each chunk counts once in and once out) and the
    ratio L1/torch, the median over adjacent (L1, torch) pairs of the same copy (target >= 0.8).

(b) Peak memory (run first). In a fresh subprocess (so ru_maxrss starts clean): store chunks totalling
    ``--churn-factor`` x the budget into an L1Store of ``--budget-bytes`` (every reserve evicts once
    full; the write rate including eviction is printed too); report peak RSS (psutil,
    sampled after each chunk) and ru_maxrss, minus the baseline taken before the store was created,
    against the budget (target <= budget + 300 MB).

Run: ``.venv/bin/python benchmarks/bench_l1.py`` (defaults take well under a minute).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import psutil
import torch

from kvtier.l1.store import L1Store
from kvtier.units import parse_size

SHAPE = (30, 2, 256, 3, 64)  # SmolLM2-135M: 30 layers, K and V, 256 tokens, 3 KV heads, head dim 64
MB = 1_000_000
MIB = 1 << 20


def size_bytes(text: str) -> int:
    return int(parse_size(text, "B"))


def _sources(num: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=gen, dtype=torch.float32) for _ in range(num)]


def _slot_tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.float32).view(SHAPE)


def bandwidth(args: argparse.Namespace) -> dict:
    chunk_bytes = torch.empty(SHAPE).nbytes
    sources = _sources(args.num_sources)
    out = torch.empty(SHAPE)
    out.zero_()
    store = L1Store(args.bw_budget_bytes, policy=args.policy)
    if args.chunks_per_round * chunk_bytes > store.capacity_bytes:
        raise SystemExit("--chunks-per-round chunks must fit in --bw-budget-bytes")
    baseline_slots = [torch.empty(SHAPE) for _ in range(args.chunks_per_round)]
    for t in baseline_slots:
        t.zero_()  # touch the pages, as the arena's are touched after the warm-up round
    round_no = 0

    def l1_store(key, src) -> float:
        t0 = time.perf_counter()
        view = store.reserve(key, chunk_bytes)
        assert view is not None, "reserve failed with nothing pinned: a bug"
        _slot_tensor(view).copy_(src)
        store.commit(key)
        return time.perf_counter() - t0

    def l1_retrieve(key) -> float:
        t0 = time.perf_counter()
        view, _, at = store.acquire(key)
        out.copy_(_slot_tensor(view))
        store.release(key, at)
        return time.perf_counter() - t0

    def torch_copy(dst, src) -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    pairs: dict[str, list[tuple[float, float]]] = {"store": [], "retrieve": []}  # (L1 s, torch s)

    def one_round(record: bool) -> None:
        """Store then retrieve one round of chunks through L1 and through plain torch copies.

        L1 and torch alternate chunk by chunk (who goes first alternates too, since the second copy
        finds the source warm in the CPU cache), so each (L1, torch) pair sees the same load from
        other processes; the ratio is the median over pairs."""
        nonlocal round_no
        for j in range(args.chunks_per_round):  # untimed: ARC/S3-FIFO would rather evict the new,
            store.remove((round_no, j))  # once-used keys, and every measured chunk must stay resident
        round_no += 1
        keys = [(round_no, j) for j in range(args.chunks_per_round)]
        for j, key in enumerate(keys):
            src = sources[j % len(sources)]
            if j % 2:
                pair = l1_store(key, src), torch_copy(baseline_slots[j], src)
            else:
                pair = tuple(reversed((torch_copy(baseline_slots[j], src), l1_store(key, src))))
            if record:
                pairs["store"].append(pair)
        for j, key in enumerate(keys):
            if j % 2:
                pair = l1_retrieve(key), torch_copy(out, baseline_slots[j])
            else:
                pair = tuple(reversed((torch_copy(out, baseline_slots[j]), l1_retrieve(key))))
            if record:
                pairs["retrieve"].append(pair)

    # Warm-up: fill the whole arena once so that the measured rounds reuse touched pages, as a
    # long-running L1 does (the baseline tensors were touched above).
    for _ in range(-(-store.capacity_bytes // (args.chunks_per_round * chunk_bytes)) + 1):
        one_round(record=False)
    for _ in range(args.rounds):
        one_round(record=True)
    view, _, at = store.acquire((round_no, args.chunks_per_round - 1))
    assert torch.equal(_slot_tensor(view), sources[(args.chunks_per_round - 1) % len(sources)]), "wrong bytes"
    store.release((round_no, args.chunks_per_round - 1), at)

    def gbps(side: int, *kinds: str) -> float:
        times = [p[side] for kind in kinds for p in pairs[kind]]
        return chunk_bytes * len(times) / sum(times) / 1e9

    def ratio(*kinds: str) -> float:
        return statistics.median(p[1] / p[0] for kind in kinds for p in pairs[kind])

    result = {
        "chunk_bytes": chunk_bytes,
        "l1_store_gbps": gbps(0, "store"),
        "l1_retrieve_gbps": gbps(0, "retrieve"),
        "l1_gbps": gbps(0, "store", "retrieve"),
        "torch_store_gbps": gbps(1, "store"),
        "torch_retrieve_gbps": gbps(1, "retrieve"),
        "torch_gbps": gbps(1, "store", "retrieve"),
        "store_ratio": ratio("store"),
        "retrieve_ratio": ratio("retrieve"),
        "ratio": ratio("store", "retrieve"),
    }
    store.close()
    return result


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM, which ru_maxrss reports) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(args: argparse.Namespace) -> dict:
    """Run in a fresh process: ru_maxrss is a lifetime high-water mark."""
    proc = psutil.Process()
    chunk_bytes = torch.empty(SHAPE).nbytes
    sources = _sources(args.num_sources)
    hwm_reset = _reset_peak_rss()
    base_rss = proc.memory_info().rss
    maxrss_at_base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    budget_bytes = args.budget_bytes
    store = L1Store(budget_bytes, policy=args.policy)
    num_chunks = args.churn_factor * budget_bytes // chunk_bytes
    peak_rss = base_rss
    t0 = time.perf_counter()
    for i in range(num_chunks):
        view = store.reserve(i, chunk_bytes)
        assert view is not None
        _slot_tensor(view).copy_(sources[i % len(sources)])
        store.commit(i)
        assert store.used_bytes <= budget_bytes
        peak_rss = max(peak_rss, proc.memory_info().rss)
    seconds = time.perf_counter() - t0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    result = {
        "budget_bytes": budget_bytes,
        "written_bytes": num_chunks * chunk_bytes,
        "num_chunks": num_chunks,
        "resident_chunks": store.num_chunks,
        "seconds": seconds,
        "rss_peak_minus_base_bytes": peak_rss - base_rss,
        # ru_maxrss is the process's high-water mark, reset to the baseline above where the kernel
        # allows it; otherwise it may predate the baseline and this is an upper bound.
        "maxrss_peak_minus_base_bytes": maxrss - base_rss,
        # False when the reset failed or ru_maxrss already exceeded the baseline (inherited at fork)
        "maxrss_reset": hwm_reset and maxrss_at_base <= base_rss + 8 * MIB,
    }
    store.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="LRU", help="eviction policy: LRU, ARC, S3FIFO")
    parser.add_argument("--chunks-per-round", type=int, default=32, help="chunks stored then retrieved per round")
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds of each (after one warm-up)")
    parser.add_argument("--num-sources", type=int, default=8, help="distinct source chunks (defeat CPU caches)")
    parser.add_argument("--bw-budget-bytes", type=size_bytes, default="512MiB",
                        help="L1 budget for the bandwidth part (bytes, or a size: 512MiB)")
    parser.add_argument("--budget-bytes", type=size_bytes, default="512MB",
                        help="L1 budget for the memory part (bytes, or a size: 512MB)")
    parser.add_argument("--churn-factor", type=int, default=10, help="write this many budgets of chunks")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for every copy (1: stable figures on a shared machine)")
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(peak_memory(args)))
        return

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, policy {args.policy}, "
          f"chunk shape {SHAPE} float32")
    if not args.skip_memory:
        # First, while this process is small: Linux carries the parent's RSS at fork into the
        # child's ru_maxrss (kept across exec), which would hide the child's own peak.
        cmd = [sys.executable, __file__, "--memory-child", "--policy", args.policy,
               "--budget-bytes", str(args.budget_bytes), "--churn-factor", str(args.churn_factor),
               "--num-sources", str(args.num_sources), "--threads", str(args.threads)]
        child = subprocess.run(cmd, capture_output=True, text=True, check=True)
        mem = json.loads(child.stdout.strip().splitlines()[-1])
        rss_megabytes = mem["rss_peak_minus_base_bytes"] / MB
        maxrss_megabytes = mem["maxrss_peak_minus_base_bytes"] / MB
        limit_megabytes = mem["budget_bytes"] / MB + 300
        worst = max(rss_megabytes, maxrss_megabytes)
        verdict = "PASS" if worst <= limit_megabytes else "ABOVE TARGET"
        print(f"  wrote {mem['written_bytes'] / MB:.0f} MB in {mem['num_chunks']} chunks "
              f"({mem['written_bytes'] / mem['seconds'] / 1e9:.2f} GB/s incl. eviction), "
              f"{mem['resident_chunks']} chunks resident at the end")
        print(f"SUMMARY memory: peak - baseline = {rss_megabytes:.0f} MB (RSS sampled), {maxrss_megabytes:.0f} MB (ru_maxrss"
              f"{'' if mem['maxrss_reset'] else ', peak predates the baseline: upper bound'}); "
              f"budget {mem['budget_bytes'] / MB:.0f} MB, ratio {worst / (mem['budget_bytes'] / MB):.2f}x budget "
              f"(target <= budget + 300 MB = {limit_megabytes:.0f} MB: {verdict})")

    if not args.skip_bandwidth:
        bw = bandwidth(args)
        print(f"  chunk {bw['chunk_bytes'] / MIB:.2f} MiB, {args.chunks_per_round} chunks/round, "
              f"{args.rounds} rounds, L1 budget {args.bw_budget_bytes / MIB:g} MiB")
        print(f"  L1Store : store {bw['l1_store_gbps']:.2f} GB/s, retrieve {bw['l1_retrieve_gbps']:.2f} GB/s")
        print(f"  torch   : store {bw['torch_store_gbps']:.2f} GB/s, retrieve {bw['torch_retrieve_gbps']:.2f} GB/s")
        print(f"  ratio   : store {bw['store_ratio']:.2f}x, retrieve {bw['retrieve_ratio']:.2f}x (median over pairs)")
        verdict = "PASS" if bw["ratio"] >= 0.8 else "BELOW TARGET"
        print(f"SUMMARY bandwidth: L1Store store+retrieve {bw['l1_gbps']:.2f} GB/s vs torch copy_ "
              f"{bw['torch_gbps']:.2f} GB/s, ratio {bw['ratio']:.2f}x (target >= 0.8x: {verdict})")

if __name__ == "__main__":
    main()
