"""The secret file: a server's secret and its tenants', who reads which file, and writing them safely.

The secret file (YAML or JSON, mode 0600, owned by the user reading it) holds::

    secret: <64 hex>            # the server's own secret: full access to every namespace
    tenants:                    # optional: tenant name -> that tenant's secret
      team-a: <64 hex>
    subscribers:                # optional: KV event subscriber name -> its secret (reads every event, nothing else)
      router-1: <64 hex>

A tenant's engines get a credential file of their own (``kvtier auth tenant``)::

    tenant: team-a
    secret: <64 hex>            # team-a's secret
    server_key: <40 chars>      # the server's CurveZMQ public key (Z85), not a secret

A subscriber's file (``kvtier auth subscriber``) has ``subscriber: <name>`` instead of ``tenant``.

Default path: ``$XDG_RUNTIME_DIR/kvtier/server-<port>.secret`` (or ``~/.local/state/kvtier/...``), so a
client of the same OS user on the same host finds the file from the server's URL alone.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from zmq.utils import z85

from kvtier.auth.curve import curve_keypair
from kvtier.errors import ConfigError

ENV_SECRET_FILE = "KVTIER_AUTH_SECRET_FILE"
FULL_ACCESS = "*"  # the ZAP User-Id of a client holding the server's own secret
MIN_SECRET_CHARS = 32
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_URL_RE = re.compile(r"^tcp://(?:\[[^\]]*\]|[^:/]*):(\d+)/?$")


@dataclass(frozen=True)
class Credentials:
    """One secret file's contents. ``tenant`` is None for the server's own (full access) secret."""

    path: Path
    secret: str
    tenant: str | None = None
    server_key: str | None = None  # Z85 public key; derived from ``secret`` when tenant is None
    tenants: dict[str, str] = field(default_factory=dict)
    subscribers: dict[str, str] = field(default_factory=dict)
    subscriber: str | None = None  # a subscriber credential file's name

    def client_keypair(self) -> tuple[bytes, bytes]:
        """(public, secret) CurveZMQ client keys, Z85."""
        return curve_keypair(self.secret, "client")

    def server_public_key(self) -> bytes:
        """The Z85 public key the server must prove it holds."""
        return self.server_key.encode() if self.server_key else curve_keypair(self.secret, "server")[0]

    def principals(self) -> dict[bytes, str]:
        """Raw 32-byte client public key -> ZAP User-Id (``"*"`` or the tenant name), for the server."""
        out = {z85.decode(curve_keypair(self.secret, "client")[0]): FULL_ACCESS}
        for name, tenant_secret in self.tenants.items():
            out[z85.decode(curve_keypair(tenant_secret, "client")[0])] = name
        return out

    def event_principals(self) -> dict[bytes, str]:
        """``principals()`` plus the subscriber keys, which read every event (User-Id ``"*"``) and are
        accepted on the KV event sockets only, never on the request port."""
        out = self.principals()
        for subscriber_secret in self.subscribers.values():
            out.setdefault(z85.decode(curve_keypair(subscriber_secret, "client")[0]), FULL_ACCESS)
        return out


def state_dir(environ=None) -> Path:
    """Where default secret files live: ``$XDG_RUNTIME_DIR/kvtier`` or ``~/.local/state/kvtier``."""
    environ = os.environ if environ is None else environ
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "kvtier"
    return Path(environ.get("HOME") or Path.home()) / ".local" / "state" / "kvtier"


def default_secret_file(port: int, environ=None) -> Path:
    """The secret file a server on ``port`` uses unless ``server.auth_secret_file`` says otherwise."""
    return state_dir(environ) / f"server-{port}.secret"


def secret_file_for(url: str, secret_file: str | os.PathLike | None = None, environ=None) -> tuple[Path | None, bool]:
    """(path, explicit): the secret file a client of ``url`` reads: ``secret_file``, else
    ``$KVTIER_AUTH_SECRET_FILE``, else the default for the URL's port (None for a URL without a port)."""
    environ = os.environ if environ is None else environ
    chosen = secret_file or environ.get(ENV_SECRET_FILE)
    if chosen:
        return Path(chosen).expanduser(), True
    match = _URL_RE.match(url)
    return (default_secret_file(int(match.group(1)), environ) if match else None), False


def read_credentials(path: str | os.PathLike) -> Credentials:
    """Parse and check a secret file. Raises ConfigError: missing, readable by other users, not owned by
    this user, or malformed (each message names the file and the fix)."""
    path = Path(path)
    try:
        info = path.stat()
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"secret file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {path}: {exc.strerror}") from None
    if info.st_uid != os.getuid():
        raise ConfigError(f"secret file {path} belongs to uid {info.st_uid}, not to this user ({os.getuid()}); "
                          "copy it to a file of your own with mode 0600")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(f"secret file {path} is readable by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                          f"run: chmod 600 {path}")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"secret file {path} is not valid YAML/JSON: {exc}") from None
    return _parse(path, data)


def _parse(path: Path, data) -> Credentials:
    if not isinstance(data, dict) or not isinstance(data.get("secret"), str):
        raise ConfigError(f"secret file {path} must be a mapping with a 'secret' string (see kvtier.auth.secret_file)")
    valid = ("secret", "tenants", "subscribers", "tenant", "subscriber", "server_key")
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"secret file {path}: unknown keys {unknown}; valid: {', '.join(valid)}")
    named: dict[str, dict] = {}
    for section, what in (("tenants", "tenant"), ("subscribers", "subscriber")):
        named[section] = data.get(section) or {}
        if not isinstance(named[section], dict):
            raise ConfigError(f"secret file {path}: {section!r} must map {what} names to secrets")
        for name, value in [(None, data["secret"]), *named[section].items()]:
            if name is not None and not _TENANT_RE.match(str(name)):
                raise ConfigError(f"secret file {path}: {what} name {name!r} must be 1-64 characters of "
                                  "A-Z a-z 0-9 _ . -")
            if not isinstance(value, str) or len(value) < MIN_SECRET_CHARS:
                raise ConfigError(f"secret file {path}: the secret{f' of {what} {name!r}' if name else ''} must "
                                  f"be a string of at least {MIN_SECRET_CHARS} characters (e.g. 64 hex digits)")
    server_key = data.get("server_key")
    for role in ("tenant", "subscriber"):
        name = data.get(role)
        if name is not None and (not _TENANT_RE.match(str(name)) or not isinstance(server_key, str)):
            raise ConfigError(f"secret file {path}: a {role} credential needs a valid {role!r} name and the "
                              f"server's 'server_key'; make one with: kvtier auth {role} NAME")
    if server_key is not None and (not isinstance(server_key, str) or len(server_key) != 40):
        raise ConfigError(f"secret file {path}: 'server_key' must be the server's 40-character Z85 public key")
    return Credentials(path, data["secret"], data.get("tenant"), server_key,
                       {str(k): v for k, v in named["tenants"].items()},
                       {str(k): v for k, v in named["subscribers"].items()}, data.get("subscriber"))


def load_or_create(path: str | os.PathLike) -> tuple[Credentials, bool]:
    """The server's credentials at ``path``, creating the file (new random secret, mode 0600, folder 0700)
    when it does not exist. Returns (credentials, created). Raises ConfigError as ``read_credentials``."""
    path = Path(path)
    created = False
    if not path.exists():
        private_dir(path.parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, f"secret: {secrets.token_hex(32)}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a file another server created meanwhile
            created = True
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    creds = read_credentials(path)
    if creds.tenant is not None:
        raise ConfigError(f"{path} is a tenant's credential file, not a server secret file")
    return creds, created


def private_dir(directory: Path) -> None:
    """Create ``directory`` (and parents) with mode 0700; tighten it if this user owns it and it is wider."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, 0o700)


def tenant_credentials(server: Credentials, tenant: str) -> str:
    """The YAML text of ``tenant``'s credential file (its secret and the server's public key)."""
    return yaml.safe_dump({"tenant": tenant, "secret": server.tenants[tenant],
                           "server_key": server.server_public_key().decode()}, sort_keys=False)


def subscriber_credentials(server: Credentials, subscriber: str) -> str:
    """The YAML text of KV event subscriber ``subscriber``'s credential file."""
    return yaml.safe_dump({"subscriber": subscriber, "secret": server.subscribers[subscriber],
                           "server_key": server.server_public_key().decode()}, sort_keys=False)


def add_tenant(path: str | os.PathLike, tenant: str, *, role: str = "tenant") -> Credentials:
    """Add ``tenant`` (``role="subscriber"``: a KV event subscriber) with a new random secret to the server
    secret file at ``path`` (kept if it exists). Raises ConfigError for a bad name or file."""
    if not _TENANT_RE.match(tenant):
        raise ConfigError(f"{role} name {tenant!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
    creds, _ = load_or_create(path)
    tenants, subscribers = dict(creds.tenants), dict(creds.subscribers)
    chosen = subscribers if role == "subscriber" else tenants
    if tenant in chosen:
        return creds
    chosen[tenant] = secrets.token_hex(32)
    data = {"secret": creds.secret, "tenants": tenants}
    if subscribers:
        data["subscribers"] = subscribers
    write_private(Path(path), yaml.safe_dump(data, sort_keys=False))
    return read_credentials(path)


def check_writable(path: Path) -> None:
    """Raise ConfigError unless a file can be written at ``path``: its folder exists, is a folder, and this
    user may create files in it; ``path`` itself is not a folder. Checked before anything is changed."""
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"cannot write {path}: folder {folder} does not exist; create it or choose another path")
    if path.is_dir():
        raise ConfigError(f"cannot write {path}: it is a folder; give a file name")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {path}: no permission to create files in {folder}")


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text`` in a file of mode 0600.

    Raises:
        ConfigError: the file could not be written (the folder is missing or not writable, disk full, ...).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


def client_credentials(url: str, secret_file: str | os.PathLike | None = None) -> tuple[Credentials | None, Path | None, str]:
    """(credentials or None, the path looked at, a problem to report or ""). No file at the default path is
    no problem (the server may run without authentication); a file that is named but missing or unsafe is."""
    path, explicit = secret_file_for(url, secret_file)
    if path is None:
        return None, None, ""
    try:
        return read_credentials(path), path, ""
    except ConfigError as exc:
        if not explicit and not path.exists():
            return None, path, ""
        return None, path, str(exc)
