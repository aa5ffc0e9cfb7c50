"""The kvtier server: one L1 (in shared memory) and one L2 cascade serving every engine on the host.

Threading model: one request thread runs ``serve_forever``: a ZMQ ROUTER answers the requests of
``kvtier.protocol`` under ``self.lock`` (shared with the admin HTTP thread), one per principal in turn
(``server/turns.py``), and never waits for L2 I/O.
Lookups read L1 and the L2 adapters' in-memory indexes (``L2Tier.lookup``; one they answer short over an L2
that other servers write to waits for a probe on the pool, ``server/lookup.py``); a retrieve whose prompt
continues into L2-only chunks, and every ``Prefetch``, is handed to the promotion pool
(``kvtier.server.promote``) and answered by the request thread when the pool finishes or when
``server.promote_timeout_seconds`` passes (then from L1 alone: the rest is a miss); ``Flush`` is answered
when the L2 write queue drains (``server/flushes.py``); ``Clear`` clears L1 at once and queues the L2 clear behind the writes.
L2 writes, probes and clears run on ``L2Tier``'s own daemon threads. Caches are made per
(model, KV layout, namespace) on ``Hello`` and share the tiers. Store, retrieve and prefetch, with the *leases*
on the L1 slots they hand out (expired here, by ``_expire``), are ``server/dataops.py``. Bounds per client,
principal and in all: ``server/limits.py``; a long prompt is hashed on a worker before its request is handled
(``server/prehash.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from functools import partial

import msgspec
import zmq

from kvtier import protocol as P
from kvtier.cache import KVCache, Tiers
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.foreground import FOREGROUND
from kvtier.metrics import Metrics
from kvtier.proc import host_id, pid_start_time
from kvtier.server.collector import IdleCollector
from kvtier.server.dataops import DataOps
from kvtier.server.flushes import Flushes
from kvtier.server.lookup import LookupProber
from kvtier.server.manage import KnownCaches
from kvtier.server.prehash import Prehasher
from kvtier.server.promote import Job, Promoter
from kvtier.server.listen import RequestSocket, readable, receive, send_reply
from kvtier.server.limits import ClientLimits, LeaseQuarantine
from kvtier.server.principals import Principals, principal_of
from kvtier.server.session import (
    HandshakeRefused,
    Session,
    admin_refusal,
    check_hello,
    error_reply,
    handshake_values,
    limited_reply,
    scoped_namespace,
)
from kvtier.server.trace import TraceRecorder
from kvtier.server.turns import MAX_QUEUED, NEW_CONNECTIONS, Turns
from kvtier.shm import hold_lock, reap_stale_shm

log = logging.getLogger(__name__)
MAX_CACHES = 1024  # distinct (model, layout, namespace) a server keeps; more are refused
IDLE_SCAN_SECONDS = 1.0  # idle sessions are looked for this often (each scan visits every session)


class KVTierServer:
    """ZMQ request server over shared ``Tiers``.

    Args:
        config: the configuration tree (``config.server`` holds sockets, lease and limits).
        shm_name: name of the L1 arena under /dev/shm; default ``kvtier-<pid>-<random>``.
            Ignored when ``config.server.shared_memory`` is false (anonymous L1, frames only).

    Raises:
        ConfigError: the port is in use or cannot be bound, L1 size 0, bad L2 adapter spec.
    """

    def __init__(self, config: KVTierConfig, *, shm_name: str | None = None):
        self.config = config
        self.metrics = Metrics()
        self.server_id = uuid.uuid4().hex
        self.started = time.time()
        self.lock = threading.RLock()  # the request loop and admin HTTP both mutate state under it
        self.stopping = threading.Event()
        self.heartbeat = time.monotonic()
        self.host_id = host_id()
        srv = config.server
        self.listener = RequestSocket(config, self._refused)
        self.port, self.keyring, self.sock, self.endpoint = (self.listener.port, self.listener.keyring,
                                                             self.listener.sock, self.listener.endpoint)
        if srv.shared_memory:
            reap_stale_shm()
            shm_name = shm_name or f"kvtier-{os.getpid()}-{self.server_id[:8]}"
        else:
            shm_name = None
        try:
            self.trace = TraceRecorder(config, self.metrics)  # a trace file that cannot be made: before the L1
        except BaseException:
            self.listener.close(started=False)
            raise
        try:
            self.tiers = Tiers(config, metrics=self.metrics, shm_name=shm_name, auth=self.keyring, index_lookups=True)
        except BaseException:
            self.trace.close()
            self.listener.close(started=False)
            raise
        self.shm_name = shm_name
        self._shm_lock = hold_lock(shm_name) if shm_name else None
        self.caches: dict[tuple[str, str, str], KVCache] = {}
        self._refused_models: set[str] = set()  # models whose refusal was logged
        self.known = KnownCaches(MAX_CACHES)  # for the management API, kept after their sessions are gone
        self.sessions: dict[bytes, Session] = {}
        self._next_idle_scan = 0.0
        self.session_idle_seconds = max(2 * srv.lease_seconds, 60.0)
        self.turns = Turns(srv.max_inflight_requests_per_principal if srv.client_limits else MAX_QUEUED)
        self.promoter = Promoter(srv.promote_threads, srv.max_promotions, self.metrics)
        self.prehash = Prehasher(srv.hash_offload_min_tokens, srv.max_hash_jobs, srv.promote_timeout_seconds,
                                  self.metrics, store_min_tokens=srv.store_hash_offload_min_tokens)
        self.lookups = LookupProber(self.tiers, self.promoter, srv.lookup_probe_timeout_seconds, self.metrics)
        self.limits = ClientLimits(srv, self.tiers.l1.capacity_bytes)
        self.principals = Principals(self.limits)
        self.quarantine = LeaseQuarantine(self.tiers.l1, self.metrics)
        self.flushes = Flushes(self.tiers.l2, self._send)
        self.data = DataOps(config, self.metrics, self.tiers, self.sessions, self.limits, self.quarantine, self.promoter,
                            self.lookups, self.lock, self._send, self.trace)
        self._handlers = {P.Ping: self._on_ping, P.Bye: self._on_bye, P.Stats: self._on_stats, P.Clear: self._on_clear,
                          P.Flush: self.flushes.on_flush, P.Lookup: self.data.lookup, P.StoreBegin: self.data.store_begin,
                          P.StoreCommit: self.data.store_commit, P.RetrieveBegin: self.data.retrieve_begin,
                          P.RetrieveEnd: self.data.retrieve_end, P.Prefetch: self.data.prefetch}
        self.collector = IdleCollector()
        self.metrics.set("kvtier_connected_clients", 0)

    # ---- loop ----------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Answer requests until ``stop()``; then abort outstanding leases. Call ``close()`` afterwards."""
        promoted, hashed = self.promoter.fileno(), self.prehash.fileno()
        poller = zmq.Poller()
        for source in (self.sock, promoted, hashed):
            poller.register(source, zmq.POLLIN)
        waiting = partial(readable, self.sock)  # a request received since the poll, not read yet
        self.collector.start()
        FOREGROUND.loop_started()  # background threads start their items while this loop waits for input
        try:
            srv = self.config.server
            tick_milliseconds = int(min(200, max(10, min(srv.lease_seconds, srv.promote_timeout_seconds) * 250)))
            while not self.stopping.is_set():
                self.heartbeat = time.monotonic()
                # woken at a deferred request's deadline; not waiting at all while requests wait for their turn
                with FOREGROUND.waiting(not self.turns):
                    ready = dict(poller.poll(0 if self.turns else self.promoter.poll_milliseconds(tick_milliseconds)))
                # only what is readable: an empty pipe or socket read costs an exception, several per request
                alone = self._receive() if self.sock in ready else None
                if promoted in ready:
                    self.data.answer_promotions(self.promoter.take_ready())
                if hashed in ready:
                    self._answer_hashed(self.prehash.take_ready())
                if alone is not None:  # a round of one request
                    self._dispatch(alone)
                for frames in self.turns.next_round():  # then the socket is read again: a new request waits one round
                    self._dispatch(frames)
                if self.promoter.waiting:  # deferred replies past their deadline
                    self.data.answer_promotions(self.promoter.take_expired(time.monotonic()), timed_out=True)
                if self.prehash.waiting:
                    self._answer_hashed(self.prehash.take_expired(time.monotonic()), timed_out=True)
                self._expire()
                if not self.turns:  # and, asked only when a collection is due, nothing more was received
                    self.collector.between_requests(waiting)
        finally:
            FOREGROUND.idle()
            self.collector.stop()
        with self.lock:
            self.data.abort_all()

    def stop(self) -> None:
        """Ask the loop to stop (safe from a signal handler or another thread)."""
        self.stopping.set()

    def _receive(self) -> list | None:
        """Move requests from the socket (``poll`` said it is readable) into their principal's turn
        (``server/turns.py``) until none is left or the turns are full; one past its principal's bounds is
        answered at once (``Error(limit_exceeded)``). Returns the frames of the one request read when it is the
        only one waiting (no turn queued, nothing more to read): its round is itself, handled without queueing."""
        while not self.turns.full:
            try:
                frames = receive(self.sock)
            except zmq.Again:  # a poll that said readable and found nothing
                return None
            more = readable(self.sock)  # no zmq.Again to raise after the last one
            if len(frames) >= 2:  # a ROUTER always prepends the identity; else there is nothing to answer
                if not more and not self.turns:  # what next_round would give at once
                    return frames
                identity = frames[0].bytes
                session = self.sessions.get(identity)
                if not self.turns.add(identity, session.principal if session is not None else NEW_CONNECTIONS, frames):
                    self.metrics.inc("kvtier_client_limit_exceeded_total", limit="principal_queued_requests")
                    self._send(identity, P.Error(id=P.salvage_id(frames[1].buffer), code="limit_exceeded", message=(
                        f"this principal has {self.turns.max_per_principal} requests (or "
                        f"{self.turns.max_bytes_per_principal} bytes) waiting for their turn; wait for replies")))
            if not more:
                return None
        return None

    def _dispatch(self, frames: list) -> None:
        identity, header, payload = frames[0].bytes, frames[1], frames[2:]
        with self.lock:
            reply, out = self._handle(identity, header, payload)
        if reply is not None:
            self._send(identity, reply, out)

    def _send(self, identity: bytes, reply, out=()) -> None:
        if out:  # libzmq releases a message's frames in order: the last one's tracker says all were sent
            out = [*out[:-1], zmq.Frame(out[-1], copy=False, track=True)]
        try:
            send_reply(self.sock, identity, P.encode(reply), out)
        except zmq.Again:  # max_unread_replies_per_client replies already wait for this client
            self.metrics.inc("kvtier_replies_dropped_total", reason="unread")
            return
        except zmq.ZMQError as exc:  # the client went away: nothing to do
            self.metrics.inc("kvtier_replies_dropped_total", reason="gone")
            log.debug("reply to a departed client dropped: %s", exc)
            return
        session = self.sessions.get(identity) if out else None
        if session is not None:  # KV frames: held by libzmq until the client reads them
            session.usage.add_unread(out[-1].tracker, sum(len(f) for f in out))

    def _handle(self, identity: bytes, header, payload: list) -> tuple[msgspec.Struct, list]:
        buf = header.buffer
        if len(buf) > P.MAX_HEADER_BYTES:
            return P.Error(id=-1, code="too_large", message=f"header of {len(buf)} bytes exceeds {P.MAX_HEADER_BYTES}"), []
        try:
            msg = P.decode_request(buf)
        except msgspec.ValidationError as exc:
            return P.Error(id=P.salvage_id(buf), code="bad_request", message=f"invalid request: {exc}"), []
        except Exception as exc:  # noqa: BLE001 -- DecodeError, and whatever else hostile bytes provoke
            return P.Error(id=P.salvage_id(buf), code="malformed", message=f"undecodable header: {exc}"), []
        return self._handle_msg(identity, msg, header, payload)

    def _handle_msg(self, identity: bytes, msg, header, payload: list, hashed: bool = False):
        try:
            if payload and not isinstance(msg, P.StoreCommit):
                return error_reply(msg, "bad_payload", f"{type(msg).__name__} takes no payload frames, got {len(payload)}"), []
            if isinstance(msg, P.Hello):
                return self._hello(identity, msg, principal_of(header, self.keyring is not None)), []
            session = self.sessions.get(identity)
            if session is None:
                return error_reply(msg, "no_session", "no session for this connection: send Hello first"), []
            session.last_seen = time.monotonic()
            refusal = self.limits.check_inflight(session.usage)
            if refusal:
                return limited_reply(self.metrics, msg, *refusal), []
            tokens = getattr(msg, "tokens", None)
            if tokens is not None and (refusal := self.limits.check_prompt(tokens, getattr(msg, "pages", None))):
                self.metrics.inc("kvtier_client_limit_exceeded_total", limit="prompt_tokens")
                return error_reply(msg, "too_large", refusal), []
            if not hashed and (parked := self.prehash.park(identity, session, msg)):  # a long prompt: hashed first
                return (None, []) if parked is True else (limited_reply(self.metrics, msg, "hash_jobs", parked), [])
            return self._handlers[type(msg)](identity, session, msg, payload)
        except KVTierError as exc:
            return error_reply(msg, "bad_request", str(exc)), []
        except Exception as exc:  # a bug must not take the server down: answer and log it
            log.exception("request %s failed", type(msg).__name__)
            return error_reply(msg, "internal", f"{type(exc).__name__}: {exc}"), []

    def _answer_hashed(self, jobs: list[Job], timed_out: bool = False) -> None:
        """Handle requests whose long prompt the hashing worker has put in the memo (``server/prehash.py``)."""
        for job in jobs:
            with self.lock:
                reply, out = (limited_reply(self.metrics, job.msg, "hash_jobs", self.prehash.late(job)), []) if timed_out else \
                    self._handle_msg(job.identity, job.msg, None, [], hashed=True)
            if reply is not None:
                self._send(job.identity, reply, out)

    # ---- handshake -----------------------------------------------------------------------------
    def _hello(self, identity: bytes, msg: P.Hello, auth: tuple[bool, str | None, str]):
        authenticated, tenant, principal = auth
        if not authenticated:  # every connection passes the ZAP handler; this one did not
            return error_reply(msg, "unauthorized", "connection not authenticated by this server")
        try:
            layout = check_hello(msg, self.config, self.tiers.l1.capacity_bytes)
        except HandshakeRefused as exc:
            return error_reply(msg, exc.code, str(exc))
        old = self.sessions.get(identity)  # a second Hello on one connection: what it holds stays counted
        refusal = None if old is not None else self.principals.refusal(identity, principal)
        if refusal:  # before a cache is made for it
            return limited_reply(self.metrics, msg, *refusal)
        namespace = scoped_namespace(tenant, msg.namespace)
        cache_key = (msg.model, layout.layout_id, namespace)
        cache = self.caches.get(cache_key)
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
            self.caches[cache_key] = cache
        self.known.note(cache_key, cache)
        # one mapping of the arena reaches every slot, so a tenant's bytes travel as frames
        shm = bool(self.shm_name) and msg.want_shm and msg.host_id == self.host_id and tenant is None
        usage = old.usage if old is not None else self.principals.admit(identity, principal)
        session = Session(msg.model, namespace, layout.layout_id, cache, shm, msg.pid, time.monotonic(), tenant,
                          pid_start_time(msg.pid) if shm else None, usage, principal)
        self.sessions[identity] = session
        self.metrics.set("kvtier_connected_clients", len(self.sessions))
        srv = self.config.server
        return P.HelloReply(id=msg.id, version=P.PROTOCOL_VERSION, server_id=self.server_id,
                            lease_seconds=srv.lease_seconds, max_message_bytes=srv.max_message_bytes,
                            shm_name=self.shm_name if shm else None,
                            shm_capacity_bytes=self.tiers.l1.capacity_bytes if shm else 0, tenant=tenant,
                            **handshake_values(self.config))

    # ---- requests ------------------------------------------------------------------------------
    def _on_ping(self, identity, session, msg, payload):
        return P.Ok(id=msg.id), []

    def _on_bye(self, identity, session, msg, payload):
        self.sessions.pop(identity, None)
        self.principals.leave(identity)
        self.quarantine.release_client(identity)  # a client says Bye between calls, never inside a copy
        self._drop_idle_caches()
        self.metrics.set("kvtier_connected_clients", len(self.sessions))
        return P.Ok(id=msg.id), []

    def _on_stats(self, identity, session, msg, payload):
        if session.tenant is not None:  # server-wide counters would show other tenants' traffic: its own only
            usage = session.usage
            return P.StatsReply(id=msg.id, stats={"tenant": session.tenant, "leases": usage.leases,
                                                  "reserved_bytes": usage.reserved_bytes,
                                                  "quarantined_bytes": usage.quarantined_bytes}), []
        self.tiers.refresh_gauges()
        return P.StatsReply(id=msg.id, stats=self.metrics.snapshot()), []

    def _on_clear(self, identity, session, msg, payload):
        refusal = admin_refusal(self.config, msg.admin_token)
        if refusal:
            return error_reply(msg, "unauthorized", refusal), []
        return P.ClearReply(id=msg.id, num_chunks=self.clear(msg.medium, wait=False)), []

    # ---- leases and sessions -------------------------------------------------------------------
    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            self.data.expire_leases(now)
            self.quarantine.sweep(now)
            self.flushes.answer(now)
            if now < self._next_idle_scan:
                return
            self._next_idle_scan = now + IDLE_SCAN_SECONDS
            idle = [i for i, s in self.sessions.items() if now - s.last_seen > self.session_idle_seconds]
            for identity in idle:
                del self.sessions[identity]
                self.principals.leave(identity)
            if idle:
                self._drop_idle_caches()
                self.metrics.set("kvtier_connected_clients", len(self.sessions))

    def _drop_idle_caches(self) -> None:
        """Forget caches no session or lease uses (their chunks stay in L1 and L2 under their keys)."""
        used = {id(s.cache) for s in self.sessions.values()} | self.data.lease_caches()
        for key in [k for k, c in self.caches.items() if id(c) not in used]:
            del self.caches[key]

    # ---- admin ---------------------------------------------------------------------------------
    def clear(self, medium: str | None = None, *, wait: bool = False) -> int:
        """Drop every chunk in L1 and L2, or only ``"CPU"`` (L1) / ``"STORAGE"`` (L2); in-flight reservations
        stay. L1 is cleared before returning; L2 is queued behind its pending writes (``L2Tier.clear_async``;
        lookups see no L2 chunk until it is done) unless ``wait`` (at most 30 s, never on the request thread).
        Returns the L1 chunks dropped. Raises InputError for another medium."""
        with self.lock:
            before = self.tiers.l1.num_chunks
            self.tiers.clear(medium, wait=False)
            self.trace.clear(medium)
            dropped = before - self.tiers.l1.num_chunks
        if wait:
            self.tiers.l2.flush()
        return dropped

    def close(self) -> bool:
        """Finish queued L2 writes (bounded by ``server.shutdown_timeout_seconds``), close the socket,
        unmap and unlink the shared L1, and delete the secret file it created at the default path for a port the OS
        picked (``--port 0``). Returns False if L2 writes were still pending at the deadline."""
        self.stopping.set()
        self.promoter.close()
        self.prehash.close()
        done = self.tiers.close(self.config.server.shutdown_timeout_seconds)
        self.trace.close()
        if self._shm_lock is not None:
            os.close(self._shm_lock)
        self.listener.close()
        return done

    def _refused(self, mechanism: str, address: str) -> None:
        self.metrics.inc("kvtier_auth_refused_total", socket="requests")

