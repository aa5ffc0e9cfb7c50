"""Faults: a client SIGKILLed mid-store and mid-retrieve (leases), a server restarted under a running
client, and calls while the server is down (fast misses, never a hang or an exception)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from support.server import (
    CHUNK,
    CHUNK_BYTES,
    LAYOUT,
    ServerProc,
    free_port,
    metric_value,
    wait_for,
)

from kvtier.client import Client

# A client that stops half-way: it opens a store (and writes half of the first slot into shared
# memory) or a retrieve (slots pinned), says READY and waits to be killed.
HALFWAY = r"""
import json, os, sys, time, zmq
from kvtier import protocol as P
from kvtier.client.dataplane import attach_arena
from kvtier.proc import host_id
url, mode, layout, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
from kvtier.layout import KVLayout
lay = KVLayout.from_dict(layout)
sock = zmq.Context().socket(zmq.DEALER)
from kvtier.auth.curve import apply_client
from kvtier.auth.secret_file import client_credentials
apply_client(sock, client_credentials(url)[0])
sock.connect(url)
def ask(msg):
    sock.send(P.encode(msg))
    return P.decode_reply(sock.recv())
hello = ask(P.Hello(id=1, version=P.PROTOCOL_VERSION, model="m", layout=layout, layout_id=lay.layout_id,
                    host_id=host_id(), pid=os.getpid()))
arena = attach_arena(hello.shm_name, hello.shm_capacity_bytes)
if mode == "store":
    reply = ask(P.StoreBegin(id=2, tokens=P.pack_tokens(tokens)))
    slot = reply.slots[0]
    arena.view(slot.offset, slot.nbytes // 2)[:] = b"\xab" * (slot.nbytes // 2)
else:
    reply = ask(P.RetrieveBegin(id=2, tokens=P.pack_tokens(tokens)))
print("READY", len(reply.slots), flush=True)
time.sleep(600)
"""


def halfway_client(url: str, mode: str, tokens: list[int]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HALFWAY, url, mode, json.dumps(LAYOUT.to_dict()), json.dumps(tokens)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line[0] == "READY", line
    proc.num_slots = int(line[1])
    return proc


def kv_for(tokens, seed):
    return torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(seed))


def leases(server) -> dict:
    return server.status()["leases"]


def test_client_killed_mid_store_never_exposes_the_half_written_chunk(tmp_path):
    with ServerProc(tmp_path, l1="6200B", lease_seconds=3) as server, \
            Client(server.url, model="m", layout=LAYOUT) as other:
        tokens = list(range(500, 500 + 2 * CHUNK))
        child = halfway_client(server.url, "store", tokens)
        assert child.num_slots == 2
        assert other.lookup(tokens) == 0  # reserved slots are invisible
        assert other.store(tokens, kv_for(tokens, 1)) == 0  # and cannot be stored twice meanwhile
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        wait_for(lambda: leases(server)["store"] == 0, what="the store lease to expire")
        assert metric_value(server.metrics_text(), "kvtier_lease_expired_total", kind="store") == 1
        status = server.status()
        assert status["l1"]["used_bytes"] == 0 and status["l1"]["num_chunks"] == 0  # reservation aborted
        assert other.lookup(tokens) == 0
        out, n = other.retrieve(tokens)
        assert n == 0
        kv = kv_for(tokens, 2)
        assert other.store(tokens, kv) == 2
        out, n = other.retrieve(tokens)
        assert n == 2 * CHUNK and torch.equal(out, kv)


def test_client_killed_mid_retrieve_releases_its_pins_after_the_lease(tmp_path):
    with ServerProc(tmp_path, l1="6200B", lease_seconds=5) as server, \
            Client(server.url, model="m", layout=LAYOUT) as other:
        tokens = list(range(700, 700 + 2 * CHUNK))
        assert other.store(tokens, kv_for(tokens, 3)) == 2
        child = halfway_client(server.url, "retrieve", tokens)
        assert child.num_slots == 2
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        # while pinned, a 3-chunk store gets only the one free slot: pinned chunks are never evicted
        first = list(range(9000, 9000 + 3 * CHUNK))
        assert other.store(first, kv_for(first, 4)) == 1
        assert leases(server)["retrieve"] == 1
        wait_for(lambda: leases(server)["retrieve"] == 0, what="the retrieve lease to expire")
        assert metric_value(server.metrics_text(), "kvtier_lease_expired_total", kind="retrieve") == 1
        second = list(range(12000, 12000 + 3 * CHUNK))
        kv = kv_for(second, 5)
        assert other.store(second, kv) == 3  # the formerly pinned chunks could be evicted
        out, n = other.retrieve(second)
        assert n == 3 * CHUNK and torch.equal(out, kv)
        assert server.status()["l1"]["used_bytes"] == 3 * CHUNK_BYTES


@pytest.mark.timeout(180)
def test_client_survives_server_down_and_restart(tmp_path):
    port = free_port()
    server = ServerProc(tmp_path, port=port)
    # timeout_seconds is far above the test timeout: a call that waited for it would fail the test
    client = Client(server.url, model="m", layout=LAYOUT, timeout_seconds=600, retry_after_seconds=0.2)
    tokens = list(range(40, 40 + 2 * CHUNK))
    kv = kv_for(tokens, 6)
    first_id, first_shm = client.info.server_id, client.info.shm_name
    assert client.store(tokens, kv) == 2 and client.uses_shared_memory
    assert server.stop() == 0
    assert not os.path.exists(f"/dev/shm/{first_shm}")  # clean shutdown unlinked the shared L1
    assert client.lookup(tokens) == 0
    assert client.store(tokens, kv) == 0
    out, n = client.retrieve(tokens)
    assert n == 0 and out.shape == LAYOUT.chunk_shape(0)
    assert client.clear() == 0 and client.ping() is False
    assert client.metrics.value("kvtier_client_unavailable_total") == 5
    server = ServerProc(tmp_path, port=port)
    try:
        wait_for(client.ping, what="the client to reconnect")
        assert client.info.server_id != first_id and client.info.shm_name != first_shm
        assert client.uses_shared_memory
        assert client.lookup(tokens) == 0  # a fresh server: L1 is empty
        assert client.store(tokens, kv) == 2
        out, n = client.retrieve(tokens)
        assert n == 2 * CHUNK and torch.equal(out, kv)
    finally:
        client.close()
        assert server.stop() == 0


@pytest.mark.timeout(120)
def test_a_lookup_waiting_on_a_server_that_dies_is_a_miss_long_before_its_timeout(tmp_path):
    """The server is killed while a lookup waits for its reply: the client notices the lost connection (it
    receives in short slices and checks the connection between them) and answers a miss, not after its 600 s
    ``timeout_seconds`` (a wait for that would fail the test)."""
    server = ServerProc(tmp_path, shared_memory=False)  # SIGKILLed: no shared L1 left behind
    client = Client(server.url, model="m", layout=LAYOUT, timeout_seconds=600, retry_after_seconds=0.2)
    try:
        tokens = list(range(90, 90 + 2 * CHUNK))
        assert client.store(tokens, kv_for(tokens, 10)) == 2 and client.lookup(tokens) == 2 * CHUNK
        os.kill(server.proc.pid, signal.SIGSTOP)  # the next request waits, unread
        got = []
        waiting = threading.Thread(target=lambda: got.append(client.lookup(tokens)))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not got  # no answer from a stopped server
        os.kill(server.proc.pid, signal.SIGKILL)  # its connections close
        waiting.join(60)
        assert not waiting.is_alive() and got == [0]
        assert client.metrics.value("kvtier_client_unavailable_total") == 1
    finally:
        server.stop()
        client.close()


def test_a_flush_waits_for_its_own_timeout_not_the_clients(tmp_path):
    """Issue 38 finding 1: ``flush(T)`` waits up to T for a slow L2, even when T is longer than the client's
    ``timeout_seconds``; it used to give up at the client's timeout, report a loss and mark the server down."""
    slow = {"type": "faulty", "inner": {"type": "local_disk", "path": str(tmp_path / "disk")}, "latency_seconds": 3,
            "ops": ["put"]}
    with ServerProc(tmp_path, config={"l2_adapters": [slow]}) as server, \
            Client(server.url, model="m", layout=LAYOUT, timeout_seconds=1.0) as client:
        tokens = list(range(300, 300 + CHUNK))
        assert client.store(tokens, kv_for(tokens, 11)) == 1  # acknowledged; its L2 write takes 3 s
        assert client.flush(30.0) is True
        assert client.lookup(tokens) == CHUNK  # the server was never marked down
        assert client.metrics.value("kvtier_client_unavailable_total") == 0


@pytest.mark.timeout(120)
def test_client_started_before_its_server_misses_then_connects(tmp_path):
    port = free_port()
    client = Client(f"tcp://127.0.0.1:{port}", model="m", layout=LAYOUT, timeout_seconds=600, retry_after_seconds=0.2)
    tokens = list(range(CHUNK))
    assert client.lookup(tokens) == 0 and client.store(tokens, kv_for(tokens, 7)) == 0
    assert client.metrics.value("kvtier_client_unavailable_total") == 2
    with ServerProc(tmp_path, port=port):
        wait_for(client.ping, what="the client to connect")
        assert client.store(tokens, kv_for(tokens, 7)) == 1
        assert client.lookup(tokens) == CHUNK
        client.close()


def test_a_stalled_client_discards_late_copies(tmp_path, monkeypatch):
    """Fault injection around the real client: its copies stall past the lease. The lease leaves the copies that do
    not stall seconds of the machine's time (at 1 s they had half a second: the client writes no later than half
    the lease), and the late copy waits for the server to report the expiry instead of sleeping past it."""
    import time

    from kvtier.client import client as client_module

    lease = 4.0
    with ServerProc(tmp_path, lease_seconds=lease) as server, Client(server.url, model="m", layout=LAYOUT) as client:
        tokens = list(range(300, 300 + 2 * CHUNK))
        kv = kv_for(tokens, 8)
        real_view = client_module.chunk_view

        def stalled_view(*args):
            time.sleep(lease / 2 + 0.1)  # more than half the lease: the client writes no later than that
            return real_view(*args)

        monkeypatch.setattr(client_module, "chunk_view", stalled_view)
        assert client.store(tokens, kv) == 0  # gave up before the second chunk: reservation aborted
        assert client.lookup(tokens) == 0
        monkeypatch.setattr(client_module, "chunk_view", real_view)
        assert client.store(tokens, kv) == 2

        def very_stalled_view(*args):  # past the whole lease: the server unpins before RetrieveEnd
            wait_for(lambda: metric_value(server.metrics_text(), "kvtier_lease_expired_total", kind="retrieve"),
                     what="the retrieve lease to expire")
            return real_view(*args)

        monkeypatch.setattr(client_module, "chunk_view", very_stalled_view)
        out, n = client.retrieve(tokens)
        assert n == 0 and out.shape[2] == 0  # the late copy is discarded, never returned
        monkeypatch.setattr(client_module, "chunk_view", real_view)
        assert metric_value(server.metrics_text(), "kvtier_lease_expired_total", kind="retrieve") == 1
        out, n = client.retrieve(tokens)
        assert n == 2 * CHUNK and torch.equal(out, kv)


def test_retrieve_gives_up_at_its_timeout_on_a_stopped_server(tmp_path):
    """A server stopped (SIGSTOP) while a client retrieves: the retrieve answers a miss at its own
    ``timeout_seconds``, far below the client's 600 s (a wait for that would fail the test); the client
    works again once the server continues."""
    with ServerProc(tmp_path) as server:
        client = Client(server.url, model="m", layout=LAYOUT, timeout_seconds=600, retry_after_seconds=0.2)
        try:
            tokens = list(range(70, 70 + 2 * CHUNK))
            kv = kv_for(tokens, 9)
            assert client.store(tokens, kv) == 2
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                with client.retrieve_chunks(tokens, timeout_seconds=0.5) as got:
                    assert (got.num_tokens, got.chunks) == (0, [])
                assert got.ok is False
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert client.metrics.value("kvtier_client_unavailable_total") >= 1
            wait_for(client.ping, what="the client to reach the server again")
            with client.retrieve_chunks(tokens, timeout_seconds=30) as got:
                copies = [view.copy() for _, view in got.chunks]
            assert got.ok and got.num_tokens == 2 * CHUNK
            assert torch.equal(torch.from_numpy(copies[0]), kv[:, :, :CHUNK])
        finally:
            client.close()
