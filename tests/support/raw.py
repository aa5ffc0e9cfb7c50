"""A raw protocol client for tests of hostile behaviour: a DEALER that sends what it likes and reads when it likes.
No tests here."""

from __future__ import annotations

import os

import zmq

from kvtier import protocol as P
from kvtier.auth.curve import apply_client
from kvtier.auth.secret_file import read_credentials
from kvtier.proc import host_id
from kvtier.zmq_context import Context

from support.server import LAYOUT, authenticated


class Raw:
    """One connection speaking the real protocol. ``secret_file``: a tenant's credential file (default: the
    same-user server's secret); ``auth=False`` for a ``--no-auth`` server. ``check``: the Hello must open a
    session (else ``hello`` holds the refusal)."""

    def __init__(self, url: str, *, shm: bool = True, model: str = "m", secret_file=None, auth: bool = True,
                 check: bool = True):
        self.ctx = Context()
        sock = self.ctx.socket(zmq.DEALER)
        if secret_file is not None:
            apply_client(sock, read_credentials(secret_file))
        elif auth:
            authenticated(sock, url)
        self.sock = sock
        self.sock.setsockopt(zmq.RCVHWM, 1)  # unread replies stay on the server's side, as a client that stalls
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.ids = iter(range(1, 1 << 30))
        self.hello = self.ask(P.Hello(id=0, version=P.PROTOCOL_VERSION, model=model, layout=LAYOUT.to_dict(),
                                      layout_id=LAYOUT.layout_id, host_id=host_id(), pid=os.getpid(), want_shm=shm))
        if check:
            assert isinstance(self.hello, P.HelloReply), self.hello

    def send(self, msg) -> None:
        msg.id = next(self.ids)
        self.sock.send(P.encode(msg))

    def recv(self, timeout_seconds: float = 30.0):
        assert self.sock.poll(timeout_seconds * 1000), "no reply"
        return P.decode_reply(self.sock.recv_multipart()[0])

    def ask(self, msg):
        self.send(msg)
        return self.recv()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
