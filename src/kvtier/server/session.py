"""Server sessions: the handshake and admin checks, and the records of connected clients and their leases."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

import numpy as np

from kvtier import __version__
from kvtier import protocol as P
from kvtier.cache import KVCache
from kvtier.cache.tickets import ChunkRef
from kvtier.config import KVTierConfig
from kvtier.errors import KVTierError
from kvtier.hashing import prefix_hashes
from kvtier.keys import tenant_namespace
from kvtier.layout import KVLayout
from kvtier.pages import PageChain
from kvtier.server.limits import ClientUsage


@dataclass(slots=True)
class Session:
    model: str
    namespace: str
    layout_id: str
    cache: KVCache
    shm: bool
    pid: int
    last_seen: float
    tenant: str | None = None  # None: full access (the server's own secret, or auth off)
    pid_start: int | None = None  # start time of process ``pid`` here (limits.pid_start_time); None: not visible
    usage: ClientUsage = field(default_factory=ClientUsage)  # what it holds, against server/limits.py bounds
    principal: str = ""  # who it counts under (server/principals.py)
    lost_writes: int = 0  # its committed chunks that will not reach L2 (counted by the L2 writer's thread) ...
    lost_reported: int = 0  # ... up to the last Flush reply, which says done=False when more were lost since

    def count_lost(self, num_chunks: int) -> None:
        """``StoreTicket.on_lost``: ``num_chunks`` of this session's stores will not be in L2."""
        self.lost_writes += num_chunks

    def flushed(self, drained: bool) -> bool:
        """A ``Flush`` reply's ``done``: the write queue ``drained`` and no write of this session lost since the
        last reply (a loss is reported once)."""
        if not drained:  # a timeout says False already; a loss is still told by the next Flush
            return False
        lost, seen = self.lost_writes, self.lost_reported
        self.lost_reported = lost
        return lost == seen

    def namespace_for(self, namespace: str | None) -> str | None:
        """A request's namespace as the server keys it (None: the session's default)."""
        return scoped_namespace(self.tenant, namespace)

    def prompt(self, msg) -> tuple[np.ndarray | PageChain, str | None]:
        """The prompt of a request with ``tokens`` as this session's cache takes it: the int64 token ids (their
        sign not checked here: ``PromptKeys.chunk_refs`` checks a prompt it has not seen), or the ``PageChain``
        of its ``pages`` (v6), and the namespace. Raises InputError for a tokens field that is not int64 ids or
        for pages next to tokens (``protocol.unpack_prompt``)."""
        return P.unpack_prompt(msg, check_ids=False), self.namespace_for(msg.namespace)

    def chunk_refs(self, msg, hasher=prefix_hashes) -> tuple[np.ndarray, list[ChunkRef]]:
        """``KVCache.chunk_refs`` of a request's prompt (``prompt``, with its extra keys): memoised, so the
        requests about one prompt hash it once. Raises InputError on bad tokens or extra keys."""
        return self.cache.chunk_refs(*self.prompt(msg), extra_keys=msg.extra_keys, hasher=hasher)

    def head_refs(self, msg) -> tuple[np.ndarray, list[ChunkRef], bool]:
        """``KVCache.head_refs`` of a request's prompt: its memoised refs, or its first chunk's alone."""
        return self.cache.head_refs(*self.prompt(msg), extra_keys=msg.extra_keys)


def scoped_namespace(tenant: str | None, namespace: str | None) -> str | None:
    """``namespace`` as the server keys it for a client of ``tenant``: the tenant's own, whatever it names."""
    return namespace if namespace is None or tenant is None else tenant_namespace(tenant, namespace)


@dataclass(slots=True)
class Lease:
    kind: str  # "store" | "retrieve"
    identity: bytes
    cache: KVCache
    ticket: object
    shm: bool
    started: float
    deadline: float
    slots: list = field(default_factory=list)
    usage: ClientUsage | None = None  # the owner's, released with the lease
    nbytes: int = 0  # reserved bytes (store)


class HandshakeRefused(KVTierError):
    """A Hello the server refuses; ``code`` is the protocol error code, the message says what differs."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def handshake_values(config: KVTierConfig) -> dict:
    """The settings a client must agree with (sent in HelloReply, checked against ``Hello.expect``)."""
    return {"chunk_size": config.chunk_size, "block_size": config.effective_block_size,
            "hash_algorithm": config.hash_algorithm, "hash_seed": config.hash_seed,
            "save_unfull_chunk": config.save_unfull_chunk}


# setting -> how the server is told (flag, or config key / variable where there is no flag)
_HOW = {"chunk_size": "--chunk-size", "block_size": "--block-size", "hash_algorithm": "--hash-algorithm",
        "hash_seed": "--hash-seed", "save_unfull_chunk": "save_unfull_chunk in --config (or KVTIER_SAVE_UNFULL_CHUNK)"}


def check_hello(msg: P.Hello, config: KVTierConfig, l1_capacity_bytes: int) -> KVLayout:
    """The client's KV layout if the session can open. Raises HandshakeRefused (version, layout or
    setting mismatch, empty model id) with a message naming both sides of the difference."""
    if msg.version != P.PROTOCOL_VERSION:
        raise HandshakeRefused("version_mismatch", f"client speaks protocol version {msg.version}, this server "
                               f"{P.PROTOCOL_VERSION} (kvtier {__version__}): upgrade the older side")
    try:
        layout = KVLayout.from_dict(msg.layout)
    except KVTierError as exc:
        raise HandshakeRefused("layout_mismatch", f"invalid KV layout: {exc}") from exc
    if layout.layout_id != msg.layout_id:
        raise HandshakeRefused("layout_mismatch", f"layout id differs: client computed {msg.layout_id}, server "
                               f"computes {layout.layout_id} for {layout.to_dict()}; kvtier versions differ")
    chunk_bytes = layout.chunk_bytes(config.chunk_size)
    if chunk_bytes > l1_capacity_bytes:
        raise HandshakeRefused("layout_mismatch", f"one chunk of this layout is {chunk_bytes} bytes, more than "
                               f"the whole L1 ({l1_capacity_bytes} bytes): raise --l1-size-gb")
    if not msg.model:
        raise HandshakeRefused("bad_request", "model id must not be empty")
    mine = handshake_values(config)
    unknown = sorted(set(msg.expect) - set(mine))
    if unknown:
        raise HandshakeRefused("bad_request", f"cannot check unknown settings {unknown}; known: {', '.join(mine)}")
    diffs = [f"{key} differs: client expects {want!r}, server uses {mine[key]!r} (start the server with "
             f"{_HOW[key]} {want})" for key, want in msg.expect.items() if want != mine[key]]
    if diffs:
        raise HandshakeRefused("config_mismatch", "; ".join(diffs))
    return layout


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


def frame_budget(slots, max_message_bytes: int) -> int:
    """How many leading ``slots`` fit in one message of ``max_message_bytes`` (KV frames)."""
    total = 0
    for i, slot in enumerate(slots):
        total += slot.nbytes
        if total > max_message_bytes:
            return i
    return len(slots)


def check_frames(payload: list, slots: list) -> str:
    """Why a frames ``StoreCommit``'s ``payload`` does not fit its ``slots`` ("" when it does)."""
    if len(payload) != len(slots):
        return f"expected {len(slots)} payload frames (one per slot), got {len(payload)}"
    for i, (frame, slot) in enumerate(zip(payload, slots)):
        if len(frame) != slot.nbytes:
            return f"frame {i} holds {len(frame)} bytes; slot {slot.chunk_index} needs {slot.nbytes}"
    return ""


def error_reply(msg, code: str, message: str) -> P.Error:
    """The ``Error`` answering request ``msg`` (``code``: one of ``kvtier.protocol``'s error codes)."""
    return P.Error(id=msg.id, code=code, message=message)


def limited_reply(metrics, msg, limit: str, message: str) -> P.Error:
    """``Error(limit_exceeded)`` for ``msg``, counted in ``kvtier_client_limit_exceeded_total{limit}``."""
    metrics.inc("kvtier_client_limit_exceeded_total", limit=limit)
    return P.Error(id=msg.id, code="limit_exceeded", message=message)
