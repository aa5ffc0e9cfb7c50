"""Per-client bounds (issue 9 §3): no client input exhausts the server. Each hostile client is a raw DEALER
speaking the real protocol; an honest ``Client`` checks the server still serves everyone else."""

from __future__ import annotations

import re

import httpx
import pytest
import torch
from support.raw import Raw
from support.server import CHUNK, CHUNK_BYTES, LAYOUT, ServerProc, metric_value, wait_for

from kvtier import protocol as P
from kvtier.client import Client
from kvtier.errors import ProtocolError


def kv_for(tokens, seed):
    return torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(seed))


def tokens_of(i: int, num_chunks: int = 1) -> list[int]:
    return list(range(i * 100_000, i * 100_000 + num_chunks * CHUNK))


def test_one_client_cannot_keep_l1_reserved(tmp_path):
    share = {"server": {"max_reserved_fraction_per_client": 0.25}}  # the default, which tests/support lifts
    with ServerProc(tmp_path, l1=f"{16 * CHUNK_BYTES}B", config=share) as server, \
            Client(server.url, model="m", layout=LAYOUT) as honest:
        hostile = Raw(server.url)
        refused = None
        for i in range(16):  # store after store, never committing
            reply = hostile.ask(P.StoreBegin(id=0, tokens=P.pack_tokens(tokens_of(i))))
            if isinstance(reply, P.Error):
                refused = reply
                break
        assert refused is not None and refused.code == "limit_exceeded"
        assert "max_reserved_fraction_per_client" in refused.message
        assert i == 4  # a quarter of L1 (the default share)
        mine = tokens_of(50, 4)  # its own quarter
        kv = kv_for(mine, 1)
        assert honest.store(mine, kv) == 4
        out, n = honest.retrieve(mine)
        assert n == 4 * CHUNK and torch.equal(out, kv)
        assert metric_value(server.metrics_text(), "kvtier_client_limit_exceeded_total", limit="reserved_bytes") == 1
        hostile.close()


def test_live_leases_are_bounded_and_expiries_are_logged_sparingly(tmp_path):
    config = {"server": {"max_leases_per_client": 5}}
    # the 8 requests must all come before the first 5 leases end: 3 s of the machine's time for them, not 1 s
    with ServerProc(tmp_path, l1="1MB", lease_seconds=3, config=config) as server, \
            Client(server.url, model="m", layout=LAYOUT) as honest:
        stored = tokens_of(1, 2)
        assert honest.store(stored, kv_for(stored, 2)) == 2
        hostile = Raw(server.url)
        replies = [hostile.ask(P.RetrieveBegin(id=0, tokens=P.pack_tokens(stored))) for _ in range(8)]
        assert [type(r).__name__ for r in replies] == ["RetrieveSlots"] * 5 + ["Error"] * 3
        assert replies[-1].code == "limit_exceeded" and "max_leases_per_client" in replies[-1].message
        wait_for(lambda: server.status()["leases"]["retrieve"] == 0, what="the leases to expire")
        # the leases ended: new ones are accepted; their expiry is counted, the log says so once per interval
        replies = [hostile.ask(P.RetrieveBegin(id=0, tokens=P.pack_tokens(stored))) for _ in range(5)]
        assert all(isinstance(r, P.RetrieveSlots) for r in replies)
        wait_for(lambda: server.status()["leases"]["retrieve"] == 0, what="the leases to expire")
        assert metric_value(server.metrics_text(), "kvtier_lease_expired_total", kind="retrieve") == 10
        lines = [line for line in server.log().splitlines() if re.search(r"retrieve lease \d+ expired", line)]
        assert 1 <= len(lines) <= 2, lines
        hostile.close()


def test_requests_in_flight_are_bounded(tmp_path):
    slow = {"type": "faulty", "inner": {"type": "memory"}, "latency_seconds": 3, "ops": ["put"]}
    config = {"l2_adapters": [slow], "server": {"max_inflight_requests_per_client": 2}}
    with ServerProc(tmp_path, l1="1MB", config=config) as server, Client(server.url, model="m", layout=LAYOUT) as honest:
        stored = tokens_of(2)
        hostile = Raw(server.url)  # connected first: only the three sends fall within the 3 s write
        assert honest.store(stored, kv_for(stored, 3)) == 1  # the L2 write takes 3 s: flushes wait
        for _ in range(3):
            hostile.send(P.Flush(id=0, timeout_seconds=60))
        refused = hostile.recv()  # the third, answered at once; the first two wait for the L2 write
        assert refused.code == "limit_exceeded" and "max_inflight_requests_per_client" in refused.message
        assert [hostile.recv().done for _ in range(2)] == [True, True]
        assert isinstance(hostile.ask(P.Ping(id=0)), P.Ok)
        hostile.close()


def test_replies_a_client_never_reads_are_bounded(tmp_path):
    num_chunks = 2048  # 4 MiB per retrieve, as frames: more than the socket buffers hold
    config = {"server": {"max_unread_reply_bytes_per_client": 8 << 20, "max_reserved_fraction_per_client": 1.0}}
    with ServerProc(tmp_path, l1="32MB", config=config) as server, \
            Client(server.url, model="m", layout=LAYOUT) as honest:
        big = tokens_of(3, num_chunks)
        assert honest.store(big, kv_for(big, 4)) == num_chunks
        hostile = Raw(server.url, shm=False)
        for _ in range(16):
            hostile.send(P.RetrieveBegin(id=0, tokens=P.pack_tokens(big), shm=False))
        assert honest.ping()  # the server answers others meanwhile
        wait_for(lambda: metric_value(server.metrics_text(), "kvtier_client_limit_exceeded_total",
                                      limit="unread_reply_bytes"), what="unread replies to be refused")
        # all 16 handled before the client reads (reading frees room, and later ones would then go through)
        wait_for(lambda: metric_value(server.metrics_text(), "kvtier_retrieve_chunks_total") == 16 * num_chunks,
                 what="every retrieve to be handled")
        replies = [hostile.recv() for _ in range(16)]
        data = [r for r in replies if isinstance(r, P.RetrieveData)]
        refused = [r for r in replies if isinstance(r, P.Error)]
        assert refused and all(r.code == "limit_exceeded" for r in refused)
        assert "max_unread_reply_bytes_per_client" in refused[0].message
        assert 1 <= len(data) <= 12
        hostile.close()


def test_prompt_length_is_bounded(tmp_path):
    with ServerProc(tmp_path, l1="1MB", config={"server": {"max_prompt_tokens": 4 * CHUNK}}) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        ok, long = tokens_of(4, 4), tokens_of(5, 5)
        assert client.store(ok, kv_for(ok, 5)) == 4
        assert client.lookup(long) == 0 and client.store(long, kv_for(long, 6)) == 0
        raw = Raw(server.url)
        reply = raw.ask(P.Lookup(id=0, tokens=P.pack_tokens(long)))
        assert reply.code == "too_large" and "max_prompt_tokens" in reply.message and str(5 * CHUNK) in reply.message
        raw.close()


def test_idle_caches_are_dropped(tmp_path):
    with ServerProc(tmp_path, l1="1MB") as server, Client(server.url, model="keep", layout=LAYOUT) as kept:
        for i in range(20):
            with Client(server.url, model=f"model-{i}", layout=LAYOUT) as client:
                tokens = tokens_of(i)
                assert client.store(tokens, kv_for(tokens, i)) == 1
        assert server.status()["caches"] == 1  # only the connected client's
        assert kept.lookup(tokens_of(0)) == 0  # another model's chunks stay apart
        with Client(server.url, model="model-0", layout=LAYOUT) as again:
            assert again.lookup(tokens_of(0)) == CHUNK  # the chunks outlived their cache object


def test_identities_are_bounded_and_so_is_what_the_server_keeps_of_them(tmp_path):
    """Issue 38 finding 2: a model id or namespace of any length was accepted (up to the 64 MiB header) and kept by
    the management API's list of caches after its session ended. Both are bounded, and so is that list's memory."""
    bounds = {"server": {"max_model_id_bytes": 64, "max_namespace_bytes": 48, "known_caches_max_bytes": 8 * 1024}}
    with ServerProc(tmp_path, l1="1MB", config=bounds) as server:
        for kwargs, key in (({"model": "m" * 65}, "max_model_id_bytes"), ({"model": "é" * 33}, "max_model_id_bytes"),
                            ({"model": "m", "namespace": "n" * 49}, "max_namespace_bytes")):
            with pytest.raises(ProtocolError, match=rf"exceeds server\.{key} \("):
                Client(server.url, layout=LAYOUT, **kwargs)
        with Client(server.url, model="m" * 64, layout=LAYOUT, namespace="n" * 48) as client:  # at the bounds
            tokens = tokens_of(1)
            assert client.store(tokens, kv_for(tokens, 1)) == 1
            assert client.lookup(tokens, namespace="x" * 49) == 0  # a request's namespace too
            raw = Raw(server.url)
            reply = raw.ask(P.Lookup(id=0, tokens=P.pack_tokens(tokens), namespace="x" * 49))
            assert reply.code == "too_large" and "server.max_namespace_bytes (48)" in reply.message
            raw.close()
            assert metric_value(server.metrics_text(), "kvtier_client_limit_exceeded_total", limit="namespace_bytes") == 2
        for i in range(40):  # each cache forgotten when its session ends, but still known to the management API
            with Client(server.url, model=f"model-{i:02d}-" + "m" * 50, layout=LAYOUT) as client:
                assert client.ping()
        def lookup(i: int) -> int:
            body = {"model": f"model-{i:02d}-" + "m" * 50, "tokens": tokens_of(1)}
            return httpx.post(server.admin + "/cache/lookup", json=body).status_code

        assert lookup(39) == 200  # the newest is known
        assert lookup(0) == 404  # 40 of ~1.1 KiB each do not fit in 8 KiB: the oldest went first
