"""CurveZMQ keys derived from a secret, and a client socket set up with them.

Every secret derives one CurveZMQ keypair per role, ``HMAC-SHA256(secret, "kvtier-curve-v1:<role>")`` as the
Curve25519 secret key (role ``server`` for the server's own key, ``client`` for a client's). A client pins the
server's public key, so a process squatting on the port cannot complete the handshake: it learns nothing (no
model, no token ids) and cannot hand the client a shared-memory name. Transport: libzmq's CURVE mechanism
(CurveZMQ, RFC 26), which also encrypts every frame.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85

if TYPE_CHECKING:
    from kvtier.auth.secret_file import Credentials


def curve_keypair(secret: str, role: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CurveZMQ keys that ``secret`` derives for ``role`` (``server`` or ``client``)."""
    raw = hmac.new(secret.encode(), f"kvtier-curve-v1:{role}".encode(), hashlib.sha256).digest()
    private = z85.encode(raw)
    return zmq.curve_public(private), private


def apply_client(sock: zmq.Socket, creds: Credentials) -> None:
    """Make ``sock`` a CurveZMQ client of the server ``creds`` names (before ``connect``)."""
    public, private = creds.client_keypair()
    sock.curve_serverkey = creds.server_public_key()
    sock.curve_publickey = public
    sock.curve_secretkey = private
