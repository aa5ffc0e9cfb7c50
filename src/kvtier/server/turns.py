"""Turns: requests received and not yet handled, queued per principal and handled one per principal per round.

libzmq's ROUTER reads its connections in turn, so a principal with many connections (many engines of one tenant,
or a hostile client that opens dozens) got one turn per connection, and an engine with one connection waited
behind one request of each of them. The request loop now moves what the socket holds into these queues
(``add``, while not ``full``) and handles one request of each principal per round (``next_round``), so a request
waits behind at most one request of every other principal, whatever their number of connections. Connections
that have not said ``Hello`` yet share one queue (``NEW_CONNECTIONS``): a flood of new connections delays other
new connections, never a session.

Order: a connection's requests are handled in the order they arrived: they keep the queue they were first put in
until none of them is left there (a connection whose ``Hello`` is still queued stays in ``NEW_CONNECTIONS``).

Bound: the loop reads the socket only while fewer than ``MAX_QUEUED`` requests and ``MAX_QUEUED_BYTES`` bytes wait
here, so what a flood costs stays in libzmq's per-connection queues (``RCVHWM``). When one principal keeps it
full, what is left of the socket is read in libzmq's order again: a request then waits behind one request per
connection, as without turns, never longer.

Thread-safety: the request loop only.
"""

from __future__ import annotations

from collections import OrderedDict, deque

NEW_CONNECTIONS = "new-connections"  # no principal is a plain word: they are "key:...", "uid:...", "ip:..."
MAX_QUEUED = 1024  # requests
MAX_QUEUED_BYTES = 64 << 20  # bytes of their frames (one larger request is still read)


class Turns:
    """Per-principal FIFO queues served round-robin (see the module docstring)."""

    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque] = OrderedDict()  # principal -> (identity, frames, nbytes), oldest first
        self._placed: dict[bytes, list] = {}  # identity -> [principal whose queue holds it, how many]
        self._count = 0
        self._bytes = 0

    def __bool__(self) -> bool:
        return self._count > 0

    def __len__(self) -> int:
        return self._count

    @property
    def full(self) -> bool:
        """True when the loop should stop reading the socket until a round has been handled."""
        return self._count >= MAX_QUEUED or self._bytes >= MAX_QUEUED_BYTES

    def add(self, identity: bytes, principal: str, frames: list) -> None:
        """Queue ``frames`` from connection ``identity`` under ``principal``, or in the queue that connection's
        earlier requests are still waiting in."""
        placed = self._placed.get(identity)
        if placed is None:
            placed = self._placed[identity] = [principal, 0]
        placed[1] += 1
        nbytes = sum(len(f) for f in frames)
        self._queues.setdefault(placed[0], deque()).append((identity, frames, nbytes))
        self._count += 1
        self._bytes += nbytes

    def next_round(self) -> list[list]:
        """One request (its frames) of every principal with a queue, in the order the queues were made."""
        out = []
        for key in list(self._queues):
            queue = self._queues[key]
            identity, frames, nbytes = queue.popleft()
            if not queue:
                del self._queues[key]
            placed = self._placed[identity]
            placed[1] -= 1
            if not placed[1]:
                del self._placed[identity]
            self._count -= 1
            self._bytes -= nbytes
            out.append(frames)
        return out
