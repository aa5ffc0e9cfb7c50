"""What ``GET /status`` shows: the server's ``status_snapshot`` with every secret masked.

Masked: keys naming a secret (``is_secret_key``), ``user:password@`` and query strings of URLs (an Azure SAS);
the admin token is left out. Namespaces are shown as the connectors make them (digests, never a ``cache_salt``)
or as a digest of what a client chose. Tenant names, and the principals that name them, only to the admin:
anyone else sees their count.
"""

from __future__ import annotations

import hashlib
import re

from kvtier import __version__
from kvtier.protocol import PROTOCOL_VERSION
from kvtier.server.admin.manage import shown_namespace

# a key is a secret when one of its words (split at "_", "-", ".") is one of these; whole words, so that
# max_prompt_tokens or hash_offload_min_tokens stay visible while admin_token, aws_secret_access_key, sas_token,
# l2_record_key are masked. A "*_file" key is a path (auth_secret_file, tls_ca_file): shown, its content never is
_SECRET_WORDS = frozenset({"key", "secret", "token", "password", "passwd", "pwd", "credential", "credentials",
                           "sas", "sig", "signature"})
_SECRET_KEYS = frozenset({"connection_string", "connectionstring", "accountkey", "sharedaccesssignature"})
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
_URL_QUERY = re.compile(r"(?<=[a-z]://)([^\s?#]*)\?[^\s#]*", re.IGNORECASE)  # SAS tokens travel as the query string


def is_secret_key(key) -> bool:
    """Whether a mapping key names a secret: a word of it is a secret word, or it is a known secret name."""
    name = str(key).lower()
    if name.endswith("_file"):
        return False
    return name in _SECRET_KEYS or not _SECRET_WORDS.isdisjoint(re.split(r"[_\-.\s]+", name))


def redact(value):
    """A copy of a JSON-like value with secrets masked: keys naming a secret (``is_secret_key``), user:password
    and query strings of URLs."""
    if isinstance(value, dict):
        return {k: "***" if is_secret_key(k) and v is not None else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URL_QUERY.sub(r"\1?***", _URL_USERINFO.sub("***@", value))
    return value


def public_status(snapshot: dict, admin: bool) -> dict:
    """The ``/status`` body of ``KVTierServer.status_snapshot()`` (not mutated); ``admin``: the caller sent the
    admin token (then tenant names are shown)."""
    auth = dict(snapshot["auth"])
    tenants = auth.pop("tenants")
    auth["num_tenants"] = len(tenants)
    if admin:  # who the tenants are is the operator's business, not any local process's
        auth["tenants"] = tenants
    clients = []
    for client in snapshot["clients"]:
        client = {**client, "namespace": shown_namespace(client["namespace"])}
        if client["tenant"] is not None and not admin:  # its principal names the tenant too: a digest tells apart
            client["tenant"] = "(hidden: send the admin token)"
            client["principal"] = "sha256:" + hashlib.sha256(str(client["principal"]).encode()).hexdigest()[:16]
        clients.append(client)
    config = dict(snapshot["config"])
    config["server"] = {k: v for k, v in config["server"].items() if k != "admin_token"}
    return redact({"version": __version__, "protocol_version": PROTOCOL_VERSION, **snapshot, "auth": auth,
                   "config": config, "clients": clients, "connected_clients": len(clients)})
