"""The server's side of authentication: its secret file, its guarded request socket, a message's tenant.

See ``kvtier.auth`` (secret file, keys, trust boundary) and ``kvtier.zap`` (who connects, routing ids).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import zmq

from kvtier.auth import FULL_ACCESS, KeyRing, default_secret_file, load_or_create
from kvtier.config import KVTierConfig

log = logging.getLogger(__name__)


def secret_path(config: KVTierConfig, port: int) -> Path:
    """The server's secret file: ``server.auth_secret_file`` or the default for ``port``."""
    chosen = config.server.auth_secret_file
    return Path(chosen).expanduser() if chosen else default_secret_file(port)


def server_keyring(config: KVTierConfig, port: int) -> tuple[KeyRing | None, bool]:
    """(the keys the server accepts, whether the secret file was created now); (None, False) with
    ``server.auth`` off. Raises ConfigError for a file other users can read or that is malformed."""
    if not config.server.auth:
        return None, False
    creds, created = load_or_create(secret_path(config, port))
    return KeyRing(creds), created


def log_auth(keyring: KeyRing | None, host: str, port: int) -> None:
    """One line on how clients authenticate (a warning when they do not), once the server is up."""
    if keyring is None:
        log.warning("authentication is OFF (--no-auth): any process that can reach %s:%d can read and write every "
                    "cached chunk; use it only on a trusted network", host, port)
    else:
        log.info("authentication: CurveZMQ with the keys of %s, %d tenant(s)", keyring.creds.path,
                 len(keyring.creds.tenants))


def pick_port(host: str, port: int) -> int:
    """``port``, or for 0 a free one now (the secret file is named by port, and CurveZMQ keys must be set
    before the socket binds)."""
    if port:
        return port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host if host not in ("*", "0.0.0.0") else "", 0))
        return probe.getsockname()[1]


def tenant_of(frame) -> tuple[bool, str | None]:
    """(authenticated, tenant) of a received frame from its ZAP ``User-Id``; tenant None means full access."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError):
        return False, None
    if not user:
        return False, None
    return True, None if user == FULL_ACCESS else user
