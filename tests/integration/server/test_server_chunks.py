"""The client's zero-copy chunk API (store_chunks / retrieve_chunks) over shared memory and over frames, and
the connector's direct copies between vLLM CPU's paged blocks and chunk arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.server import CHUNK, LAYOUT, ServerProc

from kvtier.client import Client
from kvtier.connectors.vllm_layout import (
    block_views,
    gather_chunk,
    scatter_chunk,
)
from kvtier.errors import InputError
from kvtier.tensors import as_torch


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProc(tmp_path_factory.mktemp("chunks")) as srv:
        yield srv


def kv_for(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.chunk_shape(n), generator=g, dtype=torch.float32)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "frames"])
def test_store_chunks_fills_only_missing_chunks_and_retrieve_chunks_reads_them(server, shm):
    tokens = list(range(500 + 5000 * shm, 500 + 5000 * shm + 3 * CHUNK))
    kv = kv_for(len(tokens), seed=3 + shm)
    with Client(server.url, model="chunks", layout=LAYOUT, shared_memory=shm, prefault=True) as client:
        assert client.store(tokens[:CHUNK], kv[:, :, :CHUNK]) == 1
        asked = []

        def fill(start, dst):
            asked.append((start, dst.shape))
            dst[...] = kv[:, :, start:start + dst.shape[2]].numpy()

        assert client.store_chunks(tokens, fill) == 2
        assert asked == [(CHUNK, LAYOUT.chunk_shape(CHUNK)), (2 * CHUNK, LAYOUT.chunk_shape(CHUNK))]
        with client.retrieve_chunks(tokens) as got:
            assert got.num_tokens == 3 * CHUNK
            assert [start for start, _ in got.chunks] == [0, CHUNK, 2 * CHUNK]
            for start, view in got.chunks:
                assert not view.flags.writeable
                assert np.array_equal(view, kv[:, :, start:start + CHUNK].numpy())
        assert got.ok and got.chunks == []


def test_a_failing_fill_aborts_the_reservation(server):
    tokens = list(range(20000, 20000 + 2 * CHUNK))
    kv = kv_for(len(tokens), seed=9)
    with Client(server.url, model="chunks-abort", layout=LAYOUT) as client:
        def broken(start, dst):
            raise RuntimeError("engine went away")

        with pytest.raises(RuntimeError, match="engine went away"):
            client.store_chunks(tokens, broken)
        assert client.lookup(tokens) == 0  # nothing half-written became visible
        assert client.store(tokens, kv) == 2  # and the chunks can be stored afterwards
        out, n = client.retrieve(tokens)
        assert n == 2 * CHUNK and torch.equal(out, kv)


def test_retrieve_chunks_on_a_miss_yields_nothing(server):
    with Client(server.url, model="chunks-miss", layout=LAYOUT) as client:
        with client.retrieve_chunks(list(range(1, 1 + CHUNK))) as got:
            assert got.num_tokens == 0 and got.chunks == []
        assert not got.ok


def paged(num_blocks: int, block_size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, LAYOUT.num_kv_heads, block_size, 2 * LAYOUT.head_dim, generator=g)
            for _ in range(LAYOUT.num_layers)]


@pytest.mark.parametrize("block_size", [CHUNK, CHUNK // 2])
def test_gather_and_scatter_chunk_match_the_layer_copies(block_size):
    src = paged(8, block_size, seed=1)
    ids = [5, 2, 7, 0] if block_size < CHUNK else [6, 3]
    ids = ids[:CHUNK // block_size * 2]
    out = torch.empty(LAYOUT.chunk_shape(2 * CHUNK))
    for c in range(2):
        per_chunk = CHUNK // block_size
        gather_chunk(block_views(src), ids[c * per_chunk:], out[:, :, c * CHUNK:(c + 1) * CHUNK])
    want = torch.empty_like(out)
    for i in range(LAYOUT.num_layers):
        block_views(src).gather_layer(i, ids, want[i])
    assert torch.equal(out, want)
    dst = paged(8, block_size, seed=2)
    before = [layer.clone() for layer in dst]
    targets = [1, 4, 3, 6][:len(ids)]
    per_chunk = CHUNK // block_size
    # the first block of chunk 0 is skipped (vLLM's own prefix cache has it): only [block_size, CHUNK) loads
    scatter_chunk(block_views(dst), targets[1:per_chunk], out[:, :, :CHUNK], block_size, CHUNK)
    scatter_chunk(block_views(dst), targets[per_chunk:], out[:, :, CHUNK:], 0, CHUNK)
    for layer, (d, s, b) in enumerate(zip(dst, src, before)):
        for t, i in zip(targets[1:], ids[1:]):
            assert torch.equal(d[t], s[i])
        assert torch.equal(d[targets[0]], b[targets[0]])  # not asked for: untouched
        untouched = [k for k in range(8) if k not in targets]
        assert torch.equal(d[untouched], b[untouched])


def test_scatter_chunk_refuses_an_unaligned_range():
    dst = paged(4, CHUNK // 2, seed=3)
    with pytest.raises(InputError, match="not whole"):
        scatter_chunk(block_views(dst), [0, 1], torch.zeros(LAYOUT.chunk_shape(CHUNK)), 1, CHUNK)


def test_as_torch_views_bf16_bytes_without_copy():
    kv = torch.randn(2, 3).to(torch.bfloat16)
    arr = kv.view(torch.int16).numpy()
    t = as_torch(arr, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and torch.equal(t, kv) and t.data_ptr() == kv.data_ptr()
