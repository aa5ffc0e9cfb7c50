"""The management API's HTTP routes on the admin port (issue 19 §2); the operations are ``manage.py``.

Routes (bodies and answers are JSON; ``docs/deployment.md`` has examples)::

    POST /cache/lookup    {model, namespace?, tenant?, layout_id?, tokens | text + tokenizer, extra_keys?}
    POST /cache/pin       {... tokens | text + tokenizer | session_id, priority?}
    POST /cache/unpin     {... tokens | text + tokenizer | session_id}
    POST /cache/ttl       {... tokens | text + tokenizer | session_id, ttl_seconds, priority?}
    POST /cache/delete    {... tokens | text + tokenizer | session_id}
    GET  /cache/sessions  [?model=&namespace=&tenant=&layout_id=]

Who may call: a mutation (pin, unpin, ttl, delete) follows ``session.admin_refusal`` as ``POST /clear`` does (401
without the right token when one is set, 403 when none is set unless ``allow_unauthenticated_admin``). A read
(lookup, sessions: they tell what is cached) needs the token when one is set; with none set anyone may read the
namespaces of no tenant, and a tenant's only with ``allow_unauthenticated_admin``. A POST must carry a JSON body
(``Content-Type: application/json``), which no cross-site browser form can send (415 otherwise). Bad input is a
400 naming the field; unknown fields are refused.
"""

from __future__ import annotations

import asyncio

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvtier.errors import KVTierError
from kvtier.server.admin.access import admin_refusal, bearer_of, refused
from kvtier.server.admin.manage import Management, ManageError, Target, tokenize

FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data", "text/plain")
MAX_TEXT_CHARS_PER_TOKEN = 64  # text longer than this many characters per allowed prompt token is refused unread


class CacheRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A management call's body (see the module docstring; ``manage.py`` for the naming)."""

    model: str
    namespace: str = ""
    tenant: str | None = None
    layout_id: str | None = None
    tokens: list[int] | None = None
    text: str | None = None
    tokenizer: str | None = None  # the local folder of the model (transformers AutoTokenizer)
    add_special_tokens: bool = True
    extra_keys: list | None = None
    session_id: str | None = None
    priority: int | None = None
    ttl_seconds: float | None = None


_DECODER = msgspec.json.Decoder(CacheRequest)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class ManageRoutes:
    """The routes over one ``Management`` (``routes``) of a ``KVTierServer``'s parts; ``close`` stops its hashing
    process."""

    def __init__(self, server):
        self.config = server.config
        self.manage = Management(server.config, server.tiers, server.connections.known, server.keyring, server.limits)

    def close(self) -> None:
        self.manage.close()

    @property
    def routes(self) -> list[Route]:
        post = {"lookup": self._lookup, "pin": self._pin, "unpin": self._unpin, "ttl": self._ttl,
                "delete": self._delete}
        return [*(Route(f"/cache/{name}", self._endpoint(fn, mutation=name != "lookup"), methods=["POST"])
                  for name, fn in post.items()),
                Route("/cache/sessions", self._sessions, methods=["GET"])]

    # ---- who may call --------------------------------------------------------------------------
    def _reader(self, request: Request) -> tuple[bool, JSONResponse | None]:
        """(admin, refusal) of a read."""
        config = self.config
        if config.server.admin_token is None:
            return admin_refusal(config, None) is None, None
        refusal = refused(config, bearer_of(request))
        return refusal is None, refusal

    def _endpoint(self, operation, mutation: bool):
        async def endpoint(request: Request) -> Response:
            content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if content_type != "application/json":
                what = f"does not accept {content_type} (a browser form can send that cross-site)" \
                    if content_type in FORM_TYPES else "needs a JSON body"
                return _error(415, f"{request.url.path} {what}: send Content-Type: application/json")
            if mutation:
                admin, refusal = True, refused(self.config, bearer_of(request))
            else:
                admin, refusal = self._reader(request)
            if refusal is not None:
                return refusal
            body = await self._read_body(request)
            if isinstance(body, Response):
                return body
            try:
                req = _DECODER.decode(body)
            except msgspec.ValidationError as exc:
                return _error(400, f"invalid request body: {exc}")
            except msgspec.DecodeError as exc:
                return _error(400, f"the body is not JSON: {exc}")
            target = Target(req.model, req.namespace, req.tenant, req.layout_id, admin)
            try:
                answer = self._quick(target, req) if not mutation else None  # no hashing, no I/O: no thread hop
                if answer is None:
                    answer = await asyncio.to_thread(operation, target, req)
                return Response(msgspec.json.encode(answer), media_type="application/json")
            except ManageError as exc:
                return _error(exc.status, str(exc))
            except KVTierError as exc:  # InputError from a hint's checks: names the field
                return _error(400, str(exc))
        return endpoint

    async def _read_body(self, request: Request) -> bytes | Response:
        """The body, refused (413) past what the longest allowed prompt needs."""
        srv = self.config.server
        limit = srv.max_prompt_tokens * MAX_TEXT_CHARS_PER_TOKEN + (1 << 20)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                return _error(413, f"the body is over {limit} bytes: a prompt may have at most "
                                   f"server.max_prompt_tokens ({srv.max_prompt_tokens}) tokens")
            parts.append(part)
        return b"".join(parts)

    def _quick(self, target: Target, req: CacheRequest) -> dict | None:
        """The answer to a lookup of a prompt asked about before (its refs memoised): about 0.2 ms of work, done on
        the event loop; None for anything else (hashing, tokenizing: a worker thread). Raises as ``lookup``."""
        if req.tokens is None or req.text is not None or req.session_id is not None:
            return None
        return self.manage.lookup(target, req.tokens, req.extra_keys, memo_only=True)

    # ---- operations (on a worker thread, or the loop when quick) -------------------------------
    def _tokens(self, req: CacheRequest) -> list[int]:
        if (req.tokens is None) == (req.text is None):
            raise ManageError(400, "send exactly one of 'tokens' (token ids) and 'text' (with 'tokenizer')")
        if req.tokens is not None:
            return req.tokens
        max_tokens = self.config.server.max_prompt_tokens
        if len(req.text) > max_tokens * MAX_TEXT_CHARS_PER_TOKEN:
            raise ManageError(400, f"'text' of {len(req.text)} characters is longer than any prompt of "
                                   f"server.max_prompt_tokens ({max_tokens}) tokens")
        return tokenize(req.text, req.tokenizer, req.add_special_tokens)

    def _keys(self, target: Target, req: CacheRequest) -> list:
        """The chunk keys a mutation names: a prompt's (``tokens`` / ``text``) or a session's (``session_id``)."""
        if req.session_id is not None:
            if req.tokens is not None or req.text is not None:
                raise ManageError(400, "send 'session_id' or a prompt ('tokens' / 'text'), not both")
            return self.manage.session_keys(target, req.session_id)
        if req.tokens is None and req.text is None:
            raise ManageError(400, "name the chunks: 'tokens', 'text' (with 'tokenizer') or 'session_id'")
        return [r.key for r in self.manage.prompt_refs(target, self._tokens(req), req.extra_keys)[2]]

    def _lookup(self, target: Target, req: CacheRequest) -> dict:
        if req.session_id is not None:
            raise ManageError(400, "'session_id': lookup takes a prompt; GET /cache/sessions lists sessions")
        return self.manage.lookup(target, self._tokens(req), req.extra_keys)

    def _pin(self, target: Target, req: CacheRequest) -> dict:
        return self.manage.pin(self._keys(target, req), req.priority)

    def _unpin(self, target: Target, req: CacheRequest) -> dict:
        return self.manage.unpin(self._keys(target, req))

    def _ttl(self, target: Target, req: CacheRequest) -> dict:
        return self.manage.set_ttl(self._keys(target, req), req.ttl_seconds, req.priority)

    def _delete(self, target: Target, req: CacheRequest) -> dict:
        return self.manage.delete(self._keys(target, req))

    async def _sessions(self, request: Request) -> Response:
        admin, refusal = self._reader(request)
        if refusal is not None:
            return refusal
        query = request.query_params
        unknown = sorted(set(query) - {"model", "namespace", "tenant", "layout_id"})
        if unknown:
            return _error(400, f"unknown query parameters {unknown}: use model, namespace, tenant, layout_id")
        if "model" not in query and ("namespace" in query or "tenant" in query):
            return _error(400, "'namespace' and 'tenant' need 'model'")
        target = Target(query["model"], query.get("namespace", ""), query.get("tenant"), query.get("layout_id"),
                        admin) if "model" in query else None
        try:
            rows = await asyncio.to_thread(self.manage.sessions, target, admin)
        except ManageError as exc:
            return _error(exc.status, str(exc))
        return JSONResponse({"sessions": rows})
