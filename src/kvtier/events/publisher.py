"""ZMQ publisher of KV cache event batches, byte-compatible with vLLM's ``ZmqEventPublisher``.

Wire (reference events-and-hashing.md §1.1): PUB frames ``[topic, seq (8-byte big-endian, 0, 1, 2, ...),
msgpack EventBatch]``. Replay: a ROUTER on ``replay_endpoint`` sends the buffered batches a consumer asks for,
paced and bounded per principal (``kvtier.events.replay``). The replay ROUTER is guarded (``kvtier.auth.zap``):
a ZAP handler assigns every consumer's routing id, so no consumer can choose one that aborts the process.

Authentication (``auth``: a server's ``KeyRing`` and ``kv_events.auth``): the PUB becomes a CurveZMQ XPUB and
the replay ROUTER requires CurveZMQ too, both accepting the server's keys, its tenants' and its subscriber keys
(``kvtier auth subscriber``); a plain ZMQ SUB gets nothing. Events are scoped (``kvtier.events.streams``): a
tenant's connection is subscribed only to its own stream (``tenant:<name>/<topic>``: its namespaces' events,
their own sequence numbers and replay ring), the operator's to every event. Routers that speak plain ZMQ only
(vLLM's, Dynamo's) read a same-host relay instead (``kvtier events relay``, ``ipc://`` with file permissions).
Without authentication the PUB is byte-compatible with vLLM's and every subscriber sees every event.

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

from kvtier.auth.curve import curve_keypair
from kvtier.auth.zap import ZapHandler, router
from kvtier.errors import KVTierError
from kvtier.events.model import Encoder, Event, EventBatch
from kvtier.events.replay import ALL_CONSUMERS, REPLY_HWM, ReplayPort, prepare_router, stream_principal
from kvtier.events.streams import Stream, check_topic, subscription_for, tenant_topic
from kvtier.zmq_context import Context

log = logging.getLogger(__name__)
ALL_STREAMS = "*"  # publish(tenant=ALL_STREAMS): every tenant stream carries the events (AllBlocksCleared)
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
                          f"{exc.strerror}; {hint}") from exc
    return sock


class EventPublisher:
    """Publishes event batches on ZMQ PUB, with a replay ROUTER. Start-up happens in the constructor.

    Args:
        kv_events_config: ``KVEventsConfig`` (``endpoint``, ``replay_endpoint``, ``topic``, ``encoding``, ``hwm``,
            ``buffer_steps``, ``buffer_max_bytes``, ``max_queue_size``, ``batch_max_events``, ``batch_max_delay_seconds``,
            ``data_parallel_rank``, ``auth``, ``max_replays_per_principal``, ``max_replay_bytes_per_principal``,
            ``replay_timeout_seconds``).
        metrics: optional ``kvtier.metrics.Metrics`` for ``kvtier_events_dropped_total``,
            ``kvtier_events_published_total``, ``kvtier_auth_refused_total{socket="events"|"replay"}`` and
            ``kvtier_events_replays_refused_total``.
        bind: override the bind/connect guess for the PUB endpoint.
        auth: the server's ``kvtier.auth.keyring.KeyRing``; with ``kv_events.auth`` both sockets accept only its
            keys and events are scoped per tenant (module docstring). None: plain PUB, unscoped.

    Raises:
        KVTierError: an endpoint cannot be bound (already in use) or is malformed.
        ConfigError: unknown encoding; a topic that cannot name the operator stream beside tenant streams.

    Attributes ``endpoint`` / ``replay_endpoint`` hold the bound addresses (a ``:0`` port resolved); ``secure``
    says whether authentication and scoping are on.
    """

    def __init__(self, kv_events_config, *, metrics=None, bind: bool | None = None, auth=None) -> None:
        cfg = kv_events_config
        self.topic = cfg.topic.encode()
        self.secure = auth is not None and getattr(cfg, "auth", True)
        if self.secure:
            check_topic(self.topic)
        self.metrics = metrics
        self.max_queue_size = cfg.max_queue_size
        self.batch_max_events = cfg.batch_max_events
        self.batch_max_delay_seconds = cfg.batch_max_delay_seconds
        self.data_parallel_rank = cfg.data_parallel_rank
        self._encoder = Encoder(cfg.encoding)
        if bind is None:
            bind = getattr(cfg, "bind", None)
        self._bind = should_bind(cfg.endpoint) if bind is None else bool(bind)

        # (event, tenant stream or None, whether the operator stream carries it)
        self._queue: collections.deque[tuple[Event, str | None, bool]] = collections.deque()
        self._lock = threading.Lock()
        self._first_at = 0.0  # monotonic time the oldest queued event arrived
        self._dropped_total = 0
        self._dropped_unreported = 0
        self._published_events = 0
        self._ring_limits = (cfg.buffer_steps, getattr(cfg, "buffer_max_bytes", 64 << 20))
        self._operator = Stream(self.topic, *self._ring_limits)
        self._tenants: dict[str, Stream] = {}
        self._stop = False

        # two contexts, so each socket has its own ZAP handler (one per context) and refusals are counted per socket
        self._ctx, self._replay_ctx = Context(), Context()
        self._zaps: list[ZapHandler] = []
        try:
            keys = None
            if self.secure:
                self._zaps.append(ZapHandler(self._ctx, auth.event_principals, self._refused("events")))
                keys = curve_keypair(auth.creds.secret, "server")
            self._pub = _open(self._ctx, _xpub(self._ctx, keys) if keys else zmq.PUB, cfg.endpoint, self._bind,
                              "publisher", cfg.hwm)
            self._pub.setsockopt(zmq.LINGER, 1000)
            self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode() if self._bind else cfg.endpoint
            self._router = self._replay = None
            self.replay_endpoint = None
            if cfg.replay_endpoint:
                principals = auth.event_principals if self.secure else None
                self._zaps.append(ZapHandler(self._replay_ctx, principals, self._refused("replay")))
                self._router = _open(self._replay_ctx, prepare_router(router(self._replay_ctx, keys)),
                                     cfg.replay_endpoint, True, "replay socket", REPLY_HWM)
                self.replay_endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
                self._replay = ReplayPort(self._router, self._replay_stream, self._lock,
                                          max_replays=cfg.max_replays_per_principal,
                                          max_bytes=cfg.max_replay_bytes_per_principal,
                                          timeout_seconds=cfg.replay_timeout_seconds, refused=self._replay_refused)
        except BaseException:
            for zap in self._zaps:
                zap.close()
            self._ctx.destroy(linger=0)
            self._replay_ctx.destroy(linger=0)
            raise
        # the sockets move to the thread here and are used only there from now on
        self._thread = threading.Thread(target=self._run, name="kvtier-events-publisher", daemon=True)
        self._thread.start()

    @property
    def buffer_steps(self) -> int:
        return self._ring_limits[0]

    # ------------------------------------------------------------------ producer side
    def publish(self, events: list[Event], tenant: str | None = None, *, operator: bool = True) -> int:
        """Queue events for publishing; never blocks. Returns how many were accepted (the rest are dropped).

        Args:
            events: in order.
            tenant: the tenant whose stream also carries them (``ALL_STREAMS``: every stream), when the
                publisher is ``secure``; ignored otherwise.
            operator: whether the operator stream (every subscriber, without authentication) carries them.

        After ``close()`` every event is dropped (and counted): a late event never fails the caller.
        """
        if not self.secure:
            if not operator:
                return len(events)  # a tenant-only view of what the operator stream already says
            tenant = None
        with self._lock:
            room = 0 if self._stop else self.max_queue_size - len(self._queue)
            take = events if len(events) <= room else events[:max(room, 0)]
            if take and not self._queue:
                self._first_at = time.monotonic()
            self._queue.extend((event, tenant, operator) for event in take)
            lost = len(events) - len(take)
            if lost:
                self._dropped_total += lost
                self._dropped_unreported += lost
        if lost and self.metrics is not None:
            self.metrics.inc("kvtier_events_dropped_total", lost)
        return len(take)

    def stats(self) -> dict:
        """Of the operator stream: ``next_seq``, ``buffered_batches``, ``buffered_bytes`` (payload bytes in its
        replay ring); ``queued_events``, ``published_events`` (once per event, whatever the streams),
        ``dropped_events``, ``tenant_streams``."""
        with self._lock:
            return {"next_seq": self._operator.next_seq, "queued_events": len(self._queue),
                    "published_events": self._published_events, "dropped_events": self._dropped_total,
                    "buffered_batches": len(self._operator.ring), "buffered_bytes": self._operator.ring_bytes,
                    "tenant_streams": len(self._tenants)}

    def close(self, timeout_seconds: float = 10.0) -> None:
        """Publish what is queued, stop the thread, close the sockets. Idempotent."""
        if self._stop:
            return
        self._stop = True
        self._thread.join(timeout_seconds)
        for zap in self._zaps:
            zap.close()
        if not self._thread.is_alive():  # the thread closed its sockets; term waits for PUB's linger
            self._ctx.term()
            self._replay_ctx.term()

    def _refused(self, socket: str):
        def count(mechanism: str, address: str) -> None:
            if self.metrics is not None:
                self.metrics.inc("kvtier_auth_refused_total", socket=socket)
        return count

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ publisher thread
    def _take_batch(self) -> list[tuple[Event, str | None, bool]] | None:
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

    def _send(self, items: list[tuple[Event, str | None, bool]]) -> None:
        per_stream: dict[str | None, list[Event]] = {}
        for event, tenant, operator in items:
            if operator:
                per_stream.setdefault(None, []).append(event)
            if tenant == ALL_STREAMS:
                for name in list(self._tenants):
                    per_stream.setdefault(name, []).append(event)
            elif tenant is not None:
                per_stream.setdefault(tenant, []).append(event)
        with self._lock:
            self._published_events += len(items)
            lost, self._dropped_unreported = self._dropped_unreported, 0
        for i, (tenant, events) in enumerate(per_stream.items()):
            self._send_stream(self._stream(tenant), events, lost if i == 0 else 0)
        if self.metrics is not None:
            self.metrics.inc("kvtier_events_published_total", len(items))

    def _stream(self, tenant: str | None) -> Stream:
        if tenant is None:
            return self._operator
        stream = self._tenants.get(tenant)
        if stream is None:
            with self._lock:
                stream = self._tenants[tenant] = Stream(tenant_topic(tenant, self.topic), *self._ring_limits)
        return stream

    def _send_stream(self, stream: Stream, events: list[Event], lost: int) -> None:
        payload = self._encoder.encode(EventBatch(time.time(), events, self.data_parallel_rank))
        with self._lock:
            seq = stream.take_seq()
        if lost:
            log.warning("KV events: %d event(s) dropped before batch seq %d (queue of %d full); "
                        "a consumer's index may miss them", lost, seq, self.max_queue_size)
        try:
            self._pub.send_multipart((stream.topic, seq.to_bytes(8, "big"), payload), copy=False)
        except zmq.ZMQError as exc:  # the seq is used: a consumer sees a gap and can replay it
            log.error("KV events: sending batch seq %d failed: %s", seq, exc)
        with self._lock:
            stream.keep(seq, payload)

    def _serve_subscriptions(self) -> None:
        """XPUB_MANUAL: subscribe each connection to what its ZAP User-Id may see (streams.subscription_for);
        the ``setsockopt`` right after a ``recv`` applies to the connection that sent it."""
        while True:
            try:
                frame = self._pub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            body = frame.bytes
            if not body or body[0] not in (0, 1):
                continue
            try:
                user = frame.get("User-Id")
            except zmq.ZMQError:
                user = None
            chosen = subscription_for(user, body[1:], self.topic)
            if chosen is not None:
                self._pub.setsockopt(zmq.SUBSCRIBE if body[0] == 1 else zmq.UNSUBSCRIBE, chosen)

    def _replay_stream(self, frame) -> tuple[str, bytes, collections.deque] | None:
        """``ReplayPort``'s view of a request's connection: (principal, topic, ring) of the stream it may replay."""
        authenticated, principal = stream_principal(frame, self.secure)
        if not authenticated:
            return None
        stream = self._operator if principal == ALL_CONSUMERS else self._tenants.get(principal)
        return None if stream is None else (principal, stream.topic, stream.ring)

    def _replay_refused(self, principal: str) -> None:
        if self.metrics is not None:
            self.metrics.inc("kvtier_events_replays_refused_total")

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        if self.secure:
            poller.register(self._pub, zmq.POLLIN)
        try:
            while True:
                batch = self._take_batch()
                if batch:
                    self._send(batch)
                    self._serve_sockets(poller, 0)
                    continue
                if self._stop and not self._queue:
                    break
                # idle or waiting for a batch to fill: sleep on the sockets (short, bounded)
                wait_seconds = 0.002 if self._queue else 0.005
                if not self._serve_sockets(poller, wait_seconds):
                    time.sleep(wait_seconds)
        finally:
            self._pub.close()
            if self._router is not None:
                self._router.close(linger=0)

    def _serve_sockets(self, poller: zmq.Poller, wait_seconds: float) -> bool:
        """Answer replay requests and subscriptions; False when there is no socket to wait on."""
        if self._router is None and not self.secure:
            return False
        ready = dict(poller.poll(0 if self._replay is not None and self._replay.active else wait_seconds * 1000))
        if self._pub in ready:
            self._serve_subscriptions()
        if self._replay is not None:
            if self._router in ready:
                self._replay.receive()
            self._replay.pump()
        return True


def _xpub(ctx: zmq.Context, curve_keys: tuple[bytes, bytes]) -> zmq.Socket:
    """A CurveZMQ XPUB guarded by the context's ZAP handler, subscribing each connection itself."""
    sock = ctx.socket(zmq.XPUB)
    sock.zap_domain = b"kvtier"
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = curve_keys
    sock.setsockopt(zmq.XPUB_MANUAL, 1)
    return sock
