"""The server's keys: its secret file, the client keys it accepts (``KeyRing``), and what it logs about them.

See ``kvtier.auth`` (trust boundary), ``kvtier.auth.secret_file`` (the file) and ``kvtier.auth.zap`` (who
connects, routing ids).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvtier.auth.secret_file import Credentials, default_secret_file, load_or_create, read_credentials
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)


class KeyRing:
    """The client keys a server accepts, re-read when its secret file changes, so ``kvtier auth tenant``
    takes effect without a restart. A file that became unreadable keeps the last good keys (logged)."""

    def __init__(self, creds: Credentials):
        self.creds = creds
        self._stamp = _stamp(creds.path)
        self._keys = creds.principals()
        self._event_keys = creds.event_principals()

    def principals(self) -> dict[bytes, str]:
        """{raw client public key: ZAP User-Id} the request port accepts: the server's secret and its tenants'."""
        self._reload()
        return self._keys

    def event_principals(self) -> dict[bytes, str]:
        """What the KV event sockets accept: ``principals()`` and the subscriber keys (User-Id ``"*"``)."""
        self._reload()
        return self._event_keys

    def _reload(self) -> None:
        stamp = _stamp(self.creds.path)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                fresh = read_credentials(self.creds.path)
            except ConfigError as exc:
                log.warning("keeping the previous keys: %s", exc)
                return
            if fresh.secret != self.creds.secret:
                log.warning("the secret in %s changed; the server keeps its old one until it restarts", fresh.path)
                fresh = Credentials(fresh.path, self.creds.secret, None, None, fresh.tenants, fresh.subscribers)
            self.creds, self._keys, self._event_keys = fresh, fresh.principals(), fresh.event_principals()


def _stamp(path: Path) -> tuple:
    try:
        info = path.stat()
    except OSError:
        return ()
    return info.st_mtime_ns, info.st_size, info.st_ino


def secret_path(config: KVTierConfig, port: int) -> Path:
    """The server's secret file: ``server.auth_secret_file`` or the default for ``port``."""
    chosen = config.server.auth_secret_file
    return Path(chosen).expanduser() if chosen else default_secret_file(port)


def server_keyring(config: KVTierConfig, port: int) -> tuple[KeyRing | None, bool]:
    """(the keys the server accepts, whether the secret file was created now); (None, False) with
    ``server.auth`` off. Raises ConfigError for a file other users can read or that is malformed."""
    if not config.server.auth:
        _remove_stale_secret(config, port)
        return None, False
    creds, created = load_or_create(secret_path(config, port))
    return KeyRing(creds), created


def _remove_stale_secret(config: KVTierConfig, port: int) -> None:
    """A server without authentication removes the default secret file of its port, left by an earlier server
    with authentication: a same-user client would find it, offer CurveZMQ and fail the handshake (issue 21).
    A file named by ``server.auth_secret_file`` is the operator's and stays."""
    if config.server.auth_secret_file:
        return
    stale = default_secret_file(port)
    if not stale.exists():
        return
    try:
        stale.unlink()
    except OSError as exc:
        log.warning("authentication is off, but the secret file %s of an earlier server on port %d could not be "
                    "removed (%s): same-user clients will offer its keys and fail; delete it", stale, port,
                    exc.strerror)
        return
    log.warning("authentication is off: removed %s, the secret file of an earlier server on port %d, so clients "
                "do not offer its keys", stale, port)


def log_auth(keyring: KeyRing | None, host: str, port: int) -> None:
    """One line on how clients authenticate (a warning when they do not), once the server is up."""
    if keyring is None:
        log.warning("authentication is OFF (--no-auth): any process that can reach %s:%d can read and write every "
                    "cached chunk; use it only on a trusted network", host, port)
    else:
        log.info("authentication: CurveZMQ with the keys of %s, %d tenant(s)", keyring.creds.path,
                 len(keyring.creds.tenants))
