"""The replay port of an ``EventPublisher``: buffered batches sent to consumers that ask, paced and bounded.

Wire (vLLM >= 0.26, reference events-and-hashing.md §1.1): a DEALER sends ``[b"", start_seq (8 bytes)]``; the
ROUTER answers ``[b"", topic, seq, payload]`` for every buffered batch of the requester's stream with
``seq >= start_seq``, then the end marker ``[b"", b"", 0xFF*8, b""]``. kvtier's refusal (below) is the end
marker with a UTF-8 reason as its last frame instead of ``b""``: a vLLM consumer sees an empty replay, kvtier's
``Subscriber`` logs the reason.

Life of a replay: a request is checked (three frames, an 8-byte seq; the socket drops any message over
``MAX_REQUEST_BYTES`` and keeps at most ``REQUEST_HWM`` unread per connection), its principal found (the
connection's ZAP ``User-Id``: a tenant, the operator ``*``; without authentication every consumer is one
principal) and, unless that principal already has ``max_replays`` in progress (then refused at once), it
becomes a cursor: the next seq to send. ``pump`` (the publisher thread, every loop) sends each cursor's next
batches straight from the ring, while its principal's sent-but-undelivered bytes stay under ``max_bytes``
(each frame's ``MessageTracker``) and its connection takes more (``ROUTER_MANDATORY``: a full pipe pauses it,
a departed peer ends it), then the end marker. A batch the ring dropped meanwhile is skipped (the consumer sees
the seq gap). A replay not finished within ``timeout_seconds`` is dropped.

Memory: frames reference the ring's payloads (``zmq.Frame(copy=False)``: pyzmq would copy a ``send`` of less
than 64 KiB, one copy of the ring per requester that never reads), so what a slow requester pins is bounded by
its principal's ``max_bytes``, and requesters beyond ``max_replays`` hold nothing but their connection.

Thread-safety: every method runs on the publisher thread; ``ring_of`` is called with the publisher's lock held.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvtier.auth.zap import tenant_of

log = logging.getLogger(__name__)
END_SEQ = b"\xff" * 8
MAX_REQUEST_BYTES = 4096  # a request is b"" and 8 bytes; the limit also covers CurveZMQ handshake commands
REQUEST_HWM = 16  # unread requests queued per connection
REPLY_HWM = 1024  # batches queued per connection; past it the cursor waits (ROUTER_MANDATORY)
ALL_CONSUMERS = "*"  # the principal of every consumer of a publisher without authentication


@dataclass(slots=True)
class _Replay:
    principal: str
    topic: bytes
    ring: collections.deque
    next_seq: int
    deadline: float
    in_flight: collections.deque = field(default_factory=collections.deque)  # (tracker, bytes) not yet delivered


class ReplayPort:
    """Serves replay requests on a bound ROUTER (module docstring).

    Args:
        sock: the ROUTER, made by ``prepare_router`` and bound.
        stream_of: ``frame -> (principal, topic, ring) | None``: the stream a request's connection may replay
            (None: not authenticated, answered with nothing); ``ring`` is a deque of (seq, payload).
        lock: the publisher's lock, held while a ring is read.
        max_replays: replays in progress per principal (``kv_events.max_replays_per_principal``).
        max_bytes: bytes sent to a principal's requesters and not yet delivered
            (``kv_events.max_replay_bytes_per_principal``).
        timeout_seconds: a replay is dropped when not finished by then (``kv_events.replay_timeout_seconds``).
        refused: called with the principal of each refused request (a metric).
    """

    def __init__(self, sock: zmq.Socket, stream_of: Callable, lock, *, max_replays: int, max_bytes: int,
                 timeout_seconds: float, refused: Callable[[str], None] = lambda principal: None):
        self.sock, self.stream_of, self.lock = sock, stream_of, lock
        self.max_replays, self.max_bytes, self.timeout_seconds = max_replays, max_bytes, timeout_seconds
        self.refused = refused
        self._replays: dict[bytes, _Replay] = {}
        self._count: collections.Counter = collections.Counter()  # principal -> replays in progress

    @property
    def active(self) -> int:
        """Replays in progress."""
        return len(self._replays)

    def receive(self) -> None:
        """Take the requests waiting on the socket: each becomes a replay, or is refused."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1].bytes != b"" or len(frames[2].bytes) != 8:
                log.warning("KV events: ignoring a malformed replay request of %d frame(s); "
                            "expected [b'', start_seq (8 bytes)] from a DEALER", len(frames))
                continue
            ident = frames[0].bytes
            stream = self.stream_of(frames[0])
            if stream is None:  # not authenticated: nothing to replay
                self._end(ident)
                continue
            principal, topic, ring = stream
            if ident in self._replays:  # a new request from the same connection replaces its replay
                self._finish(ident)
            if self._count[principal] >= self.max_replays:
                self.refused(principal)
                self._end(ident, f"refused: this principal already has {self.max_replays} replays in progress, "
                                 "the bound kv_events.max_replays_per_principal; retry when one has ended")
                continue
            self._count[principal] += 1
            self._replays[ident] = _Replay(principal, topic, ring, int.from_bytes(frames[2].bytes, "big"),
                                           time.monotonic() + self.timeout_seconds)

    def pump(self) -> None:
        """Send what each replay may send now; end the finished, departed and overdue ones."""
        if not self._replays:
            return
        now = time.monotonic()
        outstanding: collections.Counter = collections.Counter()
        for replay in self._replays.values():
            while replay.in_flight and replay.in_flight[0][0].done:
                replay.in_flight.popleft()
            outstanding[replay.principal] += sum(n for _, n in replay.in_flight)
        for ident, replay in list(self._replays.items()):
            if now > replay.deadline:
                log.warning("KV events: a replay to %s did not finish within %g s (its consumer does not read); "
                            "dropped", replay.principal, self.timeout_seconds)
                self._finish(ident)
                continue
            state = self._send_batches(ident, replay, outstanding)
            if state == "done" and self._end(ident) != "full":
                self._finish(ident)
            elif state == "gone":
                self._finish(ident)

    def _send_batches(self, ident: bytes, replay: _Replay, outstanding: collections.Counter) -> str:
        """Send ``replay``'s next batches: "done" (none left), "paused" (a bound or a full pipe) or "gone"."""
        while True:
            if outstanding[replay.principal] >= self.max_bytes:
                return "paused"
            with self.lock:
                item = _next(replay.ring, replay.next_seq)
            if item is None:
                return "done"
            seq, payload = item
            frame = zmq.Frame(payload, copy=False, track=True)  # the ring's bytes, not a copy
            state = self._send(ident, (b"", replay.topic, seq.to_bytes(8, "big"), frame))
            if state != "sent":
                return "paused" if state == "full" else "gone"
            replay.next_seq = seq + 1
            replay.in_flight.append((frame.tracker, len(payload)))
            outstanding[replay.principal] += len(payload)

    def _send(self, ident: bytes, frames) -> str:
        try:
            self.sock.send_multipart((ident, *frames), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return "full"
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return "gone"
            raise
        return "sent"

    def _end(self, ident: bytes, reason: str = "") -> str:
        return self._send(ident, (b"", b"", END_SEQ, reason.encode()))

    def _finish(self, ident: bytes) -> None:
        replay = self._replays.pop(ident)
        self._count[replay.principal] -= 1
        if not self._count[replay.principal]:
            del self._count[replay.principal]


def prepare_router(sock: zmq.Socket) -> zmq.Socket:
    """Set the replay ROUTER's options, before it binds (high-water marks apply to later connections only)."""
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
    sock.setsockopt(zmq.RCVHWM, REQUEST_HWM)
    return sock


def _next(ring: collections.deque, seq: int) -> tuple[int, bytes] | None:
    """The first (seq, payload) of ``ring`` (contiguous seqs, oldest first) at or after ``seq``."""
    if not ring:
        return None
    first = ring[0][0]
    index = max(0, seq - first)
    return ring[index] if index < len(ring) else None


def stream_principal(frame, secure: bool) -> tuple[bool, str]:
    """(authenticated, principal) of a replay request's connection: its tenant, ``*`` for the operator or a
    subscriber key, ``*`` for everybody without authentication."""
    if not secure:
        return True, ALL_CONSUMERS
    authenticated, tenant = tenant_of(frame)
    return authenticated, ALL_CONSUMERS if tenant is None else tenant
