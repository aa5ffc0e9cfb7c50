"""The transport floor of the lookup benchmarks: a bare pyzmq ROUTER answering every request with a kvtier-sized
reply (no kvtier), and a DEALER to it, with CurveZMQ as the server has it (``bench_lookup_hol.py``,
``bench_lookup_cpu.py``)."""

from __future__ import annotations

import zmq

from kvtier import protocol as P
from kvtier.zmq_context import Context

CHUNK = 256


def curve_keys(auth: bool) -> dict | None:
    """CurveZMQ key pairs for the floor's server and clients (None: no CurveZMQ, as with ``--no-auth``)."""
    if not auth:
        return None
    (server_public, server_secret), (client_public, client_secret) = zmq.curve_keypair(), zmq.curve_keypair()
    return {"server_public": server_public, "server_secret": server_secret, "client_public": client_public,
            "client_secret": client_secret}


FLOOR_REPLY = P.encode(P.LookupReply(id=1, num_tokens=CHUNK * 8, num_l1_tokens=CHUNK * 2))  # a kvtier reply's size


def echo_server(url: str, stop, keys: dict | None = None, reply: bytes = FLOOR_REPLY) -> None:
    """The floor's server: a bare pyzmq ROUTER answering every request with ``reply`` until ``stop`` is set."""
    ctx = Context()
    sock = ctx.socket(zmq.ROUTER)
    if keys:
        sock.curve_server, sock.curve_secretkey = True, keys["server_secret"]
    sock.bind(url)
    while not stop.is_set():
        if sock.poll(100):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                sock.send_multipart([frames[0], reply])
    sock.close(0)
    ctx.term()


def floor_socket(ctx, url: str, keys: dict | None):
    """A DEALER to the floor's server (CurveZMQ with ``keys``)."""
    sock = ctx.socket(zmq.DEALER)
    if keys:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            keys["server_public"], keys["client_public"], keys["client_secret"])
    sock.connect(url)
    return sock


def floor_lookup(sock, tokens) -> P.LookupReply:
    """One floor round trip: the request ``Client.lookup`` would send for ``tokens``, its reply decoded."""
    sock.send(P.encode(P.Lookup(id=1, tokens=P.pack_tokens(tokens))))
    return P.decode_reply(sock.recv())
