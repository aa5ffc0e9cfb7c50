"""The replay port (issue 38 finding 4): replays paced by what their principal's requesters have not yet taken,
bounded in number per principal, ended when the requester leaves. Real ZMQ sockets over loopback TCP."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import zmq

from kvtier.events.replay import END_SEQ, ReplayPort, prepare_router
from kvtier.zmq_context import Context

BATCH_BYTES = 100_000
NUM_BATCHES = 200


@pytest.fixture
def port():
    ctx = Context()
    router = prepare_router(ctx.socket(zmq.ROUTER))
    router.setsockopt(zmq.SNDHWM, 1024)
    router.bind("tcp://127.0.0.1:0")
    ring = collections.deque((seq, bytes([seq % 256]) * BATCH_BYTES) for seq in range(NUM_BATCHES))
    refused = []
    replay = ReplayPort(router, lambda frame: ("*", b"kv-events", ring), threading.Lock(), max_replays=2,
                        max_bytes=1 << 20, timeout_seconds=600, refused=refused.append)
    replay.endpoint, replay.ctx, replay.ring, replay.refusals = router.getsockopt(zmq.LAST_ENDPOINT).decode(), ctx, ring, refused
    yield replay
    router.close(linger=0)
    ctx.destroy(linger=0)


def requester(port, *, rcvbuf: int = -1):
    sock = port.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, rcvbuf)
    sock.connect(port.endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    return sock


def received(port, sock) -> list[list[bytes]]:
    """Everything ``sock`` gets until the end marker, pumping the port meanwhile."""
    got = []
    while not got or got[-1][2] != END_SEQ:
        port.receive()
        port.pump()
        if sock.poll(10):
            got.append(sock.recv_multipart())
    return got


def pump_until(port, predicate, what: str, bound_seconds: float = 60.0):
    deadline = time.monotonic() + bound_seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        port.receive()
        port.pump()
        time.sleep(0.002)


def test_a_whole_replay_arrives_in_order_then_the_end_marker(port):
    sock = requester(port)
    got = received(port, sock)
    assert [int.from_bytes(f[2], "big") for f in got[:-1]] == list(range(NUM_BATCHES))
    assert all(f[3] == port.ring[i][1] for i, f in enumerate(got[:-1]))
    assert got[-1] == [b"", b"", END_SEQ, b""] and port.active == 0


def test_a_requester_that_never_reads_pins_at_most_its_principals_bytes(port):
    stalled = requester(port, rcvbuf=4096)
    pump_until(port, lambda: port.active == 1, "the request to arrive")
    for _ in range(300):  # far more rounds than it takes to send everything to a reader
        port.pump()
    (state,) = port._replays.values()
    undelivered = sum(n for tracker, n in state.in_flight if not tracker.done)
    assert undelivered <= (1 << 20) + BATCH_BYTES  # the bound, overshot by at most the batch that crossed it
    assert state.next_seq < NUM_BATCHES  # paused, not the whole ring queued for it
    got = received(port, stalled)  # once it reads, the rest follows
    assert [int.from_bytes(f[2], "big") for f in got[:-1]] == list(range(NUM_BATCHES))


def test_replays_past_the_principals_bound_are_refused_at_once(port):
    first, second = requester(port, rcvbuf=4096), requester(port, rcvbuf=4096)
    pump_until(port, lambda: port.active == 2, "two replays in progress")
    third = requester(port)
    pump_until(port, lambda: third.poll(0), "the refusal")
    reply = third.recv_multipart()
    assert reply[:3] == [b"", b"", END_SEQ] and b"kv_events.max_replays_per_principal" in reply[3]
    assert port.refusals == ["*"] and port.active == 2
    first.close(linger=0)  # a requester that leaves ends its replay; its slot is free again ...
    pump_until(port, lambda: port.active == 1, "the departed requester's replay to end")
    fourth = requester(port)
    pump_until(port, lambda: port.active == 2, "the next replay to start")
    second.close(linger=0)  # ... and so are the bytes it pinned, which held the principal's other replays back
    assert len(received(port, fourth)) == NUM_BATCHES + 1
