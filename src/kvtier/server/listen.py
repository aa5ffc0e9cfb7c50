"""The server's request socket: the port it listens on, its secret, and the guarded ZMQ ROUTER bound there, with
the bounds that protect the server from its clients (message size, unread replies); and how the request loop
reads and answers on it (``receive``, ``readable``, ``send_reply``)."""

from __future__ import annotations

import socket

import zmq

from kvtier import protocol as P
from kvtier.auth.keyring import server_keyring
from kvtier.auth.zap import guarded_router
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.zmq_context import Context

# plain ints: arithmetic on pyzmq's flag enums (`zmq.NOBLOCK | zmq.SNDMORE`, `events & zmq.POLLIN`) runs Python
# code in enum on every use
NOBLOCK, NOBLOCK_MORE, POLLIN = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.POLLIN)


class RequestSocket:
    """The server's listening part: ``port``, ``keyring`` (``kvtier.auth.keyring``; None without auth), ``sock``
    (the ROUTER, bound to ``endpoint``) and the ZAP handler guarding it.

    Args:
        config: ``config.server`` gives host, port, auth and the socket's bounds.
        refused: called with (mechanism, address) for each connection the ZAP handler refuses.

    Raises:
        ConfigError: the port cannot be had, its secret file cannot be made or read, or the port is in use.
    """

    def __init__(self, config: KVTierConfig, refused):
        srv = config.server
        self._ctx = Context()
        try:
            self.port = pick_port(srv.host, srv.port)
            self.keyring, self._created = server_keyring(config, self.port)
        except (OSError, KVTierError) as exc:
            self._ctx.term()
            raise ConfigError(f"cannot start on {srv.host}:{srv.port}: {exc}") from exc
        # a secret made for a port the OS picked (--port 0) names a port no later server will have: removed at close
        self._made_for_port_0 = self._created and srv.port == 0 and not srv.auth_secret_file
        self.sock, self._zap = request_router(self._ctx, self.keyring, srv, refused)
        try:
            self.sock.bind(f"tcp://{srv.host}:{self.port}")
        except zmq.ZMQError as exc:
            self.close(started=False)
            raise ConfigError(f"cannot listen on {srv.host}:{srv.port} (--host/--port): {exc.strerror}; "
                              "is another server running? pick another --port") from exc
        self.endpoint = f"tcp://{srv.host}:{self.port}"

    def close(self, started: bool = True) -> None:
        """Close the sockets. The secret file made here goes when it names a port the OS picked, or when the
        server did not start (``started`` False: a failed start leaves no secret for a port it did not get)."""
        self.sock.close(linger=0)
        self._zap.close()
        self._ctx.term()
        if self._made_for_port_0 or (self._created and not started):
            self.keyring.creds.path.unlink(missing_ok=True)


def pick_port(host: str, port: int) -> int:
    """``port``, or for 0 a free one now (the secret file is named by port, and CurveZMQ keys must be set
    before the socket binds)."""
    if port:
        return port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host if host not in ("*", "0.0.0.0") else "", 0))
        return probe.getsockname()[1]


def request_router(ctx, keyring, srv, refused):
    """``(router, zap)``: a ROUTER guarded by ``keyring`` (``kvtier.auth.zap.guarded_router``; ``refused`` is
    called for each refused connection), not yet bound, with ``srv``'s (``config.server``) bounds set."""
    sock, zap = guarded_router(ctx, keyring, refused)
    sock.setsockopt(zmq.LINGER, 0)
    # a frame larger than this drops the sender's connection before it is buffered
    sock.setsockopt(zmq.MAXMSGSIZE, srv.max_message_bytes + P.MAX_HEADER_BYTES)
    # replies queue per client up to this many; past it (a client that never reads) they are dropped
    sock.setsockopt(zmq.SNDHWM, srv.max_unread_replies_per_client)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # so a full queue is an error we count, not silence
    return sock, zap


def receive(sock) -> list:
    """The frames (``zmq.Frame``, not copied) of the next message waiting on ``sock``; raises ``zmq.Again`` when none
    waits. Each frame says whether another follows (``recv_multipart`` asks a socket option per frame)."""
    frames = [sock.recv(NOBLOCK, copy=False)]
    while frames[-1].more:  # a message arrives whole: its other frames are there
        frames.append(sock.recv(NOBLOCK, copy=False))
    return frames


def readable(sock) -> bool:
    """Whether a message waits on ``sock``: one socket option, no poll."""
    return bool(sock.getsockopt(zmq.EVENTS) & POLLIN)


def send_reply(sock, identity: bytes, header: bytes, out=()) -> None:
    """Send the reply ``header`` (and its KV frames ``out``, not copied) to the connection ``identity`` of the ROUTER
    ``sock``, never blocking; raises what ``Socket.send`` raises (``zmq.Again``: that connection's queue is full).
    A header alone is copied: cheaper than a ``zmq.Frame`` for a few hundred bytes."""
    if out:
        sock.send_multipart([identity, header, *out], flags=NOBLOCK, copy=False)
    else:  # a message's first frame taken means all of it is
        sock.send(identity, NOBLOCK_MORE)
        sock.send(header, NOBLOCK)
