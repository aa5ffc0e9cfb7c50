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

Bounds: one principal's queue holds at most ``max_per_principal`` requests (``server.max_inflight_requests_per_
principal``: more could not be answered anyway) and ``max_bytes_per_principal`` bytes (one larger request is still
taken when its queue is empty); ``add`` refuses the rest and the loop answers them at once with
``Error(limit_exceeded)``, so it keeps reading the socket: a principal that pipelines over dozens of connections
cannot hold the others' requests in libzmq's queues, nor grow them (``RCVHWM`` per connection). Over all
principals, the loop reads the socket only while fewer than ``MAX_QUEUED`` requests and ``MAX_QUEUED_BYTES`` bytes
wait here; when several principals keep it full, what is left is read in libzmq's order again (one request per
connection in turn, as without turns, never worse).

Thread-safety: the request loop only.
"""

from __future__ import annotations

from collections import OrderedDict, deque

NEW_CONNECTIONS = "new-connections"  # no principal is a plain word: they are "key:...", "uid:...", "ip:..."
MAX_QUEUED = 4096  # requests, all principals
MAX_QUEUED_BYTES = 256 << 20  # bytes of their frames (one larger request is still read)
MAX_QUEUED_BYTES_PER_PRINCIPAL = 64 << 20


class Turns:
    """Per-principal FIFO queues served round-robin (see the module docstring).

    Args:
        max_per_principal: requests one principal may have queued; ``add`` refuses more.
        max_bytes_per_principal: bytes (frames) one principal may have queued, one request excepted.
    """

    def __init__(self, max_per_principal: int = 256, max_bytes_per_principal: int = MAX_QUEUED_BYTES_PER_PRINCIPAL):
        self.max_per_principal = max_per_principal
        self.max_bytes_per_principal = max_bytes_per_principal
        self._queues: OrderedDict[str, deque] = OrderedDict()  # principal -> (identity, frames, nbytes), oldest first
        self._queued_bytes: dict[str, int] = {}  # principal -> bytes in its queue
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

    def add(self, identity: bytes, principal: str, frames: list) -> bool:
        """Queue ``frames`` from connection ``identity`` under ``principal``, or in the queue that connection's
        earlier requests are still waiting in. False (nothing queued): that queue is at its bounds."""
        placed = self._placed.get(identity)
        key = principal if placed is None else placed[0]
        nbytes = sum(len(f) for f in frames)
        queue = self._queues.get(key)
        if queue and (len(queue) >= self.max_per_principal
                      or self._queued_bytes[key] + nbytes > self.max_bytes_per_principal):
            return False
        if placed is None:
            placed = self._placed[identity] = [principal, 0]
        placed[1] += 1
        if queue is None:
            queue = self._queues[key] = deque()
            self._queued_bytes[key] = 0
        queue.append((identity, frames, nbytes))
        self._queued_bytes[key] += nbytes
        self._count += 1
        self._bytes += nbytes
        return True

    def next_round(self) -> list[list]:
        """One request (its frames) of every principal with a queue, in the order the queues were made."""
        out = []
        for key in list(self._queues):
            queue = self._queues[key]
            identity, frames, nbytes = queue.popleft()
            self._queued_bytes[key] -= nbytes
            if not queue:
                del self._queues[key]
                del self._queued_bytes[key]
            placed = self._placed[identity]
            placed[1] -= 1
            if not placed[1]:
                del self._placed[identity]
            self._count -= 1
            self._bytes -= nbytes
            out.append(frames)
        return out
