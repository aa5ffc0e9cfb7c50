"""Guarded ROUTER sockets: ZAP (ZeroMQ RFC 27) decides who connects and which routing id each peer gets.

Why: a libzmq ROUTER takes each peer's routing id from the peer's own handshake, and gives a peer that
sends none ``\\x00`` + a 4-byte counter. If another peer already chose that very id, libzmq aborts the
whole process (``Assertion failed: ok (src/socket_base.cpp)`` in ``add_out_pipe``; libzmq 4.3.5 and master,
``router_t::identify_peer``). The counter starts from libc ``rand()``, which libzmq never seeds, so its
values are the same in every process and a local peer can pick them. ROUTER_HANDOVER does not help: it
also hands out counter ids.

``router()`` makes a ROUTER that closes this:
  * A ZAP handler (``ZapHandler``, one per ``zmq.Context``, bound before any guarded socket) answers every
    handshake. With keys (CURVE mechanism) it accepts only the client keys of the secret file and puts
    the tenant (or ``"*"``, full access) in the connection's ``User-Id``; without keys (NULL mechanism)
    it accepts every peer. ``ZAP_ENFORCE_DOMAIN``: with no handler, no peer gets in. So with CURVE a peer
    without a key never reaches the ROUTER's routing-id table at all.
  * Its reply carries an ``Identity`` property, a fresh random 16-byte id that never starts with 0:
    libzmq applies it over the id the peer chose, so peers never choose ids and libzmq's counter is
    never used. libzmq applies the peer's id and ZAP's in arrival order, so the reply waits
    ``REPLY_DELAY_SECONDS`` (CURVE reads the peer's id right after sending the ZAP request; NULL
    peers send theirs right after the greeting).
  * libc's ``rand()`` is seeded from ``os.urandom`` once per process, so counter values (only reachable
    through the residuals below) cannot be predicted.

Residual: over NULL (``--no-auth``, or an event replay port left open for vLLM-compatible consumers), a
hand-written ZMTP peer can hold back its READY until after the ZAP reply and so keep an id of its
choice; to abort the process it must also guess the 32-bit counter and make a second such connection
trigger it. Over CURVE the same needs libzmq's I/O thread to stall for ``REPLY_DELAY_SECONDS`` between
two statements, twice, plus the guess.

The server reads a received frame's tenant back from its ``User-Id`` (``tenant_of``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from kvtier.auth.curve import curve_keypair
from kvtier.auth.secret_file import FULL_ACCESS

if TYPE_CHECKING:
    from kvtier.auth.keyring import KeyRing

log = logging.getLogger(__name__)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
REPLY_DELAY_SECONDS = 0.05
_seeded = False


def seed_routing_ids() -> None:
    """Seed libc ``rand()`` from ``os.urandom`` (once per process), before ROUTER sockets are created."""
    global _seeded
    if not _seeded:
        try:
            ctypes.CDLL(None).srand(int.from_bytes(os.urandom(4), "little"))
        except (OSError, AttributeError):  # no libc symbols here: ZAP-assigned ids still hold
            log.debug("could not seed libc rand()")
        _seeded = True


def new_routing_id() -> bytes:
    """16 random bytes, the first never 0 (libzmq reserves ids starting with 0 for its counter)."""
    raw = bytearray(os.urandom(16))
    raw[0] |= 0x80
    return bytes(raw)


def _metadata(**props: bytes) -> bytes:
    """ZMTP metadata: per property, name length (1 byte), name, value length (4 bytes, big-endian), value."""
    return b"".join(bytes([len(k)]) + k.encode() + struct.pack(">I", len(v)) + v for k, v in props.items())


class ZapHandler:
    """Answers ZAP requests of every socket in ``ctx`` that has a ``zap_domain``, in a daemon thread.

    Args:
        ctx: the context of the guarded sockets (ZAP is per context).
        principals: callable returning {raw 32-byte CURVE client public key: User-Id}; None accepts every
            peer (NULL mechanism) with User-Id ``"*"``. Called for each CURVE handshake (it may reload a file).
        on_refused: called with (mechanism, address) for each refused handshake (e.g. to count it).
    """

    def __init__(self, ctx: zmq.Context, principals: Callable[[], dict[bytes, str]] | None = None,
                 on_refused: Callable[[str, str], None] | None = None):
        self._principals = principals
        self._on_refused = on_refused
        self._sock = ctx.socket(zmq.ROUTER)  # several handshakes may wait for their delayed reply at once
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="kvtier-zap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop answering (pending handshakes fail) and close the ZAP socket; call before ``ctx.term()``."""
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        pending: deque[tuple[float, list]] = deque()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                wait = (pending[0][0] - time.monotonic()) if pending else 0.1
                if poller.poll(max(0, int(wait * 1000)) + 1):
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        pending.append((time.monotonic() + REPLY_DELAY_SECONDS, self._answer(frames)))
                while pending and pending[0][0] <= time.monotonic():
                    self._sock.send_multipart(pending.popleft()[1])
        finally:
            self._sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # [router id, b"", version, request id, domain, address, identity, mechanism, *credentials]
        head, request_id = frames[:2], frames[3] if len(frames) > 3 else b""
        try:
            mechanism, address = frames[7].decode(), frames[5].decode(errors="replace")
            user = self._decide(mechanism, frames[8:])
        except Exception:  # noqa: BLE001 -- a malformed request or a failing key lookup: refuse, never die
            log.exception("ZAP request could not be answered")
            return [*head, b"1.0", request_id, b"500", b"internal error", b"", b""]
        if user is None:
            if self._on_refused is not None:
                self._on_refused(mechanism, address)
            if address not in self._logged and len(self._logged) < 1024:  # a flood must not flood the log
                self._logged.add(address)
                log.warning("refused a %s connection from %s: unknown key", mechanism, address or "?")
            return [*head, b"1.0", request_id, b"400", b"unknown key", b"", b""]
        return [*head, b"1.0", request_id, b"200", b"OK", user.encode(), _metadata(Identity=new_routing_id())]

    def _decide(self, mechanism: str, credentials: list[bytes]) -> str | None:
        if self._principals is None:
            return FULL_ACCESS if mechanism == "NULL" else None
        if mechanism != "CURVE" or len(credentials) != 1:
            return None
        return self._principals().get(credentials[0])


def guarded_router(ctx: zmq.Context, keyring: KeyRing | None = None, on_refused=None) -> tuple[zmq.Socket, ZapHandler]:
    """A ROUTER behind a new ``ZapHandler`` of ``ctx`` (one per context): CurveZMQ with the keyring's keys,
    or NULL (every peer) without one; either way the handler assigns every routing id. Bind it afterwards;
    close the handler after the socket, before ``ctx.term()``."""
    handler = ZapHandler(ctx, keyring.principals if keyring else None, on_refused)
    keys = curve_keypair(keyring.creds.secret, "server") if keyring else None
    return router(ctx, keys), handler


def router(ctx: zmq.Context, curve_keys: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    """A ROUTER guarded by the context's ``ZapHandler`` (create that first). ``curve_keys``: the server's
    (public, secret) Z85 CurveZMQ keys, or None for the NULL mechanism. Bind it afterwards."""
    seed_routing_ids()
    sock = ctx.socket(zmq.ROUTER)
    sock.zap_domain = b"kvtier"
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    if curve_keys is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = curve_keys
    return sock


def tenant_of(frame) -> tuple[bool, str | None]:
    """(authenticated, tenant) of a received frame from its ZAP ``User-Id``; tenant None means full access."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError):
        return False, None
    if not user:
        return False, None
    return True, None if user == FULL_ACCESS else user
