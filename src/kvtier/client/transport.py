"""Transport: the client's connection to a kvtier server (a part ``Client`` owns).

One ZMQ DEALER socket and its monitor, the ``Hello`` handshake (session, shared-memory arena), and one request
with the availability rules (``call``). Every method here must be called with ``lock`` held: a DEALER is not
thread-safe, so ``Client`` makes one call (or one store or retrieve sequence) at a time.

Resilience rules (the engine must never hang or crash because of the cache):
  * A ZMQ monitor tracks the connection: while it is down every call is a *fast miss* (lookup 0,
    store 0, retrieve empty) with one warning per outage and ``kvtier_client_unavailable_total``. A call waiting
    for its reply when the connection drops is a miss within ``WATCH_MILLISECONDS``.
  * A call waits at most ``timeout_seconds``; on timeout the socket is reset and calls are fast misses for a
    back-off period. A server that restarts (new session, maybe a new shared-memory arena) is picked
    up by itself: the next call gets ``no_session``, the client says ``Hello`` again and retries once.
  * Authentication (``kvtier.auth``): the secret file is ``secret_file``, ``$KVTIER_AUTH_SECRET_FILE`` or the
    default for the URL's port, re-read on every (re)connect. A failed CurveZMQ handshake (no secret, a
    wrong one, a server without authentication) is logged once as an error saying what to do; calls are
    misses meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier import protocol as P
from kvtier.auth.client import FAILED_EVENTS, ClientAuth
from kvtier.client import dataplane as D
from kvtier.errors import ProtocolError
from kvtier.proc import host_id
from kvtier.zmq_context import Context

log = logging.getLogger(__name__)
_UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_POLLIN = int(zmq.POLLIN)  # a plain int: `events & zmq.POLLIN` runs Python code in enum on every use
BYE_LINGER_MILLISECONDS = 200  # how long a dropped socket may take to deliver its Bye
WATCH_MILLISECONDS = 20  # a reply is waited for in slices this long, the connection checked between them
_REFUSALS = ("version_mismatch", "layout_mismatch", "config_mismatch", "bad_request")


class Transport:
    """The connection of one ``Client`` to the server at ``url``, opened (and the handshake tried) here.

    ``model``, ``layout`` (``KVLayout``), ``namespace``, ``shared_memory`` and ``expect`` go into the ``Hello``;
    ``timeout_seconds``, ``retry_after_seconds``, ``metrics`` and ``secret_file`` are ``Client``'s arguments of
    those names. ``info`` is the server's last ``HelloReply`` (None before one), ``arena`` its shared-memory L1
    when attached (else None). Raises ProtocolError when the server refuses the handshake (version, layout or
    config mismatch); an unreachable server is not an error (calls are misses until it answers).
    """

    def __init__(self, url: str, *, model: str, layout, namespace: str, timeout_seconds: float,
                 shared_memory: bool, expect: dict, retry_after_seconds: float, metrics, secret_file=None):
        self.url, self.model, self.layout, self.namespace = url, model, layout, namespace
        self.timeout_seconds, self.retry_after_seconds = timeout_seconds, retry_after_seconds
        self.shared_memory, self.expect, self.metrics = shared_memory, expect, metrics
        self.auth = ClientAuth(url, secret_file)
        self.info: P.HelloReply | None = None  # the server's answer to the last handshake
        self.arena = None
        self._ids = itertools.count(1)
        self.lock = threading.Lock()  # a DEALER is not thread-safe: one call at a time
        self._ctx = Context()
        self._sock = self._monitor = None
        self._linked = False  # the monitor saw a completed ZMTP handshake and no disconnect since
        self._down_until = 0.0
        self._warned = False
        self._open_socket()
        with self.lock:
            self._wait_linked(min(timeout_seconds, 2.0))  # an engine may start before its server
            try:
                answered = not self._linked or self._handshake(raise_refusal=True)
            except ProtocolError:  # refused: release the sockets now (a context collected later with open
                self._close_socket()  # sockets would block its finalizer forever)
                self._ctx.term()
                raise
            if not answered:
                self._mark_down("no answer to the handshake")
            elif not self._linked:
                self._mark_down(self.auth.problem or f"cannot reach {url}", backoff=bool(self.auth.problem))

    def new_id(self) -> int:
        """The id of the next request (replies are matched to requests by it)."""
        return next(self._ids)

    def _open_socket(self) -> None:
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.auth.prepare(self._sock)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._monitor = self._sock.get_monitor_socket(_UP_EVENTS | _DOWN_EVENTS | FAILED_EVENTS)
        self._wait_milliseconds = -1  # the socket's RCVTIMEO: a receive waits at most one slice
        self._linked = False
        self._sock.connect(self.url)

    def _close_socket(self, linger_milliseconds: int = 0) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=linger_milliseconds)

    def _drain_monitor(self, wait_seconds: float = 0.0) -> None:
        """Apply queued connection events to ``_linked`` (waiting up to ``wait_seconds`` for the first)."""
        if not wait_seconds and not self._monitor.get(zmq.EVENTS) & _POLLIN:
            return  # the usual case, asked once per call: a socket option costs less than a poll
        while self._monitor.poll(int(wait_seconds * 1000)):
            message = recv_monitor_message(self._monitor)
            event = message["event"]
            if event & _UP_EVENTS:
                self._linked = True
            elif event & _DOWN_EVENTS:
                self._linked = False
            elif event & FAILED_EVENTS:
                self.auth.failed(event, message["value"])
            wait_seconds = 0.0

    def _wait_linked(self, timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        self._drain_monitor()
        while not self._linked and not self.auth.problem and time.monotonic() < deadline:
            self._drain_monitor(min(0.05, max(0.0, deadline - time.monotonic())))

    def _mark_down(self, why: str, backoff: bool = True) -> None:
        if backoff:  # a hung server: start over with a fresh socket after a pause
            self._close_socket(self._send_bye())
            self._open_socket()
            self._down_until = time.monotonic() + self.retry_after_seconds
        if not self._warned:
            log.warning("kvtier server %s unavailable (%s): calls are cache misses until it is back", self.url, why)
            self._warned = True

    def _send_bye(self) -> int:
        """Queue a ``Bye`` on the socket about to be dropped (its request timed out, e.g. behind a slow L2
        promotion): without it the server keeps that session, and counts it against this principal's
        connections, until it goes idle. Never waits; returns the linger (ms) that lets it leave."""
        if self.info is None or not self._linked:
            return 0
        try:
            self._sock.send_multipart([P.encode(P.Bye(id=self.new_id()))], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return 0
        return BYE_LINGER_MILLISECONDS

    def _handshake(self, raise_refusal: bool = False) -> bool:
        hello = P.Hello(id=self.new_id(), version=P.PROTOCOL_VERSION, model=self.model,
                        layout=self.layout.to_dict(), layout_id=self.layout.layout_id, namespace=self.namespace,
                        host_id=host_id(), pid=os.getpid(), want_shm=self.shared_memory, expect=self.expect)
        reply, _ = self._roundtrip(hello, ())
        if reply is None:
            return False
        if isinstance(reply, P.Error):
            message = f"kvtier server {self.url} refused the session ({reply.code}): {reply.message}"
            if raise_refusal and reply.code in _REFUSALS:
                raise ProtocolError(message)
            log.error(message)
            return False
        if not isinstance(reply, P.HelloReply):
            return False
        if self.info is None or reply.shm_name != self.info.shm_name:
            if self.arena is not None:
                self.arena.close()
            self.arena = D.attach_arena(reply.shm_name, reply.shm_capacity_bytes) if reply.shm_name else None
        self.info = reply
        if self._warned:
            log.warning("kvtier server %s is back", self.url)
        self._warned = False
        return True

    def _roundtrip(self, msg, frames, timeout_seconds: float | None = None) -> tuple[object | None, list]:
        """Send one request and wait for its reply (at most ``timeout_seconds``, default the client's);
        (None, []) when the server is gone or silent."""
        timeout = self.timeout_seconds if timeout_seconds is None else max(0.0, timeout_seconds)
        try:  # never block: a DEALER with no live peer would wait forever
            if frames:  # KV frames: not copied
                self._sock.send_multipart([P.encode(msg), *frames], flags=zmq.NOBLOCK, copy=False)
            else:  # a header alone: copying it costs less than wrapping it in a zmq.Frame
                self._sock.send(P.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._mark_down("send queue full or no connection")
            return None, []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._mark_down(f"no reply within {timeout:g} s")
                return None, []
            # a blocking receive in slices, not a poll of the socket and the monitor (10-15 us more per call):
            # a lost connection is noticed at the end of the slice instead
            wait = min(WATCH_MILLISECONDS, int(left * 1000) + 1)
            if wait != self._wait_milliseconds:
                self._sock.setsockopt(zmq.RCVTIMEO, wait)
                self._wait_milliseconds = wait
            try:
                header = self._sock.recv()  # a small msgpack map: copied; KV frames after it are not
            except zmq.Again:
                self._drain_monitor()
                if not self._linked:  # the peer went away: its reply will never come
                    self._mark_down("connection lost", backoff=False)
                    return None, []
                continue
            payload = []
            while self._sock.getsockopt(zmq.RCVMORE):
                payload.append(self._sock.recv(copy=False))
            try:
                reply = P.decode_reply(header)
            except Exception:  # noqa: BLE001 -- whatever the bytes, a bad reply is dropped, never raised
                log.warning("undecodable reply from %s dropped", self.url)
                continue
            if reply.id == msg.id:
                return reply, payload
            # a late reply to an earlier, abandoned request: ignore it

    def call(self, msg, frames=(), retry: bool = True, deadline: float | None = None) -> tuple[object | None, list]:
        """One request with the availability rules; (None, []) means: answer as a miss. ``deadline``: a
        ``time.monotonic()`` after which no reply is waited for."""
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.1)  # a past deadline: one short wait
        if time.monotonic() >= self._down_until:
            self._drain_monitor()
            if self._linked:
                if self.info is None and not self._handshake():
                    return self._miss()
                reply, payload = self._roundtrip(msg, frames, timeout)
                if isinstance(reply, P.Error) and reply.code == "no_session" and retry:
                    if not self._handshake():  # the server restarted: new session, then once more
                        return self._miss()
                    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.1)
                    reply, payload = self._roundtrip(msg, frames, timeout)
                if reply is None:
                    return self._miss()
                if isinstance(reply, P.Error):
                    if reply.code == "unauthorized":
                        raise ProtocolError(f"kvtier server {self.url} refused {type(msg).__name__}: {reply.message}")
                    if reply.code != "lease_expired":
                        log.warning("kvtier server answered %s to %s: %s", reply.code, type(msg).__name__, reply.message)
                    return None, []
                return reply, payload
            # after a failed handshake: a fresh socket later, with the secret file read again
            self._mark_down(self.auth.problem or "not connected", backoff=bool(self.auth.problem))
        return self._miss()

    def _miss(self) -> tuple[None, list]:
        self.metrics.inc("kvtier_client_unavailable_total")
        return None, []

    def post(self, msg) -> None:
        """Send ``msg`` without waiting for its reply (dropped by a later ``_roundtrip``); nothing when down."""
        if time.monotonic() < self._down_until:
            return
        self._drain_monitor()
        if not self._linked or (self.info is None and not self._handshake()):
            return
        try:
            self._sock.send_multipart([P.encode(msg)], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # a full send queue: a prefetch is only a hint

    def close(self) -> None:
        """Say ``Bye`` (best effort, a short wait: the server frees this session at once), release the socket and
        the arena mapping. Idempotent; call with ``lock`` held."""
        if self._sock is None:
            return
        self._drain_monitor()
        if self._linked and self.info is not None:
            self._roundtrip(P.Bye(id=self.new_id()), (), min(self.timeout_seconds, 0.5))  # best effort, short
        self._close_socket()
        self._sock = None
        self._ctx.term()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
