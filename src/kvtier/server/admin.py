"""Admin HTTP for the server (starlette app served by uvicorn in a thread).

``GET /healthz`` (200 ``ok`` / 503 with the reason), ``GET /status`` (JSON, every secret masked: keys naming
one, ``user:password@`` and query strings of URLs such as an Azure SAS; namespaces are digests, never a
``cache_salt``; tenant names only with the admin token, else their count), ``GET /metrics`` (Prometheus text from OpenTelemetry
meters),
``POST /clear[?medium=CPU|STORAGE]``: a mutation, so it needs ``Authorization: Bearer <token>`` when an admin
token is set (401 otherwise) and is refused when none is set (403) unless ``allow_unauthenticated_admin``.
It never accepts what a browser can send cross-site without asking (a form post, ``text/plain``): the
request must carry a JSON body (``{"medium": "CPU"}`` or ``{}``) or the ``X-KVTier-Admin`` header (415 / 400
otherwise). Nothing is cleared when refused. The management API (``/cache/...``: look up, pin, TTL, delete a
prompt's or a session's chunks, list sessions) is ``server/manage_http.py``. Binds 127.0.0.1 unless told otherwise.

DNS rebinding: a web page can make a browser resolve its own domain to 127.0.0.1 and read the answers, so every
route but ``/healthz`` and ``/metrics`` answers only a ``Host`` that is an IP address, ``localhost`` or a name in
``server.admin_allowed_hosts`` (421 otherwise, naming that key): a page's own domain is none of these.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import logging
import re
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvtier import __version__
from kvtier.errors import ConfigError, KVTierError
from kvtier.protocol import PROTOCOL_VERSION
from kvtier.server.manage import shown_namespace
from kvtier.server.manage_http import FORM_TYPES, ManageRoutes, bearer_of, refused
from kvtier.server.session import admin_refusal
from kvtier.server.telemetry import CONTENT_TYPE, Telemetry

log = logging.getLogger(__name__)
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


_ANY_HOST_PATHS = ("/healthz", "/metrics")  # probes and scrapers may name the host as they like: nothing secret there


def host_allowed(host_header: str, names: frozenset[str]) -> bool:
    """Whether an HTTP ``Host`` header (``name[:port]``, ``[v6]:port``) names this server directly: an IP address,
    ``localhost`` or one of ``names`` (lower case). A DNS name outside those may be a rebinding page's own."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host.rstrip(".") in names


class HostCheck:
    """ASGI middleware: 421 for a request whose ``Host`` ``host_allowed`` refuses (module docstring)."""

    def __init__(self, app, allowed_names: list[str]):
        self.app = app
        self.names = frozenset(["localhost", *(n.lower().rstrip(".") for n in allowed_names)])

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in _ANY_HOST_PATHS:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not host_allowed(host, self.names):
                response = JSONResponse({"error": f"Host {host[:100]!r} is not a name of this server: use its IP "
                                         "address or localhost, or add the name to server.admin_allowed_hosts"},
                                        status_code=421)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def server_health(server) -> tuple[bool, str]:
    """(healthy, reason): the request loop is running and answering."""
    if server.stopping.is_set():
        return False, "shutting down"
    stalled = time.monotonic() - server.heartbeat
    if stalled > max(5.0, server.config.server.lease_seconds):
        return False, f"request loop has not run for {stalled:.1f} s"
    return True, "ok"


def server_status(server, admin: bool = False) -> dict:
    """Everything /status shows: version, uptime, health, config (secrets masked), L1, L2, clients."""
    server.tiers.refresh_gauges()
    l1 = server.tiers.l1
    config = server.config.model_dump(mode="json")
    config["server"].pop("admin_token", None)
    healthy, reason = server_health(server)
    snap = _sessions_and_leases(server)
    keyring = server.keyring
    auth = {"mechanism": "CURVE" if keyring else "NULL (--no-auth)",
            "path": str(keyring.creds.path) if keyring else None,  # a key naming a secret would be masked
            "num_tenants": len(keyring.creds.tenants) if keyring else 0}
    if admin:  # who the tenants are is the operator's business, not any local process's
        auth["tenants"] = sorted(keyring.creds.tenants) if keyring else []
    else:
        for client in snap["clients"]:
            if client["tenant"] is not None:  # its principal names the tenant too: a digest still tells clients apart
                client["tenant"] = "(hidden: send the admin token)"
                client["principal"] = "sha256:" + hashlib.sha256(str(client["principal"]).encode()).hexdigest()[:16]
    return redact({"version": __version__, "protocol_version": PROTOCOL_VERSION, "server_id": server.server_id,
                   "uptime_seconds": round(time.time() - server.started, 3), "healthy": healthy, "reason": reason,
                   "endpoint": server.endpoint, "auth": auth, "config": config,
                   "l1": {"used_bytes": l1.used_bytes, "capacity_bytes": l1.capacity_bytes,
                          "num_chunks": l1.num_chunks, "eviction_policy": server.config.eviction_policy,
                          "shm_name": server.shm_name},
                   "l2": server.tiers.l2.status(), "connected_clients": len(snap["clients"]), **snap})


def _sessions_and_leases(server) -> dict:
    """Sessions and leases as /status shows them (taken under the lock)."""
    with server.lock:
        now = time.monotonic()
        clients = [{"model": s.model, "namespace": shown_namespace(s.namespace), "tenant": s.tenant, "principal": s.principal,
                    "layout_id": s.layout_id, "pid": s.pid, "shared_memory": s.shm,
                    "idle_seconds": round(now - s.last_seen, 3),
                    "reserved_bytes": s.usage.reserved_bytes, "leases": s.usage.leases}
                   for s in server.sessions.values()]
        leases = server.data.lease_counts()
        return {"clients": clients, "leases": leases, "caches": len(server.caches),
                "promotions": {"waiting": len(server.promoter.waiting), "in_flight": server.promoter.in_flight},
                "queued_requests": len(server.turns),
                "quarantine": {"slots": server.quarantine.num_slots, "bytes": server.tiers.l1.quarantined_bytes}}


def build_app(server, telemetry: Telemetry) -> Starlette:
    """The ASGI app over a ``KVTierServer`` (its state for /status and /healthz, ``clear()``, ``config``)."""

    async def healthz(request: Request) -> Response:
        healthy, reason = server_health(server)
        return PlainTextResponse("ok" if healthy else f"unhealthy: {reason}", status_code=200 if healthy else 503)

    async def status(request: Request) -> Response:
        admin = server.config.server.admin_token is not None and admin_refusal(server.config, bearer_of(request)) is None
        return JSONResponse(await asyncio.to_thread(server_status, server, admin))

    async def metrics(request: Request) -> Response:
        body = await asyncio.to_thread(telemetry.render)
        return Response(body, media_type=CONTENT_TYPE)

    async def clear(request: Request) -> Response:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type in FORM_TYPES:
            return JSONResponse({"error": f"/clear does not accept {content_type} (a browser form can send that "
                                          "cross-site); send a JSON body or the X-KVTier-Admin header"}, status_code=415)
        refusal = refused(server.config, bearer_of(request))  # who asks, before what is asked
        if refusal is not None:
            return refusal
        body = {}
        if content_type == "application/json":
            try:
                body = json.loads(await request.body() or b"{}")
            except ValueError:
                body = None
            if not isinstance(body, dict):
                return JSONResponse({"error": "the JSON body must be an object, e.g. {\"medium\": \"CPU\"} or {}"},
                                    status_code=400)
        elif "x-kvtier-admin" not in request.headers:
            return JSONResponse({"error": "send a JSON body (Content-Type: application/json) or the X-KVTier-Admin "
                                          "header"}, status_code=400)
        if set(body) - {"medium"}:
            return JSONResponse({"error": f"unknown fields {sorted(set(body) - {'medium'})}; /clear takes "
                                          "{\"medium\": \"CPU\" | \"STORAGE\"} or {}"}, status_code=400)
        query = request.query_params.get("medium")
        if "medium" in body and query is not None and body["medium"] != query:
            return JSONResponse({"error": f"medium {body['medium']!r} in the body but {query!r} in the query; "
                                          "give it once"}, status_code=400)
        medium = body.get("medium", query)
        try:
            # off the request thread: this one may wait for the L2 clear (at most 30 s)
            num_chunks = await asyncio.to_thread(server.clear, medium, wait=True)
        except KVTierError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"cleared": True, "medium": medium, "num_l1_chunks": num_chunks})

    manage = ManageRoutes(server)
    app = Starlette(routes=[Route("/healthz", healthz), Route("/status", status), Route("/metrics", metrics),
                            Route("/clear", clear, methods=["POST"]), *manage.routes],
                    middleware=[Middleware(HostCheck, allowed_names=server.config.server.admin_allowed_hosts)])
    app.state.manage = manage  # closed by AdminHTTP.stop (its hashing process)
    return app


class AdminHTTP:
    """Runs the admin app on ``host:port`` in a daemon thread. The port is bound in the constructor,
    so a port in use is a ConfigError at startup, not a log line in a thread."""

    def __init__(self, server, telemetry: Telemetry, host: str, port: int):
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP; with
        # Nagle on, a keep-alive client waited out its delayed ACK (~40 ms) for every response's body
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                  socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
            self.sock.listen(128)
        except OSError as exc:
            self.sock.close()
            raise ConfigError(f"cannot listen on {host}:{port} (--admin-host/--admin-port): {exc.strerror}; "
                              "pick another --admin-port") from exc
        self.host, self.port = host, self.sock.getsockname()[1]
        self.app = build_app(server, telemetry)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                access_log=False)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self.sock]},
                                        name="kvtier-admin-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Ask uvicorn to exit and wait at most ``timeout_seconds`` for its thread."""
        self._uvicorn.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_seconds)
        self.sock.close()
        self.app.state.manage.close()
