"""The kvtier wire protocol: msgspec messages (msgpack) between ``Client`` (ZMQ DEALER) and the server (ROUTER).

Framing: a client sends ``[header, *payload]``; the server answers ``[header, *payload]`` (the ROUTER adds
and strips the client identity). ``header`` is one msgpack map tagged by ``"t"`` (the message type);
``payload`` frames carry raw KV bytes, one frame per chunk, only when the shared-memory data plane is not
used. Every request has an ``id`` (int) and gets exactly one reply with the same ``id``: its ``...Reply``
type, ``Ok``, or ``Error(code, message)``. A header that cannot be decoded at all is answered with
``Error(id=-1, code="malformed")``. A request past a per-client bound (``kvtier.server.limits``) is answered
``Error(code="limit_exceeded")`` (``too_large`` for a prompt over ``server.max_prompt_tokens``).

Transport: ZMTP 3 with the CURVE mechanism (CurveZMQ, RFC 26) unless the server runs with ``--no-auth``:
the client pins the server's public key and presents a client key derived from its secret file
(``kvtier.auth``); the server's ZAP handler (``kvtier.auth.zap``) accepts only known keys, names the tenant
(``User-Id``) and assigns the connection's routing id. No message below flows before that handshake.

Exchanges:
  * ``Hello`` -> ``HelloReply`` (chunk and block size, hash algorithm and seed, data plane, lease, tenant) or
    ``Error``. A tenant's session gets no shared memory, and every namespace it names is mixed with its
    tenant (``keys.tenant_namespace``).
  * ``Lookup`` -> ``LookupReply(num_tokens, num_l1_tokens)``: leading tokens held, the first
    ``num_l1_tokens`` of them in L1 and the rest in L2 (version 3; ``KVBackend.lookup_tiers``); answered on the
    request thread from L1 and the L2 adapters' in-memory indexes, never after L2 I/O.
  * ``Prefetch`` -> ``PrefetchReply(num_tokens)``: promote the prompt's leading chunks that only L2 holds into L1
    in the background (the connector sends it as soon as the scheduler knows a prompt); the reply comes when
    the promotion is done or after ``server.promote_timeout_seconds``, and says how many leading tokens L1
    holds then. Chunks gone from L2 meanwhile are a miss (a smaller ``num_tokens``), never an error. A client
    may send it without waiting for the reply (``Client.prefetch(wait=False)``) and drop the late reply.
  ``Lookup``, ``Prefetch``, ``StoreBegin`` and ``RetrieveBegin`` carry the prompt's ``tokens`` and, optionally, its per-block
  ``extra_keys`` (one entry per block of ``block_size`` tokens, a trailing partial block included: null or an
  array of keys; a key is a str, bin, int, null or an array of those; see ``kvtier.extra_keys.check_extra_keys``).
  The server checks them strictly (``bad_request`` names what is wrong) and hashes them as tuples. Instead of
  ``tokens`` they may carry ``pages`` (v6): the prompt's chunks by the digests the engine computed for its pages
  (SGLang's HiCache keys, ``kvtier.pages``), with ``tokens`` empty and no ``extra_keys`` or ``start``; the answers
  count tokens as pages times ``page_size``.
  * ``StoreBegin`` (optional retention hints ``priority``, ``ttl_seconds``, ``session_id``, v5) -> ``StoreSlots``
    (the chunks to write; ``offset`` into the shared L1 arena, or -1
    when the bytes travel as frames) -> ``StoreCommit`` (+ one frame per slot in frames mode) -> ``StoreDone``.
  * ``RetrieveBegin(shm=True)`` -> ``RetrieveSlots`` (pinned arena slots) -> client copies ->
    ``RetrieveEnd`` -> ``Ok`` (the copy is valid) or ``Error(lease_expired)`` (discard it).
  * ``RetrieveBegin(shm=False)`` -> ``RetrieveData`` + one frame per chunk.
    When the prompt continues past L1 into chunks an L2 adapter's index holds, the server first promotes them
    on its pool and answers when done (or after ``server.promote_timeout_seconds``, with what L1 holds: the
    rest is a miss); other requests are answered meanwhile, so replies to one client's requests keep their
    order only because a client sends one request at a time. So does ``Error(limit_exceeded)`` for a request
    past its principal's queue bound (``server/turns.py``): it is answered on arrival.
  * ``Clear(admin_token)`` -> ``ClearReply(num_chunks)`` at once: L1 is cleared before the reply (``num_chunks``
    L1 chunks dropped); L2 is cleared in the background after the writes queued before it (a later ``Flush``
    waits for it; lookups see no L2 chunk meanwhile). ``Error(unauthorized)`` unless the token matches the
    server's admin token (with none configured: unless ``allow_unauthenticated_admin``).
  * ``Flush`` -> ``FlushReply`` (deferred until L2 writes are done or the timeout; the client compares
    ``HelloReply.server_id`` to tell a restarted server); ``Ping`` -> ``Ok``; ``Stats`` -> ``StatsReply``;
    ``Bye`` -> ``Ok``.
No pickle: only msgpack and raw bytes cross the socket.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np

from kvtier.errors import InputError
from kvtier.hashing import as_token_array, check_token_ids
from kvtier.pages import PageChain

PROTOCOL_VERSION = 6  # 2: CurveZMQ transport, Clear.admin_token, HelloReply.tenant; 3: LookupReply.num_l1_tokens;
# 4: Prefetch, deferred replies (promotions on a pool); 5: StoreBegin retention hints; 6: ``pages`` (engine page keys)
MAX_HEADER_BYTES = 64 << 20  # a header holds token ids, never KV; 64 MiB is ~8M tokens
MAX_TOKENS = 8 << 20
MAX_PAGES = 1 << 16  # pages in one request's ``pages`` (SGLang asks about at most 128 a call); each is a chunk ref

Id = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
# token ids travel as one binary field: little-endian int64, 8 bytes per token (pack_tokens / unpack_tokens)
TokenIds = Annotated[bytes, msgspec.Meta(max_length=8 * MAX_TOKENS)]


class _Msg(msgspec.Struct, tag_field="t", forbid_unknown_fields=True, omit_defaults=True):
    id: Id


# ---- requests ---------------------------------------------------------------------------------------
class Hello(_Msg, tag="hello"):
    """Open a session: which cache (model, KV layout, namespace) this client reads and writes.

    ``layout``: ``KVLayout.to_dict()``; ``layout_id``: what the client computes for it (checked).
    ``expect``: server settings the client relies on (chunk_size, block_size, hash_algorithm, hash_seed,
    save_unfull_chunk); any difference refuses the session. ``host_id``: hostname and boot id, so the
    server offers shared memory only to a client on the same machine.
    """

    version: int
    model: str
    layout: dict[str, Any]
    layout_id: str
    namespace: str = ""
    host_id: str = ""
    pid: Annotated[int, msgspec.Meta(ge=0, lt=2**31)] = 0
    want_shm: bool = True
    expect: dict[str, Any] = {}


# per-block extra keys (vLLM's tagged form); validated by the server, not by the decoder (see check_extra_keys)
ExtraKeys = Annotated[list[Any], msgspec.Meta(max_length=MAX_TOKENS)]


class Pages(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A prompt named by its pages' digests instead of its tokens (v6; ``kvtier.pages.PageChain``: SGLang's page
    keys). Sent in ``pages`` with an empty ``tokens``; each page is one chunk of ``page_size`` tokens keyed by its
    digest, and the server hashes nothing. ``parent``: the digest before ``hashes[0]`` (events), or None."""

    hashes: Annotated[list[Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]],
                      msgspec.Meta(max_length=MAX_PAGES)]
    page_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    parent: Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)] | None = None


class _Prompt(_Msg):
    """The prompt a data request names (no tag: a base, never on the wire itself): its ``tokens`` or, v6, its
    ``pages``, with the ``namespace`` and per-block ``extra_keys`` its chunk keys take."""

    tokens: TokenIds
    namespace: str | None = None
    extra_keys: ExtraKeys | None = None
    pages: Pages | None = None  # v6: the prompt by its page digests (then tokens is empty)
    start: int = 0  # token offset: chunks before the one holding it are skipped (KVBackend start)


class Lookup(_Prompt, tag="lookup"):
    """How many leading tokens of the prompt the cache holds (``LookupReply``)."""


class StoreBegin(_Prompt, tag="store_begin"):
    """Reserve slots for a prompt's missing chunks. Retention hints (v5, ``kvtier.hints``): ``priority`` 0-3,
    ``ttl_seconds`` > 0, ``session_id``; checked by the server (``bad_request`` names the field) and applied at
    commit to every chunk of the prompt L1 holds."""

    shm: bool = True
    priority: Any = None  # typed loosely so the server's check_hint names the field in its error
    ttl_seconds: Any = None
    session_id: Any = None


class StoreCommit(_Msg, tag="store_commit"):
    """Commit (``ok``) or abort a reservation. In frames mode one frame per slot follows, in slot order."""

    ticket: Id
    ok: bool = True


class RetrieveBegin(_Prompt, tag="retrieve_begin"):
    """The KV of the prompt's leading chunks held: pinned slots (``shm``) or frames (``RetrieveSlots`` /
    ``RetrieveData``)."""

    shm: bool = True


class RetrieveEnd(_Msg, tag="retrieve_end"):
    ticket: Id


class Prefetch(_Prompt, tag="prefetch"):
    """Promote the leading L2-only chunks of ``tokens`` into L1 ahead of a retrieve (``PrefetchReply``; it counts
    from the prompt's first token, whatever ``start`` says)."""


class Clear(_Msg, tag="clear"):
    """Drop chunks of every cache: all tiers (``medium`` None), only L1 (``"CPU"``) or only L2 (``"STORAGE"``)."""

    medium: str | None = None
    admin_token: str | None = None


class Flush(_Msg, tag="flush"):
    """Answer once queued L2 writes are done, or after ``timeout_seconds`` (``FlushReply.done`` False); ``done`` is
    also False, once, when an L2 write of a store this connection committed was dropped or failed meanwhile."""

    timeout_seconds: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0


class Ping(_Msg, tag="ping"):
    pass


class Stats(_Msg, tag="stats"):
    pass


class Bye(_Msg, tag="bye"):
    pass


Request = (Hello | Lookup | StoreBegin | StoreCommit | RetrieveBegin | RetrieveEnd | Prefetch | Clear | Flush | Ping
           | Stats | Bye)


# ---- replies ----------------------------------------------------------------------------------------
class Slot(msgspec.Struct, array_like=True, frozen=True):
    """One chunk's place: index in the prompt, byte offset in the shared arena (-1: frames), size in bytes."""

    chunk_index: int
    offset: int
    nbytes: int


class HelloReply(_Msg, tag="hello_reply"):
    version: int
    server_id: str
    chunk_size: int
    hash_algorithm: str
    hash_seed: str
    save_unfull_chunk: bool
    lease_seconds: float
    max_message_bytes: int
    shm_name: str | None = None
    shm_capacity_bytes: int = 0
    block_size: int = 0  # tokens per hashed block (the engine's block size); 0 from servers before it existed
    tenant: str | None = None  # the tenant this connection authenticated as; None: full access


class LookupReply(_Msg, tag="lookup_reply"):
    """``num_tokens`` leading tokens held; the first ``num_l1_tokens`` of them in L1, the rest in L2 (v3)."""

    num_tokens: int
    num_l1_tokens: int = 0


class StoreSlots(_Msg, tag="store_slots"):
    """The L1 slots reserved for a store's missing chunks, under lease ``ticket`` until ``StoreCommit``."""

    ticket: int
    slots: list[Slot]


class StoreDone(_Msg, tag="store_done"):
    """A ``StoreCommit``'s answer: ``num_stored`` chunks became visible."""

    num_stored: int


class RetrieveSlots(_Msg, tag="retrieve_slots"):
    """Shared memory: the pinned L1 slots of the leading ``num_tokens`` held, under lease ``ticket`` until
    ``RetrieveEnd``."""

    ticket: int
    num_tokens: int
    slots: list[Slot]


class RetrieveData(_Msg, tag="retrieve_data"):
    """Frames: the leading ``num_tokens`` held, one payload frame per slot after this header (no lease)."""

    num_tokens: int
    slots: list[Slot]


class PrefetchReply(_Msg, tag="prefetch_reply"):
    """Leading tokens of the prompt L1 holds once the prefetch is done (or timed out)."""

    num_tokens: int


class ClearReply(_Msg, tag="clear_reply"):
    """A ``Clear``'s answer: ``num_chunks`` chunks dropped from L1 (L2's are dropped behind its queued writes)."""

    num_chunks: int


class FlushReply(_Msg, tag="flush_reply"):
    done: bool


class StatsReply(_Msg, tag="stats_reply"):
    stats: dict[str, Any]


class Ok(_Msg, tag="ok"):
    pass


class Error(msgspec.Struct, tag="error", tag_field="t", omit_defaults=True):
    """A typed refusal. ``code``: one of ``ERROR_CODES``; ``id`` is -1 when the request id was unreadable."""

    id: int
    code: str
    message: str


ERROR_CODES = ("malformed", "bad_request", "version_mismatch", "layout_mismatch", "config_mismatch",
               "no_session", "unknown_ticket", "lease_expired", "too_large", "bad_payload", "internal",
               "shutting_down", "unauthorized", "limit_exceeded")

Reply = (HelloReply | LookupReply | StoreSlots | StoreDone | RetrieveSlots | RetrieveData | PrefetchReply
         | ClearReply | FlushReply | StatsReply | Ok | Error)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_any_decoder = msgspec.msgpack.Decoder()


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of a request or reply."""
    return _encoder.encode(msg)


def decode_request(buf) -> Request:
    """Decode a request header. Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError``."""
    return _request_decoder.decode(buf)


def decode_reply(buf) -> Reply:
    """Decode a reply header. Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError``."""
    return _reply_decoder.decode(buf)


def pack_tokens(tokens) -> bytes:
    """Token ids (any 1-D int sequence) as the wire's little-endian int64 bytes. Raises InputError."""
    return as_token_array(tokens).astype("<i8", copy=False).tobytes()


def unpack_tokens(buf: bytes, *, check_ids: bool = True) -> np.ndarray:
    """The int64 token array of a ``tokens`` field. Raises InputError on a bad length or negative ids.
    ``check_ids`` False: the sign is left to the caller (the server resolves a prompt through
    ``PromptKeys.chunk_refs``, which checks the ids of a prompt it has not seen)."""
    if len(buf) % 8:
        raise InputError(f"tokens field holds {len(buf)} bytes, not a multiple of 8 (little-endian int64 ids)")
    arr = np.frombuffer(buf, dtype="<i8")
    return check_token_ids(arr) if check_ids else arr


def prompt_fields(tokens, extra_keys=None, start: int = 0) -> dict:
    """The prompt fields of a request about ``tokens`` (token ids, or a ``PageChain``): ``{"tokens": ...}`` or
    ``{"tokens": b"", "pages": Pages}``. Raises InputError for bad token ids, or a chain with ``extra_keys`` or a
    ``start`` (the server would refuse them)."""
    if isinstance(tokens, PageChain):
        if extra_keys is not None or start:
            raise InputError("a PageChain takes no extra_keys or start: the engine's page keys name its chunks")
        return {"tokens": b"", "pages": Pages(list(tokens.hashes), tokens.page_size, tokens.parent)}
    return {"tokens": pack_tokens(tokens)}


def unpack_prompt(msg, *, check_ids: bool = True):
    """The prompt of a request: its int64 token array (``unpack_tokens``), or the ``PageChain`` of its ``pages``.
    Raises InputError for bad tokens, or for ``pages`` next to tokens, extra keys or a start offset."""
    pages = getattr(msg, "pages", None)
    if pages is None:
        return unpack_tokens(msg.tokens, check_ids=check_ids)
    if msg.tokens or getattr(msg, "extra_keys", None) is not None or getattr(msg, "start", 0):
        raise InputError("a request with pages names its prompt by them alone: send no tokens, extra_keys or start")
    return PageChain(tuple(pages.hashes), pages.page_size, pages.parent)


def salvage_id(buf) -> int:
    """Best effort: the ``id`` of a header that failed strict decoding, or -1 (so the error still reaches its caller)."""
    try:
        obj = _any_decoder.decode(buf)
    except (msgspec.MsgspecError, RecursionError, MemoryError):
        return -1
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63 else -1
