"""Per-principal turns of the request loop (``kvtier.server.turns``): one request per principal per round,
a connection's requests in order, a bound on what waits."""

from __future__ import annotations

from kvtier.server import turns as T
from kvtier.server.turns import NEW_CONNECTIONS, Turns


def frames(name: str, nbytes: int = 1) -> list:
    return [name.encode(), b"x" * nbytes]


def names(rounds):
    return [f[0].decode() for f in rounds]


def test_one_request_per_principal_per_round_whatever_its_connections():
    turns = Turns()
    for i in range(8):  # a principal with 8 connections, 3 requests each
        for j in range(3):
            turns.add(b"h%d" % i, "key:tenant:hostile", frames(f"h{i}.{j}"))
    turns.add(b"e", "key:own", frames("e.0"))
    turns.add(b"e", "key:own", frames("e.1"))
    assert len(turns) == 26
    assert names(turns.next_round()) == ["h0.0", "e.0"]  # the engine waits behind one hostile request, not 8
    assert names(turns.next_round()) == ["h0.1", "e.1"]
    rest = []
    while turns:
        got = turns.next_round()
        assert len(got) == 1
        rest += names(got)
    assert len(rest) == 22 and not turns and len(turns) == 0
    assert rest[:3] == ["h0.2", "h1.0", "h1.1"]  # one principal's requests in arrival order


def test_a_connection_keeps_its_queue_until_it_is_empty():
    turns = Turns()
    turns.add(b"c", NEW_CONNECTIONS, frames("hello"))
    turns.add(b"c", "key:own", frames("lookup"))  # its session exists now: still behind its Hello
    turns.add(b"d", "key:own", frames("other"))
    assert names(turns.next_round()) == ["hello", "other"]
    assert names(turns.next_round()) == ["lookup"]
    turns.add(b"c", "key:own", frames("later"))  # nothing of c queued any more: its principal's queue
    turns.add(b"d", "key:own", frames("d2"))
    assert names(turns.next_round()) == ["later"]
    assert names(turns.next_round()) == ["d2"]


def test_full_by_count_and_by_bytes(monkeypatch):
    monkeypatch.setattr(T, "MAX_QUEUED", 3)
    monkeypatch.setattr(T, "MAX_QUEUED_BYTES", 1000)
    turns = Turns()
    turns.add(b"a", "p", frames("1"))
    turns.add(b"b", "p", frames("2"))
    assert not turns.full
    turns.add(b"c", "q", frames("3"))
    assert turns.full  # three requests
    turns.next_round()
    assert not turns.full
    turns.add(b"d", "q", frames("4", 2000))
    assert turns.full  # its bytes
    while turns:
        turns.next_round()
    assert not turns.full and len(turns) == 0


def test_a_principal_at_its_bounds_is_refused_and_the_others_still_queue():
    turns = Turns(max_per_principal=3, max_bytes_per_principal=100)
    assert all(turns.add(b"h%d" % i, "key:hostile", frames(f"h{i}")) for i in range(3))
    assert not turns.add(b"h9", "key:hostile", frames("h9"))  # a fourth request: refused, nothing queued
    assert turns.add(b"e", "key:own", frames("e", 500))  # one large request into an empty queue
    assert not turns.add(b"e", "key:own", frames("e2"))  # ... but nothing after it while it waits
    assert len(turns) == 4 and names(turns.next_round()) == ["h0", "e"]
    assert turns.add(b"h9", "key:hostile", frames("h9")) and turns.add(b"e", "key:own", frames("e3"))
    rest = []
    while turns:
        rest += names(turns.next_round())
    assert rest == ["h1", "e3", "h2", "h9"]
