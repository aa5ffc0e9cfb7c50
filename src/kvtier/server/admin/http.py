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
prompt's or a session's chunks, list sessions) is ``manage_http.py``; what /status shows, ``status.py``. Binds
127.0.0.1 unless told otherwise.

DNS rebinding: a web page can make a browser resolve its own domain to 127.0.0.1 and read the answers, so every
route but ``/healthz`` and ``/metrics`` answers only a ``Host`` that is an IP address, ``localhost`` or a name in
``server.admin_allowed_hosts`` (421 otherwise, naming that key): a page's own domain is none of these.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import threading

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvtier.errors import ConfigError, KVTierError
from kvtier.server.admin.access import admin_refusal, bearer_of, refused
from kvtier.server.admin.manage_http import FORM_TYPES, ManageRoutes
from kvtier.server.admin.status import public_status
from kvtier.server.admin.telemetry import CONTENT_TYPE, Telemetry

log = logging.getLogger(__name__)
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


def build_app(server, telemetry: Telemetry) -> Starlette:
    """The ASGI app over a ``KVTierServer`` (its state for /status and /healthz, ``clear()``, ``config``)."""

    async def healthz(request: Request) -> Response:
        healthy, reason = server.health()
        return PlainTextResponse("ok" if healthy else f"unhealthy: {reason}", status_code=200 if healthy else 503)

    async def status(request: Request) -> Response:
        admin = server.config.server.admin_token is not None and admin_refusal(server.config, bearer_of(request)) is None
        return JSONResponse(public_status(await asyncio.to_thread(server.status_snapshot), admin))

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
