"""Store / lookup / retrieve through a real server, over shared memory and over frames, bytes verified."""

from __future__ import annotations

import pytest
import torch
from support.server import CHUNK, LAYOUT, ServerProc

from kvtier.layout import KVLayout
from kvtier.client import Client


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProc(tmp_path_factory.mktemp("roundtrip")) as srv:
        yield srv


def kv_for(n: int, seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.chunk_shape(n), generator=g, dtype=torch.float32)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "frames"])
def test_round_trip_returns_the_stored_bytes(server, shm):
    with Client(server.url, model="rt", layout=LAYOUT, shared_memory=shm) as client:
        assert client.uses_shared_memory is shm
        tokens = list(range(100 + 1000 * shm, 100 + 1000 * shm + 3 * CHUNK + 5))  # 3 full chunks + a partial tail
        kv = kv_for(len(tokens), seed=int(shm))
        assert client.lookup(tokens) == 0
        assert client.store(tokens, kv) == 3
        assert client.store(tokens, kv) == 0  # already there: nothing new
        assert client.lookup(tokens) == 3 * CHUNK
        out, n = client.retrieve(tokens)
        assert n == 3 * CHUNK and out.shape == LAYOUT.chunk_shape(n) and out.dtype == torch.float32
        assert torch.equal(out, kv[:, :, :n])
        # a longer prompt with the same prefix hits the stored chunks only
        longer = tokens + list(range(9000, 9000 + 2 * CHUNK))
        assert client.lookup(longer) == 3 * CHUNK
        out, n = client.retrieve(longer)
        assert n == 3 * CHUNK and torch.equal(out, kv[:, :, :n])


def test_one_client_stores_through_shm_another_reads_frames(server):
    tokens = list(range(7000, 7000 + 4 * CHUNK))
    kv = kv_for(len(tokens), seed=11)
    with Client(server.url, model="share", layout=LAYOUT) as writer, \
            Client(server.url, model="share", layout=LAYOUT, shared_memory=False) as reader:
        assert writer.uses_shared_memory and not reader.uses_shared_memory
        assert writer.store(tokens[: 2 * CHUNK], kv[:, :, : 2 * CHUNK]) == 2
        assert reader.store(tokens, kv) == 2  # only the two chunks the writer did not store
        out, n = reader.retrieve(tokens)
        assert n == 4 * CHUNK and torch.equal(out, kv)
        out, n = writer.retrieve(tokens)
        assert n == 4 * CHUNK and torch.equal(out, kv)


def test_model_layout_and_namespace_isolate_kv(server):
    tokens = list(range(3000, 3000 + 2 * CHUNK))
    kv = kv_for(len(tokens), seed=5)
    half = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    with Client(server.url, model="iso", layout=LAYOUT) as base, \
            Client(server.url, model="iso", layout=LAYOUT, namespace="lora=a") as lora, \
            Client(server.url, model="other", layout=LAYOUT) as other, \
            Client(server.url, model="iso", layout=half) as bf16:
        assert base.store(tokens, kv) == 2
        assert base.lookup(tokens) == 2 * CHUNK
        assert lora.lookup(tokens) == 0 and other.lookup(tokens) == 0 and bf16.lookup(tokens) == 0
        assert base.lookup(tokens, namespace="lora=a") == 0  # per-call namespace override
        kv16 = kv.to(torch.bfloat16)
        assert bf16.store(tokens, kv16) == 2
        out, n = bf16.retrieve(tokens)
        assert n == 2 * CHUNK and out.dtype == torch.bfloat16 and torch.equal(out, kv16)


def test_bad_input_raises_input_error_like_kvcache(server):
    from kvtier.errors import InputError

    with Client(server.url, model="bad", layout=LAYOUT) as client:
        with pytest.raises(InputError, match="shape"):
            client.store(list(range(CHUNK)), kv_for(CHUNK + 1, 0))
        with pytest.raises(InputError, match="non-negative"):
            client.lookup([1, -2, 3])
        assert client.ping()  # the session is still fine


def test_flush_and_clear_by_medium(tmp_path):
    disk = tmp_path / "disk"
    # 300 ms per L2 batch: the flush below is answered later, by the request loop, not at once
    slow = {"type": "faulty", "inner": {"type": "local_disk", "path": str(disk)}, "latency_seconds": 0.3, "ops": ["put"]}
    # clear is a mutation: with no admin token it must be allowed explicitly
    config = {"l2_adapters": [slow], "server": {"allow_unauthenticated_admin": True}}
    with ServerProc(tmp_path, config=config) as server, \
            Client(server.url, model="fl", layout=LAYOUT) as client:
        others = [list(range(s, s + CHUNK)) for s in (10_000, 20_000, 30_000)]
        for other in others:
            assert client.store(other, kv_for(CHUNK, seed=1)) == 1
        tokens = list(range(60, 60 + 3 * CHUNK))
        kv = kv_for(len(tokens), seed=9)
        assert client.store(tokens, kv) == 3
        assert client.flush(30.0) is True
        assert server.status()["l2"][0]["num_records"] == 6  # flushed means written
        assert client.clear("CPU") == 6
        for other in others:
            assert client.lookup(other) == CHUNK
        client.clear("STORAGE")
        assert client.store(tokens, kv) == 3
        assert client.flush(30.0) is True
        assert client.clear("CPU") == 3  # L1 only: L2 still has it
        assert server.status()["l1"]["num_chunks"] == 0
        assert client.lookup(tokens) == 3 * CHUNK
        out, n = client.retrieve(tokens)  # promoted back from L2
        assert n == 3 * CHUNK and torch.equal(out, kv)
        assert client.clear("STORAGE") == 0 and client.lookup(tokens) == 3 * CHUNK  # L1 keeps the promoted copy
        assert client.flush(30.0) is True  # the L2 clear is queued (Client.clear): flush waits for it
        assert server.status()["l2"][0]["num_records"] == 0
        assert client.clear() == 3 and client.lookup(tokens) == 0
        from kvtier.errors import InputError
        with pytest.raises(InputError, match="medium"):
            client.clear("GPU")


def test_a_chunked_prefill_is_hashed_once_by_the_server(server):
    """Issue 38 finding 7, through the server as vLLM's connector drives it: a lookup of the whole 32k-token
    prompt, 16 chunked-prefill stores (long ones hashed by the server's hashing worker), a prefetch and a load."""
    from support.server import metric_value

    def hashed() -> float:
        return metric_value(server.metrics_text(), "kvtier_hashed_tokens_total") or 0.0

    with Client(server.url, model="hash-once", layout=LAYOUT) as client:
        prompt = list(range(5, 5 + 32768))
        kv = kv_for(len(prompt), seed=3)
        before = hashed()
        assert client.lookup(prompt) == 0
        for end in range(2048, len(prompt) + 1, 2048):
            assert client.store(prompt[:end], kv[:, :, :end]) == 2048 // CHUNK
        assert client.lookup(prompt) == len(prompt) and client.prefetch(prompt, wait=True) == len(prompt)
        with client.retrieve_chunks(prompt[:16384]) as got:
            assert got.num_tokens == 16384
        assert len(prompt) <= hashed() - before <= 1.1 * len(prompt)
