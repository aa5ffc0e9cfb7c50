"""Transport: the client's connection to a kvtier server (``Client`` extends it).

One ZMQ DEALER socket and its monitor, the ``Hello`` handshake (session, shared-memory arena), and one request
with the availability rules (``_call``). Every method here must be called with ``self._lock`` held: a DEALER is
not thread-safe, so ``Client`` makes one call at a time.

Resilience rules (the engine must never hang or crash because of the cache):
  * A ZMQ monitor tracks the connection: while it is down every call is a *fast miss* (lookup 0,
    store 0, retrieve empty) with one warning per outage and ``kvtier_client_unavailable_total``.
  * A call waits at most ``timeout_seconds``; on timeout the socket is reset and calls are fast misses for a
    back-off period. A server that restarts (new session, maybe a new shared-memory arena) is picked
    up by itself: the next call gets ``no_session``, the client says ``Hello`` again and retries once.
  * Authentication (``kvtier.auth``): the secret file is ``secret_file``, ``$KVTIER_AUTH_SECRET_FILE`` or the
    default for the URL's port, re-read on every (re)connect. A failed CurveZMQ handshake (no secret, a
    wrong one, a server without authentication) is logged once as an error saying what to do; calls are
    misses meanwhile.
"""

from __future__ import annotations

import logging
import os
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier import protocol as P
from kvtier.auth.client import FAILED_EVENTS
from kvtier.client import dataplane as D
from kvtier.errors import ProtocolError
from kvtier.proc import host_id

log = logging.getLogger(__name__)
_UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
BYE_LINGER_MILLISECONDS = 200  # how long a dropped socket may take to deliver its Bye
_REFUSALS = ("version_mismatch", "layout_mismatch", "config_mismatch", "bad_request")


class Transport:
    """The connection half of ``Client``. The attributes it works on are set by ``Client.__init__``: ``url``,
    ``model``, ``layout``, ``namespace``, ``shared_memory``, ``expect`` (the handshake), ``timeout_seconds``,
    ``retry_after_seconds``, ``metrics``, ``auth`` (``ClientAuth``), ``info`` (the last ``HelloReply``),
    ``_arena``, ``_ids``, ``_lock``, ``_ctx``, ``_sock``, ``_monitor``, ``_linked``, ``_down_until``, ``_warned``."""

    def _open_socket(self) -> None:
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.auth.prepare(self._sock)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._monitor = self._sock.get_monitor_socket(_UP_EVENTS | _DOWN_EVENTS | FAILED_EVENTS)
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
            self._sock.send_multipart([P.encode(P.Bye(id=next(self._ids)))], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return 0
        return BYE_LINGER_MILLISECONDS

    def _handshake(self, raise_refusal: bool = False) -> bool:
        hello = P.Hello(id=next(self._ids), version=P.PROTOCOL_VERSION, model=self.model,
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
            if self._arena is not None:
                self._arena.close()
            self._arena = D.attach_arena(reply.shm_name, reply.shm_capacity_bytes) if reply.shm_name else None
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
            self._sock.send_multipart([P.encode(msg), *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._mark_down("send queue full or no connection")
            return None, []
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._mark_down(f"no reply within {timeout:g} s")
                return None, []
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self._monitor in ready:
                self._drain_monitor()
                if not self._linked:  # the peer went away: its reply will never come
                    self._mark_down("connection lost", backoff=False)
                    return None, []
            if self._sock in ready:
                parts = self._sock.recv_multipart(copy=False)
                try:
                    reply = P.decode_reply(parts[0].buffer)
                except Exception:  # noqa: BLE001 -- whatever the bytes, a bad reply is dropped, never raised
                    log.warning("undecodable reply from %s dropped", self.url)
                    continue
                if reply.id == msg.id:
                    return reply, parts[1:]
                # a late reply to an earlier, abandoned request: ignore it

    def _call(self, msg, frames=(), retry: bool = True, deadline: float | None = None) -> tuple[object | None, list]:
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

    def _post(self, msg) -> None:
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
