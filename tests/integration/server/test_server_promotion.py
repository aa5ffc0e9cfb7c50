"""A server without head-of-line blocking: L2 promotions and prefetches run on a pool with a deadline, lookups
never wait for L2, ``Clear`` does not wait for the write queue. Real ``kvtier server`` processes over a
local_disk L2 wrapped by the fault-injecting adapter (``kvtier.l2.faulty``) to make it slow or hang."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
import zmq
from support.server import CHUNK, LAYOUT, ServerProc, authenticated, metric_value, wait_for

from kvtier import protocol as P
from kvtier.client import Client
from kvtier.proc import host_id
from kvtier.zmq_context import Context

TOKEN = "promotion-admin"
HANG_SECONDS = 3600.0  # an adapter call that never comes back within the test


def faulty(tmp_path: Path, latency_seconds: float, ops: list[str]) -> tuple[str, ...]:
    spec = {"type": "faulty", "inner": {"type": "local_disk", "path": str(tmp_path / "l2")}, "latency_seconds": latency_seconds,
            "ops": ops}
    return ("--l2-adapter", json.dumps(spec))


def server(tmp_path: Path, extra: tuple[str, ...], lease_seconds: float = 30.0, **server_keys) -> ServerProc:
    return ServerProc(tmp_path, token=TOKEN, extra=extra, lease_seconds=lease_seconds,
                      config={"server": server_keys} if server_keys else None)


def prompt(seed: int, num_chunks: int):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, num_chunks * CHUNK).tolist()
    kv = torch.from_numpy(rng.standard_normal(LAYOUT.chunk_shape(len(tokens))).astype(LAYOUT.numpy_dtype()))
    return tokens, kv


def only_in_l2(client: Client, tokens, kv) -> None:
    """Store ``tokens`` and drop them from L1, so only the L2 adapter holds them."""
    assert client.store(tokens, kv) == len(tokens) // CHUNK
    assert client.flush(30)
    assert client.clear("CPU", admin_token=TOKEN) == len(tokens) // CHUNK


class Raw:
    """A bare DEALER that sends a request and reads its reply later (or never)."""

    def __init__(self, url: str):
        self.ctx = Context()
        self.sock = authenticated(self.ctx.socket(zmq.DEALER), url)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        hello = self.ask(P.Hello(id=1, version=P.PROTOCOL_VERSION, model="m", layout=LAYOUT.to_dict(),
                                 layout_id=LAYOUT.layout_id, host_id=host_id()))
        assert isinstance(hello, P.HelloReply), hello

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send(P.encode(msg))

    def recv(self, timeout_seconds: float = 30.0):
        assert self.sock.poll(int(timeout_seconds * 1000)), f"no reply within {timeout_seconds} s"
        return P.decode_reply(self.sock.recv_multipart()[0])

    def ask(self, msg: msgspec.Struct):
        self.send(msg)
        return self.recv()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def counter(srv: ServerProc, name: str, **labels) -> float:
    return metric_value(srv.metrics_text(), name, **labels) or 0.0


def test_hung_adapter_promotion_is_a_miss_after_the_deadline(tmp_path):
    tokens, kv = prompt(1, 3)
    with server(tmp_path, (*faulty(tmp_path, HANG_SECONDS, ["get"]), "--promote-timeout-seconds", "1")) as srv:
        with Client(srv.url, model="m", layout=LAYOUT, timeout_seconds=20) as client:
            only_in_l2(client, tokens, kv)
            assert client.lookup(tokens) == len(tokens)  # from the adapter's index: no get, no wait
            out, n = client.retrieve(tokens)  # the promotion hangs in get: after the deadline, a miss
            assert n == 0
            assert counter(srv, "kvtier_l2_promote_timeouts_total") == 1
            assert client.prefetch(tokens, wait=True) == 0
            assert counter(srv, "kvtier_l2_promote_timeouts_total") == 2
            other, other_kv = prompt(2, 2)  # the server goes on serving L1
            assert client.store(other, other_kv) == 2
            out, n = client.retrieve(other)
            assert n == len(other) and torch.equal(out, other_kv)
        assert srv.status()["promotions"]["waiting"] == 0


def test_a_lookup_completes_while_a_promotion_is_stuck(tmp_path):
    tokens, kv = prompt(3, 2)
    other, other_kv = prompt(4, 2)
    with server(tmp_path, faulty(tmp_path, HANG_SECONDS, ["get"]), promote_timeout_seconds=20.0) as srv:
        with Client(srv.url, model="m", layout=LAYOUT) as client:
            only_in_l2(client, tokens, kv)
            raw = Raw(srv.url)
            try:
                raw.send(P.RetrieveBegin(id=2, tokens=P.pack_tokens(tokens)))
                wait_for(lambda: srv.status()["promotions"]["waiting"] == 1, what="the promotion to start")
                # every request of another client is answered while that promotion hangs in the adapter
                assert client.lookup(tokens) == len(tokens)
                assert client.lookup(other) == 0
                assert client.store(other, other_kv) == 2
                out, n = client.retrieve(other)
                assert n == len(other) and torch.equal(out, other_kv)
                assert client.ping() and client.stats()
                assert srv.status()["promotions"]["waiting"] == 1  # still stuck: nothing above waited for it
                reply = raw.recv()  # the deadline answers it from L1: a miss
                assert isinstance(reply, P.RetrieveSlots) and reply.num_tokens == 0 and reply.ticket == 0
            finally:
                raw.close()


def test_disconnect_during_promotion_leaks_nothing(tmp_path):
    tokens, kv = prompt(5, 2)
    # a 3 s read: the Bye below must come while it runs, however slow this process is to send it
    with server(tmp_path, faulty(tmp_path, 3.0, ["get"]), promote_timeout_seconds=30.0, lease_seconds=1.0) as srv:
        with Client(srv.url, model="m", layout=LAYOUT) as client:
            only_in_l2(client, tokens, kv)
            # a client that says Bye while its promotion runs: the result pins nothing and is not sent
            raw = Raw(srv.url)
            raw.send(P.RetrieveBegin(id=2, tokens=P.pack_tokens(tokens)))
            wait_for(lambda: srv.status()["promotions"]["in_flight"] == 1, what="the promotion to start")
            assert isinstance(raw.ask(P.Bye(id=3)), P.Ok)
            wait_for(lambda: srv.status()["promotions"]["in_flight"] == 0, what="the promotion to finish")
            assert srv.status()["leases"] == {"store": 0, "retrieve": 0}
            assert raw.sock.poll(200) == 0  # no reply to the departed session
            raw.close()
            assert client.lookup(tokens) == len(tokens)  # the promotion itself completed into L1
            assert srv.status()["l1"]["num_chunks"] == 2

            # a client whose socket vanishes mid-promotion: its pins go with the lease
            client.clear("CPU", admin_token=TOKEN)
            raw = Raw(srv.url)
            raw.send(P.RetrieveBegin(id=2, tokens=P.pack_tokens(tokens)))
            wait_for(lambda: srv.status()["promotions"]["in_flight"] == 1, what="the promotion to start")
            raw.close()
            wait_for(lambda: counter(srv, "kvtier_lease_expired_total", kind="retrieve") == 1,
                     what="the departed client's lease to expire")
            status = srv.status()
            assert status["leases"] == {"store": 0, "retrieve": 0}
            assert status["promotions"] == {"waiting": 0, "in_flight": 0}
            out, n = client.retrieve(tokens)  # nothing stayed pinned or half-written
            assert n == len(tokens) and torch.equal(out, kv)


def test_prefetch_of_evicted_chunks_is_a_miss(tmp_path):
    tokens, kv = prompt(6, 3)
    with server(tmp_path, faulty(tmp_path, 0, ["get"])) as srv:
        with Client(srv.url, model="m", layout=LAYOUT) as client:
            only_in_l2(client, tokens, kv)
            assert client.prefetch(tokens, wait=True) == len(tokens)  # the prefetch itself works
            assert client.lookup(tokens) == len(tokens)
            client.clear("CPU", admin_token=TOKEN)
            # the records vanish after the server indexed them (another server's eviction, an operator)
            records = [p for p in (tmp_path / "l2").rglob("*") if p.is_file() and not p.name.startswith(".")]
            assert len(records) == 3
            for path in records:
                path.unlink()
            assert client.lookup(tokens) == len(tokens)  # the index does not know yet
            assert client.prefetch(tokens, wait=True) == 0  # a miss, not an error
            assert client.prefetch(tokens) == 0  # and without waiting
            assert client.lookup(tokens) == 0  # the failed read told the index
            out, n = client.retrieve(tokens)
            assert n == 0
            assert counter(srv, "kvtier_prefetch_requests_total") == 3
            assert counter(srv, "kvtier_l2_errors_total", adapter="faulty", op="get") == 0


def test_clear_does_not_wait_for_the_write_queue(tmp_path):
    tokens, kv = prompt(7, 2)
    with server(tmp_path, faulty(tmp_path, HANG_SECONDS, ["put"]), shutdown_timeout_seconds=0.5) as srv:
        with Client(srv.url, model="m", layout=LAYOUT, timeout_seconds=10) as client:
            assert client.store(tokens, kv) == 2  # its L2 write hangs in the writer thread
            assert client.flush(0.5) is False
            # the L2 clear queues behind that write: the reply does not wait for it
            assert client.clear(admin_token=TOKEN) == 2
            assert client.ping()
            assert client.lookup(tokens) == 0  # L1 is empty and no L2 chunk is announced while clearing
            other, other_kv = prompt(8, 2)  # (the cleared chunks stay reserved until their hung write returns)
            assert client.store(other, other_kv) == 2  # L1 serves again at once
            assert client.lookup(other) == len(other)
        assert srv.status()["l2"][0]["healthy"] is True


def test_a_retrieve_during_its_prefetch_waits_for_that_read(tmp_path):
    tokens, kv = prompt(9, 5)
    head = tokens[:3 * CHUNK]
    # a 3 s read: the retrieve below must come while it runs, however slow this process is to send it
    with server(tmp_path, faulty(tmp_path, 3.0, ["get"]), promote_timeout_seconds=30.0) as srv:
        with Client(srv.url, model="m", layout=LAYOUT, timeout_seconds=20) as client:
            only_in_l2(client, tokens, kv)
            raw = Raw(srv.url)
            try:
                raw.send(P.Prefetch(id=2, tokens=P.pack_tokens(head)))
                wait_for(lambda: srv.status()["promotions"]["in_flight"] == 1, what="the prefetch to start")
                # the same first chunks: this retrieve follows the prefetch's read, then reads the 2 chunks past it
                out, n = client.retrieve(tokens)
                assert n == len(tokens) and torch.equal(out, kv)
                reply = raw.recv()
                assert isinstance(reply, P.PrefetchReply) and reply.num_tokens == len(head)
            finally:
                raw.close()
            assert counter(srv, "kvtier_l2_promotions_joined_total") == 1
            # each record read once: without the join the retrieve would have read all 5 beside the prefetch's 3
            assert counter(srv, "kvtier_l2_read_chunks_total", adapter="faulty") == 5
            assert srv.status()["promotions"] == {"waiting": 0, "in_flight": 0}


def test_chunks_cleared_while_an_engine_copies_them_can_be_promoted_and_stored_again(tmp_path):
    """Clearing L1 while a retrieve pins its chunks hides them at once, but their slots stay until the pins end:
    meanwhile another engine gets the same chunks from L2 (promoted into other slots) and can store them again."""
    tokens, kv = prompt(31, 4)
    with server(tmp_path, faulty(tmp_path, 0.0, [])) as srv, \
            Client(srv.url, model="m", layout=LAYOUT) as a, Client(srv.url, model="m", layout=LAYOUT) as b:
        assert a.store(tokens, kv) == 4 and a.flush(30)
        with a.retrieve_chunks(tokens) as held:  # engine A is copying out of these slots
            assert held.num_tokens == len(tokens)
            assert b.clear("CPU", admin_token=TOKEN) == 4
            assert b.lookup(tokens) == len(tokens)  # L2 holds them
            out, n = b.retrieve(tokens)
            assert n == len(tokens) and torch.equal(out, kv)  # promoted into new slots, A's still pinned
            assert b.clear(admin_token=TOKEN) >= 4
            assert b.store(tokens, kv) == 4
            out, n = b.retrieve(tokens)
            assert n == len(tokens) and torch.equal(out, kv)
        out, n = a.retrieve(tokens)
        assert n == len(tokens) and torch.equal(out, kv)


def test_a_client_whose_call_timed_out_leaves_no_session_behind(tmp_path):
    """A load deadline shorter than a slow L2 read resets the client's socket; it says Bye on the old one, so the
    server does not keep (and count against the user's connections) a session per timed-out call."""
    prompts = [prompt(40 + i, 2) for i in range(6)]
    # the L2 read never returns: no reply can beat the call's deadline, however long this process is descheduled
    # (a 0.5 s read did, when the test stalled between sending and starting its 0.2 s wait)
    with server(tmp_path, faulty(tmp_path, HANG_SECONDS, ["get"]), max_connections_per_principal=3) as srv, \
            Client(srv.url, model="m", layout=LAYOUT, retry_after_seconds=0.05) as engine:
        for tokens, kv in prompts:
            only_in_l2(engine, tokens, kv)
        for tokens, _ in prompts:
            with engine.retrieve_chunks(tokens, timeout_seconds=0.2) as got:  # the promotion hangs
                assert not got.ok or got.num_tokens == 0
            time.sleep(0.1)  # past retry_after_seconds: the next call reconnects
        wait_for(lambda: metric_value(srv.metrics_text(), "kvtier_connected_clients") <= 1, 10, "sessions to end")
        with Client(srv.url, model="m", layout=LAYOUT) as other:  # another engine of the same user gets in
            assert other.lookup(prompts[0][0]) == 2 * CHUNK
        assert engine.lookup(prompts[1][0]) == 2 * CHUNK
