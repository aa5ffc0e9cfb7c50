"""Who may use the admin plane: the admin token (``server.admin_token``) and what answers a caller without it.

A mutation (``POST /clear``, the ZMQ ``Clear``, the management API's pin / unpin / ttl / delete) needs the token
when one is set; with none set, only ``allow_unauthenticated_admin`` allows it. Over HTTP the token is sent as
``Authorization: Bearer <token>``; a refusal is 401 (a token is set: send it) or 403 (none is set).
"""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvtier.config import KVTierConfig


def admin_refusal(config: KVTierConfig, token: str | None) -> str | None:
    """Why a mutation (clear) with admin ``token`` is refused, or None when it is allowed: with
    ``server.admin_token`` set the token must match; with none set only ``allow_unauthenticated_admin`` allows it."""
    srv = config.server
    if srv.admin_token is None:
        if srv.allow_unauthenticated_admin:
            return None
        return ("no admin token is configured, so mutations are refused: set server.admin_token (--admin-token / "
                "KVTIER_ADMIN_TOKEN), or allow them explicitly with --allow-unauthenticated-admin")
    if token is None or not hmac.compare_digest(token.encode(), srv.admin_token.get_secret_value().encode()):
        return "missing or wrong admin token"
    return None


def bearer_of(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None without one; the scheme in any case, as
    RFC 9110 has it)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def refused(config, token: str | None) -> JSONResponse | None:
    """The 401 / 403 answer to a mutation ``session.admin_refusal`` refuses (None: allowed)."""
    refusal = admin_refusal(config, token)
    if refusal is None:
        return None
    if config.server.admin_token is None:
        return JSONResponse({"error": refusal}, status_code=403)
    return JSONResponse({"error": f"{refusal}: send 'Authorization: Bearer <token>'"}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})
