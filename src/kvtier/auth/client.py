"""The client's side of authentication (``kvtier.auth``): which secret file a socket uses, and what a failed
CurveZMQ handshake means for the engine's operator (logged once per problem, not once per retry).

Imports no server code: ``kvtier.client`` uses it (tests/unit/structure/test_client_imports.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import zmq

from kvtier.auth.curve import apply_client
from kvtier.auth.secret_file import ENV_SECRET_FILE, Credentials, client_credentials
from kvtier.auth.zap import new_routing_id

log = logging.getLogger(__name__)
FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                 | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class ClientAuth:
    """Credentials for the sockets of one client of ``url``.

    ``secret_file``: the server's secret file or a tenant's credential file; None reads
    ``$KVTIER_AUTH_SECRET_FILE``, else the file a same-user server on this host keeps for the URL's port.
    ``problem``: why the current socket's handshake failed ("" while it has not).
    """

    def __init__(self, url: str, secret_file: str | os.PathLike | None = None):
        self.url = url
        self.secret_file = secret_file
        self.problem = ""
        self._creds = self._path = None
        self._logged = ""

    def prepare(self, sock: zmq.Socket) -> None:
        """Set up a new socket before ``connect``: a routing id of its own and the keys of the secret file,
        read again each time (a restarted server may have made a new one)."""
        sock.routing_id = new_routing_id()  # never empty: libzmq's own ids are the ones a peer can collide with
        self._creds, self._path, problem = client_credentials(self.url, self.secret_file)
        if self._creds is not None:
            apply_client(sock, self._creds)
        elif problem:
            self._log(f"{problem}; connecting without authentication")
        self.problem = ""

    def failed(self, event: int, value: int) -> None:
        """Record a handshake failure (a socket monitor event) and say what to do about it."""
        if not self.problem:
            self.problem = handshake_problem(event, value, self.url, self._creds, self._path)
            self._log(self.problem)

    def _log(self, message: str) -> None:
        if message != self._logged:
            self._logged = message
            log.error("kvtier client: %s", message)


def handshake_problem(event: int, value: int, url: str, creds: Credentials | None, path: Path | None) -> str:
    """What a failed ZMTP handshake (a socket monitor event) means for a client, and what to do."""
    where = f"secret file {path}" if path else "no secret file (the URL has no port to find one by)"
    if creds is None:
        return (f"{url} requires authentication and this client has none: looked for {where}; run the client as "
                f"the server's OS user, or give the file (client secret_file=..., ${ENV_SECRET_FILE}, or the "
                "vLLM connector key kvtier.auth_secret_file)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"{url} refused this client's key from {where}: the secret is not one of the server's "
                "(wrong file, or a tenant that was removed)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (f"{url} does not use authentication (started with --no-auth?) but this client found {where}; "
                "remove that stale file or start the server with authentication")
    return (f"{url} failed the CurveZMQ handshake with the key from {where}: the server's secret differs (the "
            "file is stale or belongs to another server), or it runs without authentication (--no-auth)")
