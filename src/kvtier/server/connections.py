"""Connections: who is connected to the server, through which cache, under which principal, until when.

A part of ``KVTierServer`` (``server/server.py``). A *connection* is one client socket after its ``Hello`` (the
wire protocol says session: ``no_session``); kvtier's other session is a retention hint's ``session_id``, a
conversation, which this module never sees. It owns:

- the connection records (``Connection``: model, namespace, cache, shared memory, usage, principal), by the
  client socket's routing identity;
- the caches they use, made per (model, KV layout, namespace) on ``Hello`` over the shared tiers and forgotten
  once no connection or lease uses them (their chunks stay), and the management API's list of them
  (``KnownCaches``, bounded);
- the principals the connections count under (``server/principals.py``);
- idle expiry: a connection silent for ``max(2 x lease_seconds, 60 s)`` is closed as if it said ``Bye``.

Thread-safety: every method runs under the server's lock (the request loop, or the admin HTTP for ``records``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvtier import protocol as P
from kvtier.cache import KVCache
from kvtier.cache.tickets import ChunkRef
from kvtier.errors import ConfigError
from kvtier.hashing import prefix_hashes
from kvtier.keys import ChunkKey
from kvtier.pages import PageChain
from kvtier.proc import pid_start_time
from kvtier.server.handshake import HandshakeRefused, check_hello, handshake_values, scoped_namespace
from kvtier.server.limits import ClientLimits, ClientUsage
from kvtier.server.principals import Principals
from kvtier.server.replies import error_reply, limited_reply

log = logging.getLogger(__name__)
MAX_CACHES = 1024  # distinct (model, layout, namespace) a server keeps; more are refused
IDLE_SCAN_SECONDS = 1.0  # idle connections are looked for this often (each scan visits every connection)


KNOWN_CACHE_OVERHEAD_BYTES = 1024  # a kept KVCache and its entry besides its strings (tracemalloc: ~450 on 3.11)


class KnownCaches:
    """The server's caches by (model, KV layout id, namespace), the last made: the server forgets a cache once no
    session uses it (its chunks stay), the management API still reaches them through this. Bounded in memory:
    ``max_bytes`` of model ids, layout ids and namespaces (plus ``KNOWN_CACHE_OVERHEAD_BYTES`` each), the least
    recently opened forgotten first, and ``max_entries`` entries. Thread-safe."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._lock = threading.Lock()
        self._caches: OrderedDict[tuple[str, str, str], object] = OrderedDict()
        self.nbytes = 0  # estimated bytes of what is kept

    @staticmethod
    def cost(key: tuple[str, str, str]) -> int:
        return sum(len(part) for part in key) + KNOWN_CACHE_OVERHEAD_BYTES

    def note(self, key: tuple[str, str, str], cache) -> None:
        """A session opened ``cache`` (``key``: the server's cache key)."""
        with self._lock:
            if self._caches.pop(key, None) is None:
                self.nbytes += self.cost(key)
            self._caches[key] = cache
            while len(self._caches) > self.max_entries or (self.nbytes > self.max_bytes and len(self._caches) > 1):
                self.nbytes -= self.cost(self._caches.popitem(last=False)[0])

    def matching(self, model: str, namespace: str, layout_id: str | None = None) -> list:
        """The caches of ``model`` in ``namespace`` (of KV layout ``layout_id`` when given)."""
        with self._lock:
            return [c for (m, lay, ns), c in self._caches.items()
                    if m == model and ns == namespace and layout_id in (None, lay)]

    def of_key(self, key: ChunkKey):
        """The cache whose chunks ``key`` names (None: not known any more)."""
        with self._lock:
            for (m, _, ns), cache in self._caches.items():
                if m == key.model and ns == key.namespace and cache.keys.key_layout_id == key.layout_id:
                    return cache
        return None

    def models(self) -> list[str]:
        with self._lock:
            return sorted({m for m, _, _ in self._caches})


@dataclass(slots=True)
class Connection:
    """One client socket after its ``Hello``: what it opened and what it holds."""

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
        """``StoreTicket.on_lost``: ``num_chunks`` of this connection's stores will not be in L2."""
        self.lost_writes += num_chunks

    def flushed(self, drained: bool) -> bool:
        """A ``Flush`` reply's ``done``: the write queue ``drained`` and no write of this connection lost since the
        last reply (a loss is reported once)."""
        if not drained:  # a timeout says False already; a loss is still told by the next Flush
            return False
        lost, seen = self.lost_writes, self.lost_reported
        self.lost_reported = lost
        return lost == seen

    def namespace_for(self, namespace: str | None) -> str | None:
        """A request's namespace as the server keys it (None: the connection's default)."""
        return scoped_namespace(self.tenant, namespace)

    def prompt(self, msg) -> tuple[np.ndarray | PageChain, str | None]:
        """The prompt of a request with ``tokens`` as this connection's cache takes it: the int64 token ids (their
        sign not checked here: ``PromptKeys`` checks what it has not seen), or the ``PageChain`` of its
        ``pages``, and the namespace. Raises InputError for a tokens field that is not int64 ids or for pages next
        to tokens (``protocol.unpack_prompt``)."""
        return P.unpack_prompt(msg, check_ids=False), self.namespace_for(msg.namespace)

    def chunk_refs(self, msg, hasher=prefix_hashes) -> tuple[np.ndarray, list[ChunkRef]]:
        """``KVCache.chunk_refs`` of a request's prompt (``prompt``, with its extra keys): hashed once. Raises
        InputError on bad tokens or extra keys."""
        return self.cache.chunk_refs(*self.prompt(msg), extra_keys=msg.extra_keys, hasher=hasher)


class Connections:
    """The server's connections, their caches and principals (module docstring).

    Args:
        config: the configuration tree (``server.lease_seconds`` for idle expiry, ``known_caches_max_bytes``).
        tiers: the shared ``Tiers`` every cache is made over.
        limits: the per-client bounds (``server/limits.py``).
        metrics: ``kvtier_connected_clients`` is kept here.
        server_id: the server's (in every ``HelloReply``: a client tells a restart by it).
        shm_name: the shared L1's name (None: frames only); host_id: this host's (a same-host client may map it).
    """

    def __init__(self, config, tiers, limits: ClientLimits, metrics, server_id: str, shm_name: str | None,
                 host_id: str):
        self.config, self.tiers, self.limits, self.metrics = config, tiers, limits, metrics
        self.server_id, self.shm_name, self.host_id = server_id, shm_name, host_id
        self.principals = Principals(limits)
        self.caches: dict[tuple[str, str, str], KVCache] = {}
        self.known = KnownCaches(MAX_CACHES, config.server.known_caches_max_bytes)  # kept after their connections
        self.idle_seconds = max(2 * config.server.lease_seconds, 60.0)
        self._by_identity: dict[bytes, Connection] = {}
        self._refused_models: set[str] = set()  # models whose refusal was logged
        self._next_idle_scan = 0.0
        self.metrics.set("kvtier_connected_clients", 0)

    def get(self, identity: bytes) -> Connection | None:
        """The connection of a client socket's routing ``identity`` (None: it never said Hello, or is closed)."""
        return self._by_identity.get(identity)

    def records(self) -> list[Connection]:
        """Every open connection."""
        return list(self._by_identity.values())

    def __len__(self) -> int:
        return len(self._by_identity)

    def hello(self, identity: bytes, msg: P.Hello, auth: tuple[bool, str | None, str]):
        """Open (or, for a second ``Hello`` on one socket, reopen) the connection of ``identity``; the reply:
        ``HelloReply``, or an ``Error`` (unauthorized, a handshake refusal naming what differs, a principal past
        its connections, a model its lossy codecs may not serve)."""
        authenticated, tenant, principal = auth
        if not authenticated:  # every connection passes the ZAP handler; this one did not
            return error_reply(msg, "unauthorized", "connection not authenticated by this server")
        try:
            layout = check_hello(msg, self.config, self.tiers.l1.capacity_bytes)
        except HandshakeRefused as exc:
            return error_reply(msg, exc.code, str(exc))
        old = self._by_identity.get(identity)  # a second Hello on one socket: what it holds stays counted
        refusal = None if old is not None else self.principals.refusal(identity, principal)
        if refusal:  # before a cache is made for it
            return limited_reply(self.metrics, msg, *refusal)
        namespace = scoped_namespace(tenant, msg.namespace)
        cache = self._cache_for(msg, layout, namespace)
        if isinstance(cache, P.Error):
            return cache
        # one mapping of the arena reaches every slot, so a tenant's bytes travel as frames
        shm = bool(self.shm_name) and msg.want_shm and msg.host_id == self.host_id and tenant is None
        usage = old.usage if old is not None else self.principals.admit(identity, principal)
        connection = Connection(msg.model, namespace, layout.layout_id, cache, shm, msg.pid, time.monotonic(), tenant,
                                pid_start_time(msg.pid) if shm else None, usage, principal)
        self._by_identity[identity] = connection
        self.metrics.set("kvtier_connected_clients", len(self._by_identity))
        srv = self.config.server
        return P.HelloReply(id=msg.id, version=P.PROTOCOL_VERSION, server_id=self.server_id,
                            lease_seconds=srv.lease_seconds, max_message_bytes=srv.max_message_bytes,
                            shm_name=self.shm_name if shm else None,
                            shm_capacity_bytes=self.tiers.l1.capacity_bytes if shm else 0, tenant=tenant,
                            **handshake_values(self.config))

    def _cache_for(self, msg: P.Hello, layout, namespace: str) -> KVCache | P.Error:
        key = (msg.model, layout.layout_id, namespace)
        cache = self.caches.get(key)
        if cache is None:
            if len(self.caches) >= MAX_CACHES:
                return error_reply(msg, "bad_request", f"this server already serves {MAX_CACHES} caches")
            try:
                cache = KVCache(self.config, msg.model, layout, namespace=namespace, tiers=self.tiers)
            except ConfigError as exc:  # e.g. an adapter writes a lossy codec this model may not read
                # once per model (clients retry), and a bounded set (model ids come from the clients)
                if msg.model not in self._refused_models and len(self._refused_models) < MAX_CACHES:
                    self._refused_models.add(msg.model)
                    log.warning("refusing clients of model %r: %s", msg.model, exc)
                return error_reply(msg, "config_mismatch", str(exc))
            self.caches[key] = cache
        self.known.note(key, cache)
        return cache

    def close(self, identity: bytes, lease_caches: set[int]) -> None:
        """The connection of ``identity`` ended (``Bye``): forget it, and the caches no connection and no lease
        (``lease_caches``: their ``id()``) uses any more."""
        self._by_identity.pop(identity, None)
        self.principals.leave(identity)
        self._drop_unused_caches(lease_caches)
        self.metrics.set("kvtier_connected_clients", len(self._by_identity))

    def expire_idle(self, now: float, lease_caches: Callable[[], set[int]]) -> list[bytes]:
        """Close the connections silent for ``idle_seconds`` (looked for every ``IDLE_SCAN_SECONDS``); returns their
        identities. ``lease_caches``: as for ``close``, asked only when one is closed."""
        if now < self._next_idle_scan:
            return []
        self._next_idle_scan = now + IDLE_SCAN_SECONDS
        idle = [i for i, c in self._by_identity.items() if now - c.last_seen > self.idle_seconds]
        for identity in idle:
            del self._by_identity[identity]
            self.principals.leave(identity)
        if idle:
            self._drop_unused_caches(lease_caches())
            self.metrics.set("kvtier_connected_clients", len(self._by_identity))
        return idle

    def _drop_unused_caches(self, lease_caches: set[int]) -> None:
        """Forget caches no connection or lease uses (their chunks stay in L1 and L2 under their keys)."""
        used = {id(c.cache) for c in self._by_identity.values()} | lease_caches
        for key in [k for k, c in self.caches.items() if id(c) not in used]:
            del self.caches[key]
