"""The server's request socket: the port it listens on and the guarded ZMQ ROUTER bound there, with the bounds
that protect the server from its clients (message size, unread replies)."""

from __future__ import annotations

import socket

import zmq

from kvtier import protocol as P
from kvtier.auth.zap import guarded_router


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
