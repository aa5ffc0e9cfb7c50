"""ZMQ publisher of KV cache event batches, byte-compatible with vLLM's ``ZmqEventPublisher``.

Wire (reference events-and-hashing.md §1.1): PUB frames ``[topic, seq (8-byte big-endian, 0, 1, 2, ...),
msgpack EventBatch]``. Replay: a ROUTER on ``replay_endpoint`` answers ``[identity, b"", start_seq (8 bytes)]``
with ``[identity, b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq``, then the end
marker ``[identity, b"", b"", 0xFF*8, b""]`` (vLLM >= 0.26 layout). The replay ROUTER is guarded
(``kvtier.auth.zap``): a ZAP handler assigns every consumer's routing id, so no consumer can choose one that
aborts the process; inside a server with authentication and ``replay_auth`` it also requires the
server's CurveZMQ keys (a consumer then needs the secret file, ``kvtier events subscribe --auth-secret-file``).

Bind or connect: like vLLM, the PUB socket binds when the endpoint contains ``*`` or ``::`` or starts with
``ipc://`` / ``inproc://``; kvtier also binds a tcp endpoint on ``127.0.0.1``, ``localhost`` or ``0.0.0.0``
(kvtier's default ``tcp://127.0.0.1:5557`` is a local publisher). Any other address is connected to (a router
whose SUB binds, as llm-d does). ``bind=True/False`` (argument, or a ``bind`` config key) overrides the guess.
The replay socket always binds.

Never blocks the data path: ``publish()`` appends to a bounded queue (``max_queue_size`` events); a publisher
thread takes up to ``batch_max_events`` at a time, waiting at most ``batch_max_delay_seconds`` after the first one.
Events that do not fit are dropped and counted (``kvtier_events_dropped_total``); vLLM's format has no field
for a loss, so the loss is reported with the next batch sent: a warning log line naming the count and that
batch's seq, and ``stats()["dropped_events"]``.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time

import zmq

from kvtier.auth.zap import guarded_router
from kvtier.errors import KVTierError
from kvtier.events.model import Encoder, Event, EventBatch

log = logging.getLogger(__name__)
END_SEQ = b"\xff" * 8
_LOCAL_TCP = re.compile(r"^tcp://(127\.0\.0\.1|localhost|0\.0\.0\.0|\[::1\]):")


def should_bind(endpoint: str) -> bool:
    """True when the publisher binds ``endpoint`` (see the module docstring for the rule)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or bool(_LOCAL_TCP.match(endpoint)))


def _open(ctx, kind: int | zmq.Socket, endpoint: str, bind: bool, what: str, sndhwm: int) -> zmq.Socket:
    sock = kind if isinstance(kind, zmq.Socket) else ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, sndhwm)  # before bind/connect: ZMQ applies it to later connections only
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        hint = ("another process (another kvtier server, or vLLM) already uses it; pick a free port"
                if exc.errno == zmq.EADDRINUSE else "check the endpoint's form, e.g. tcp://127.0.0.1:5557")
        raise KVTierError(f"cannot {'bind' if bind else 'connect'} the KV event {what} on {endpoint!r}: "
                          f"{exc.strerror}; {hint}") from None
    return sock


class EventPublisher:
    """Publishes event batches on ZMQ PUB, with a replay ROUTER. Start-up happens in the constructor.

    Args:
        kv_events_config: ``KVEventsConfig`` (``endpoint``, ``replay_endpoint``, ``topic``, ``encoding``, ``hwm``,
            ``buffer_steps``, ``buffer_max_bytes``, ``max_queue_size``, ``batch_max_events``, ``batch_max_delay_seconds``,
            ``data_parallel_rank``).
        metrics: optional ``kvtier.metrics.Metrics`` for ``kvtier_events_dropped_total`` and
            ``kvtier_events_published_total``.
        bind: override the bind/connect guess for the PUB endpoint.
        auth: the server's ``kvtier.auth.KeyRing``: with ``replay_auth`` the replay port accepts only its keys.

    Raises:
        KVTierError: an endpoint cannot be bound (already in use) or is malformed.
        ConfigError: unknown encoding.

    Attributes ``endpoint`` / ``replay_endpoint`` hold the bound addresses (a ``:0`` port resolved).
    """

    def __init__(self, kv_events_config, *, metrics=None, bind: bool | None = None, auth=None) -> None:
        cfg = kv_events_config
        self.topic = cfg.topic.encode()
        self.metrics = metrics
        self.buffer_steps = cfg.buffer_steps
        self.max_queue_size = cfg.max_queue_size
        self.batch_max_events = cfg.batch_max_events
        self.batch_max_delay_seconds = cfg.batch_max_delay_seconds
        self.data_parallel_rank = cfg.data_parallel_rank
        self._encoder = Encoder(cfg.encoding)
        if bind is None:
            bind = getattr(cfg, "bind", None)
        self._bind = should_bind(cfg.endpoint) if bind is None else bool(bind)

        self._queue: collections.deque[Event] = collections.deque()
        self._lock = threading.Lock()
        self._first_at = 0.0  # monotonic time the oldest queued event arrived
        self._dropped_total = 0
        self._dropped_unreported = 0
        self._published_events = 0
        self._next_seq = 0
        # replay ring: at most buffer_steps batches and buffer_max_bytes of payload, the oldest go first
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque()
        self._ring_bytes = 0
        self.buffer_max_bytes = getattr(cfg, "buffer_max_bytes", 64 << 20)
        self._stop = False

        self._ctx = zmq.Context()
        self._zap = None
        try:
            self._pub = _open(self._ctx, zmq.PUB, cfg.endpoint, self._bind, "publisher", cfg.hwm)
            self._pub.setsockopt(zmq.LINGER, 1000)
            self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode() if self._bind else cfg.endpoint
            self._router = None
            self.replay_endpoint = None
            if cfg.replay_endpoint:
                keyring = auth if getattr(cfg, "replay_auth", False) else None
                self._router, self._zap = guarded_router(self._ctx, keyring, self._refused)
                self._router = _open(self._ctx, self._router, cfg.replay_endpoint, True, "replay socket",
                                     2 * (cfg.buffer_steps + 1))
                self.replay_endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException:
            if self._zap is not None:
                self._zap.close()
            self._ctx.destroy(linger=0)
            raise
        # the sockets move to the thread here and are used only there from now on
        self._thread = threading.Thread(target=self._run, name="kvtier-events-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def publish(self, events: list[Event]) -> int:
        """Queue events for publishing; never blocks. Returns how many were accepted (the rest are dropped).

        After ``close()`` every event is dropped (and counted): a late event never fails the caller.
        """
        with self._lock:
            room = 0 if self._stop else self.max_queue_size - len(self._queue)
            take = events if len(events) <= room else events[:max(room, 0)]
            if take and not self._queue:
                self._first_at = time.monotonic()
            self._queue.extend(take)
            lost = len(events) - len(take)
            if lost:
                self._dropped_total += lost
                self._dropped_unreported += lost
        if lost and self.metrics is not None:
            self.metrics.inc("kvtier_events_dropped_total", lost)
        return len(take)

    def stats(self) -> dict:
        """``next_seq``, ``queued_events``, ``published_events``, ``dropped_events``, ``buffered_batches``,
        ``buffered_bytes`` (payload bytes in the replay ring)."""
        with self._lock:
            return {"next_seq": self._next_seq, "queued_events": len(self._queue),
                    "published_events": self._published_events, "dropped_events": self._dropped_total,
                    "buffered_batches": len(self._ring), "buffered_bytes": self._ring_bytes}

    def close(self, timeout_seconds: float = 10.0) -> None:
        """Publish what is queued, stop the thread, close the sockets. Idempotent."""
        if self._stop:
            return
        self._stop = True
        self._thread.join(timeout_seconds)
        if self._zap is not None:
            self._zap.close()
        if not self._thread.is_alive():  # the thread closed its sockets; term waits for PUB's linger
            self._ctx.term()

    def _refused(self, mechanism: str, address: str) -> None:
        if self.metrics is not None:
            self.metrics.inc("kvtier_auth_refused_total", socket="replay")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ publisher thread
    def _take_batch(self) -> list[Event] | None:
        with self._lock:
            if not self._queue:
                return None
            due = (len(self._queue) >= self.batch_max_events or self._stop
                   or time.monotonic() - self._first_at >= self.batch_max_delay_seconds)
            if not due:
                return None
            n = min(self.batch_max_events, len(self._queue))
            out = [self._queue.popleft() for _ in range(n)]
            if self._queue:
                self._first_at = time.monotonic()
            return out

    def _send(self, events: list[Event]) -> None:
        payload = self._encoder.encode(EventBatch(time.time(), events, self.data_parallel_rank))
        seq = self._next_seq
        with self._lock:
            self._next_seq += 1
            self._published_events += len(events)
            lost, self._dropped_unreported = self._dropped_unreported, 0
        if lost:
            log.warning("KV events: %d event(s) dropped before batch seq %d (queue of %d full); "
                        "a consumer's index may miss them", lost, seq, self.max_queue_size)
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)
        except zmq.ZMQError as exc:  # the seq is used: a consumer sees a gap and can replay it
            log.error("KV events: sending batch seq %d failed: %s", seq, exc)
        with self._lock:
            self._ring.append((seq, payload))
            self._ring_bytes += len(payload)
            while len(self._ring) > self.buffer_steps or self._ring_bytes > self.buffer_max_bytes:
                self._ring_bytes -= len(self._ring.popleft()[1])
        if self.metrics is not None:
            self.metrics.inc("kvtier_events_published_total", len(events))

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("KV events: ignoring a malformed replay request of %d frame(s); "
                            "expected [b'', start_seq (8 bytes)] from a DEALER", len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            with self._lock:
                ring = list(self._ring)
            # zero-copy: every requester's queue references the ring's payloads instead of holding copies; past
            # the socket's high-water mark (2 x buffer_steps messages) a requester that never reads gets nothing
            for seq, payload in ring:
                if seq >= start:
                    self._router.send_multipart((ident, b"", self.topic, seq.to_bytes(8, "big"), payload), copy=False)
            self._router.send_multipart((ident, b"", b"", END_SEQ, b""))

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while True:
                batch = self._take_batch()
                if batch:
                    self._send(batch)
                    if self._router is not None:
                        self._serve_replay()
                    continue
                if self._stop and not self._queue:
                    break
                # idle or waiting for a batch to fill: sleep on the replay socket (short, bounded)
                wait_seconds = 0.002 if self._queue else 0.005
                if self._router is not None:
                    if poller.poll(wait_seconds * 1000):
                        self._serve_replay()
                else:
                    time.sleep(wait_seconds)
        finally:
            self._pub.close()
            if self._router is not None:
                self._router.close(linger=0)
