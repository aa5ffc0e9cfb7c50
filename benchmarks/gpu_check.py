"""The GPU check of kvtier's vLLM data path (issue 41): paged KV on the device <-> a real ``kvtier server``'s L1.

Needs torch and kvtier's own dependencies only (``scripts/gpu-check.sh`` brings those as wheels): no vLLM, no
network. On a machine without CUDA the same stores and loads run on CPU tensors and the timings are skipped.

1. Bit-exact, every CUDA attention backend x ``KVCacheLayout`` x KV dtype (bf16, fp8): KV caches laid out as vLLM
   allocates them (``vllm_cuda_layouts.allocate_paged``) on the device, random bytes; ``--chunks`` chunks stored
   through the server (``store_chunks``, the fill gathers from the blocks into the L1 slot), loaded into the cache of
   another backend and layout of the same packing (``retrieve_chunks`` + scatter), gathered again: equal bytes.
2. GB/s (CUDA), Llama-3-8B shape (32 layers x 8 KV heads x 128, bf16, 256-token chunks; MLA: 61 x 576), 32 chunks:
   device -> L1 (the fills of one ``store_chunks``) and L1 -> device (the scatters inside one ``retrieve_chunks``, up
   to the last scatter's end), each against a plain ``copy_(non_blocking=True)`` of the same bytes between the device
   and a pinned host buffer, in the same run; whole calls (with the server round trips) too. Best of ``--repeat``.
3. Hold (CUDA): how much longer compute-stream work issued right after one load of 32 chunks takes than alone, as a
   share of that load's own copy time: (a) the copy path alone (``wait_host=False``: the check holds the L1 pins
   until the copies end), (b) as the connector loads today (the host waits for each chunk's DMA before the slot is
   unpinned).

    bash scripts/gpu-check.sh [--chunks 32] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from kvtier_harness.kvtier_server import ServerProcess

from kvtier.client import Client
from kvtier.connectors.device_copy import DeviceCopier
from kvtier.connectors.vllm_cuda_layouts import ATTENTION_BACKENDS, KV_CACHE_LAYOUTS, PagedKV, allocate_paged, raw_dtype
from kvtier.layout import KVLayout
from kvtier.tensors import as_torch

SHAPES = {"kv": (32, 8, 128), "latent": (61, 1, 576)}  # Llama-3-8B; DeepSeek-V3's MLA latent
QUICK_SHAPES = {"kv": (4, 2, 64), "latent": (4, 1, 96)}
DTYPES = {"bfloat16": (torch.bfloat16, "bfloat16"), "fp8": (torch.uint8, "float8_e4m3fn")}


class Setup:
    """One server, one client per layout, caches on ``device``."""

    def __init__(self, args, device: torch.device, log_dir: Path):
        self.args, self.device = args, device
        self.shapes = QUICK_SHAPES if args.quick else SHAPES
        self.chunk_tokens = 128 if args.quick else 256  # a multiple of every backend's block size
        l1 = "1GB" if args.quick else "8GB"
        config = {"server": {"max_reserved_fraction_per_client": 1.0, "max_reserved_fraction_per_principal": 1.0,
                             "max_reserved_fraction_all_clients": 1.0}}
        self.server = ServerProcess(log_dir, self.chunk_tokens, l1, config=config)
        self.clients: dict[str, Client] = {}
        self.prompt = 0

    def client(self, layout: KVLayout) -> Client:
        key = layout.layout_id
        if key not in self.clients:
            self.clients[key] = Client(self.server.url, model="gpu-check", layout=layout, timeout_seconds=60)
        return self.clients[key]

    def tokens(self, chunks: int) -> list[int]:
        """A new prompt: never stored before (stores are deduplicated by prefix)."""
        self.prompt += 1
        return [self.prompt] + list(range(chunks * self.chunk_tokens - 1))

    def paged(self, name: str, kv_cache_layout: str, dtype: str, chunks: int, fill: bool = False):
        """A cache of ``chunks`` chunks in the backend's smallest block size (16, or its fixed size), its layout and
        its client."""
        backend = ATTENTION_BACKENDS[name]
        layers, heads, head_dim = self.shapes[backend.packing]
        torch_dtype, kv_dtype = DTYPES[dtype]
        layout = KVLayout(layers, heads, head_dim, kv_dtype, latent=backend.packing == "latent")
        block_size = min([*backend.block_sizes, *backend.block_multiples])
        caches = allocate_paged(layout, backend, kv_cache_layout, chunks * self.chunk_tokens // block_size, block_size,
                                device=self.device, cache_dtype=torch_dtype)
        if fill:  # random bytes in every block (the device's own generator: fast on a GPU)
            torch.tensor([], dtype=torch.uint8, device=self.device).set_(caches[0].untyped_storage()).random_(0, 256)
        client = self.client(layout)
        copier = DeviceCopier(self.device, host_memory=lambda: client.shared_memory)
        return PagedKV(caches, name, layout, block_size, copier=copier), layout, client

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.server.stop()


def store(paged: PagedKV, client: Client, tokens: list[int], block_ids: list[int], spent: list) -> int:
    """As the connector stores: one ``store_chunks``, whose fill gathers each chunk into its L1 slot (timed)."""
    def fill(start: int, dst) -> None:
        began = time.perf_counter()
        paged.gather_chunk(block_ids[start // paged.block_size:], as_torch(dst, raw_dtype(dst.dtype.itemsize)))
        spent.append(time.perf_counter() - began)

    return client.store_chunks(tokens, fill)


def load(paged: PagedKV, client: Client, tokens: list[int], block_ids: list[int], wait_host: bool = True) -> int:
    """As the connector loads: one ``retrieve_chunks``, a scatter per chunk (the host waits for each DMA unless
    ``wait_host`` is False: then until the last copy is done, before the pins end)."""
    with client.retrieve_chunks(tokens) as got:
        for start, view in got.chunks:
            chunk = as_torch(view, raw_dtype(view.dtype.itemsize))
            paged.scatter_chunk(block_ids[start // paged.block_size:], chunk, 0, chunk.shape[2], wait_host=wait_host)
        if not wait_host:
            paged.copier.synchronize()
    return got.num_tokens if got.ok else 0


def bit_exact(setup: Setup, chunks: int) -> tuple[int, int]:
    """Every backend x layout x dtype: store from one, load into the next of the same packing, compare."""
    gen = torch.Generator().manual_seed(0)  # block ids; the KV bytes come from the device's generator
    names, layouts = list(ATTENTION_BACKENDS), list(KV_CACHE_LAYOUTS)
    ok = total = 0
    for name in names:
        same = [n for n in names if ATTENTION_BACKENDS[n].packing == ATTENTION_BACKENDS[name].packing]
        other = same[(same.index(name) + 1) % len(same)]
        for i, kv_cache_layout in enumerate(layouts):
            for dtype in DTYPES:
                if dtype == "fp8" and not all("fp8" in ATTENTION_BACKENDS[n].kv_cache_dtypes for n in (name, other)):
                    continue
                src, layout, client = setup.paged(name, kv_cache_layout, dtype, chunks + 1, fill=True)
                dst, _, _ = setup.paged(other, layouts[(i + 1) % len(layouts)], dtype, chunks + 2)
                tokens = setup.tokens(chunks)
                src_ids, dst_ids = (shuffled(p, chunks * setup.chunk_tokens, gen) for p in (src, dst))
                stored = store(src, client, tokens, src_ids, [])
                loaded = load(dst, client, tokens, dst_ids)
                want = torch.empty(layout.chunk_shape(len(tokens)), dtype=raw_dtype(layout.element_size))
                got = torch.empty_like(want)
                src.gather_chunk(src_ids, want)
                dst.wait_loaded()
                dst.gather_chunk(dst_ids, got)
                same_bytes = stored == chunks and loaded == len(tokens) and torch.equal(want, got)
                ok += same_bytes
                total += 1
                if not same_bytes:
                    print(f"  NOT EXACT: {name} {kv_cache_layout} -> {other}, {dtype}: stored {stored}, loaded {loaded}")
    return ok, total


def shuffled(paged: PagedKV, tokens: int, gen: torch.Generator) -> list[int]:
    """Distinct random block ids of ``paged`` holding ``tokens`` tokens."""
    blocks = paged.views[0].shape[1]
    return torch.randperm(blocks, generator=gen)[:tokens // paged.block_size].tolist()


def timings(setup: Setup, chunks: int, repeat: int) -> None:
    """GB/s against a pinned copy of the same bytes, and the compute-stream hold of one load (CUDA only)."""
    gen = torch.Generator().manual_seed(1)
    for name, kv_cache_layout in [("FLASH_ATTN", lay) for lay in KV_CACHE_LAYOUTS] + [("FLASHMLA", "LBNHC")]:
        src, layout, client = setup.paged(name, kv_cache_layout, "bfloat16", chunks, fill=True)
        dst, _, _ = setup.paged(name, kv_cache_layout, "bfloat16", chunks)
        ids = shuffled(src, chunks * setup.chunk_tokens, gen)
        nbytes = layout.chunk_bytes(chunks * setup.chunk_tokens)
        per_chunk = layout.chunk_bytes(setup.chunk_tokens)
        device_buf = torch.empty(chunks, per_chunk, dtype=torch.uint8, device=setup.device)
        pinned = torch.empty(chunks, per_chunk, dtype=torch.uint8, pin_memory=True)
        best = {}
        for _ in range(repeat):
            tokens, spent = setup.tokens(chunks), []
            began = time.perf_counter()
            store(src, client, tokens, ids, spent)
            note(best, "store_call", time.perf_counter() - began)
            note(best, "d2l1", sum(spent))
            note(best, "d2h_pinned", timed_sync(lambda: [pinned[i].copy_(device_buf[i], non_blocking=True)
                                                         for i in range(chunks)]))
            began = time.perf_counter()
            load(dst, client, tokens, ids)
            dst.wait_loaded()
            torch.cuda.synchronize()
            note(best, "l12d", time.perf_counter() - began)
            note(best, "h2d_pinned", timed_sync(lambda: [device_buf[i].copy_(pinned[i], non_blocking=True)
                                                         for i in range(chunks)]))
        gb = nbytes / 1e9
        print(f"{name:10} {kv_cache_layout}: {gb:.2f} GB; device->L1 {gb / best['d2l1']:6.1f} GB/s vs pinned copy_ "
              f"{gb / best['d2h_pinned']:6.1f} ({best['d2h_pinned'] / best['d2l1']:.2f}x; whole store call "
              f"{gb / best['store_call']:.1f}); L1->device {gb / best['l12d']:6.1f} GB/s vs pinned copy_ "
              f"{gb / best['h2d_pinned']:6.1f} ({best['h2d_pinned'] / best['l12d']:.2f}x); L1 registered: "
              f"{src.copier.registered}", flush=True)
        if name == "FLASH_ATTN" and kv_cache_layout == "LBNHC":
            hold(setup, dst, client, ids, chunks)


def hold(setup: Setup, dst: PagedKV, client: Client, ids: list[int], chunks: int) -> None:
    """Compute-stream work issued right after one load of ``chunks`` chunks, against the same work alone."""
    tokens = setup.tokens(chunks)
    store(dst, client, tokens, ids, [])
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=setup.device)
    per = timed_events(lambda: a @ a)
    copy = timed_events(lambda: load(dst, client, tokens, ids), side=dst)
    count = max(1, int(2 * copy / per))

    def work():
        for _ in range(count):
            a @ a

    alone = timed_events(work)
    for label, wait_host in (("copy path, pins held past the copies", False),
                             ("as the connector loads today, the host waiting for each chunk's DMA", True)):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        with client.retrieve_chunks(tokens) as got:
            for start, view in got.chunks:
                chunk = as_torch(view, raw_dtype(view.dtype.itemsize))
                dst.scatter_chunk(ids[start // dst.block_size:], chunk, 0, chunk.shape[2], wait_host=wait_host)
            work()  # the next forward pass: it reads the loaded KV only at its end
            dst.wait_loaded()
            ended.record()
            dst.copier.synchronize()  # the pins end with this block
        torch.cuda.synchronize()
        held = max(0.0, began.elapsed_time(ended) / 1e3 - alone)
        print(f"hold ({label}): compute work issued after one load of {chunks} chunks ends {held * 1e3:.2f} ms later "
              f"than alone = {held / copy:.1%} of the load's own copy time ({copy * 1e3:.2f} ms)", flush=True)


def note(best: dict, key: str, seconds: float) -> None:
    best[key] = min(best.get(key, float("inf")), seconds)


def timed_sync(fn) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def timed_events(fn, side: PagedKV | None = None) -> float:
    """Seconds ``fn`` keeps the compute stream (or ``side``'s copy stream) busy, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    stream = side.copier.stream if side is not None else torch.cuda.current_stream()
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began.record(stream)
    fn()
    ended.record(stream)
    torch.cuda.synchronize()
    return began.elapsed_time(ended) / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small model shapes (CI on CPU)")
    args = parser.parse_args()
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (no CUDA: timings skipped)'}; torch {torch.__version__}")
    ok, total = 0, 1
    with tempfile.TemporaryDirectory() as tmp:
        setup = Setup(args, device, Path(tmp))
        try:
            ok, total = bit_exact(setup, 2)
            print(f"bit-exact: {ok} of {total} backend x layout x dtype round trips through the kvtier server", flush=True)
            if cuda:
                timings(setup, args.chunks, args.repeat)
        finally:
            setup.close()
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
