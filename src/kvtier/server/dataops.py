"""DataOps: the server's data path (store, retrieve, prefetch), their leases and the promotions they start.

A part of ``KVTierServer`` (``server/server.py``), made by its constructor with what it uses and owning the lease
table. The server's dispatch calls ``store_begin`` / ``store_commit`` / ``retrieve_begin`` / ``retrieve_end`` /
``prefetch`` on the request thread under the server's lock. None of them waits for L2 I/O: L2 reads go to the
promotion pool (``_promote_later``), and ``answer_promotions``, called by the request loop when the pool hands jobs
back, takes the lock itself.

Life cycle: store and retrieve hand out L1 slots; each reservation or pin is a *lease* that expires after
``server.lease_seconds`` (``DataOps.expire_leases``, from the request loop): an expired store is aborted (its half-written chunk never
becomes visible; its slots are quarantined while the client may still write into them, ``server/limits.py``)
and an expired retrieve is unpinned (the client's late ``RetrieveEnd`` gets ``lease_expired`` and discards what
it copied).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvtier import protocol as P
from kvtier.errors import KVTierError
from kvtier.hints import check_hint
from kvtier.cache import KVCache
from kvtier.server.connections import Connection
from kvtier.server.jobs import Job
from kvtier.server.limits import ClientUsage, ExpiryLog
from kvtier.server.replies import error_reply, limited_reply

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Lease:
    """L1 slots handed to a client (reserved for a store, pinned for a retrieve) until ``deadline``."""

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


class DataOps:
    """Store / retrieve / prefetch handlers and their leases.

    Args:
        config: the server's configuration (``config.server``: lease, promotion and message bounds).
        metrics: the server's metrics (counted here: store / retrieve seconds, lease expiries, promotions).
        tiers: the shared ``Tiers`` (L1 slots are reserved and pinned here; L2 is only asked through its index).
        connections: the server's ``Connections`` (``get`` only here: a promotion's client may be gone).
        limits, quarantine: the server's ``ClientLimits`` and ``LeaseQuarantine`` (``server/limits.py``).
        pool, lookups: the job pool and the lookup requests' part (``server/jobs.py``, ``server/lookup.py``).
        lock: the server's lock (``answer_promotions`` runs outside the request dispatch and takes it).
        send: ``send(identity, reply, frames)``, the server's reply path.
        trace: the server's ``TraceRecorder`` (``server/trace.py``): told every answered lookup and prefetch,
            every store and retrieve as its slots are handed out, and the end of their leases.

    Owns the lease table: ``leases`` (ticket -> ``Lease``), the deadline heap, the ticket counter and the
    recently expired tickets.
    """

    def __init__(self, config, metrics, tiers, connections, limits, quarantine, pool, lookups,
                 lock, send, trace) -> None:
        self.config, self.metrics, self.tiers, self.connections = config, metrics, tiers, connections
        self.limits, self.quarantine, self.pool, self.lookups = limits, quarantine, pool, lookups
        self.lock, self._send, self.trace = lock, send, trace
        self.leases: dict[int, Lease] = {}
        # (deadline, ticket) of every lease, ended ones too until their deadline: expiry never scans all leases
        self._lease_deadlines: list[tuple[float, int]] = []
        self._expired: deque[int] = deque(maxlen=4096)  # recently expired tickets: "lease_expired", not "unknown"
        self._next_ticket = 1
        self._expiry_log = ExpiryLog()

    def lease_counts(self) -> dict[str, int]:
        """Live leases by kind (``store``, ``retrieve``), for ``/status``."""
        kinds = [lease.kind for lease in self.leases.values()]
        return {"store": kinds.count("store"), "retrieve": kinds.count("retrieve")}

    def lease_caches(self) -> set[int]:
        """``id()`` of every cache a live lease uses (such a cache must not be dropped)."""
        return {id(lease.cache) for lease in self.leases.values()}

    def abort_all(self) -> None:
        """End every live lease as failed (the server stops): stores aborted, retrieves unpinned."""
        for ticket in list(self.leases):
            self._end_lease(self._pop_lease(ticket), ok=False)

    def _new_lease(self, kind: str, identity: bytes, session: Connection, ticket, shm: bool, slots, started: float) -> int:
        tid = self._next_ticket
        self._next_ticket += 1
        nbytes = ticket.nbytes if kind == "store" else 0
        deadline = started + self.config.server.lease_seconds
        self.leases[tid] = Lease(kind, identity, session.cache, ticket, shm, started, deadline, slots, session.usage,
                                 nbytes)
        heapq.heappush(self._lease_deadlines, (deadline, tid))
        session.usage.add(leases=1, reserved_bytes=nbytes)
        return tid

    def expire_leases(self, now: float) -> None:
        """End the leases whose deadline passed: a store is aborted (its slots quarantined), a retrieve unpinned."""
        for tid in self._due_leases(now):
            lease = self._pop_lease(tid)
            self._expiry_log.expired(lease.kind, tid, self.config.server.lease_seconds,
                                     "reservation aborted" if lease.kind == "store" else "pins released")
            self._end_lease(lease, ok=False, tid=tid)
            self._expired.append(tid)
            self.metrics.inc("kvtier_lease_expired_total", kind=lease.kind)

    def _due_leases(self, now: float) -> list[int]:
        """Tickets of live leases whose deadline has passed (their heap entries popped)."""
        heap, due = self._lease_deadlines, []
        while heap and heap[0][0] <= now:
            tid = heapq.heappop(heap)[1]
            if tid in self.leases:
                due.append(tid)
        if len(heap) > 2 * len(self.leases) + 1024:  # many ended early: keep the heap the size of the leases
            self._lease_deadlines = [(lease.deadline, t) for t, lease in self.leases.items()]
            heapq.heapify(self._lease_deadlines)
        return due

    def _pop_lease(self, tid: int) -> Lease:
        lease = self.leases.pop(tid)
        lease.usage.add(leases=-1, reserved_bytes=-lease.nbytes)
        return lease

    def store_begin(self, identity, session, msg, payload):
        started = time.monotonic()
        shm = msg.shm and session.shm
        refusal = self.limits.check_leases(session.usage)
        if refusal:
            return limited_reply(self.metrics, msg, *refusal), []
        hint = check_hint(msg.priority, msg.ttl_seconds, msg.session_id)
        if hint is not None:  # its protected bytes count against this client's principal
            hint = dataclasses.replace(hint, owner=session.principal)
        ticket = session.cache.begin_store(*session.prompt(msg), extra_keys=msg.extra_keys, start=msg.start,
                                           max_bytes=self.limits.reserve_budget(session.usage), hint=hint)
        ticket.on_lost = session.count_lost
        if ticket.limited and not ticket.slots:
            return limited_reply(self.metrics, msg, *self.limits.reserved_refusal(session.usage)), []
        if not shm:  # frames mode: keep what fits in one message; the rest is left for a later store
            keep = frame_budget(ticket.slots, self.config.server.max_message_bytes)
            for slot in ticket.slots[keep:]:
                self.tiers.l1.abort(slot.ref.key)
            del ticket.slots[keep:]
        if not ticket.slots:
            session.cache.commit_store(ticket)
            self.trace.store(identity, session, ticket, pending=False)
            self.metrics.observe("kvtier_store_seconds", time.monotonic() - started)
            return P.StoreSlots(id=msg.id, ticket=0, slots=[]), []
        slots = [P.Slot(s.ref.index, s.offset if shm else -1, s.nbytes) for s in ticket.slots]
        tid = self._new_lease("store", identity, session, ticket, shm, slots, started)
        self.trace.store(identity, session, ticket, pending=True)
        return P.StoreSlots(id=msg.id, ticket=tid, slots=slots), []

    def _take_lease(self, msg, kind: str, identity: bytes):
        lease = self.leases.get(msg.ticket)
        if lease is None or lease.kind != kind or lease.identity != identity:
            if kind == "store":  # the late commit of an expired store: the client's copy is over
                self.quarantine.release_ticket(identity, msg.ticket)
            if msg.ticket in self._expired:
                return None, error_reply(msg, "lease_expired", f"ticket {msg.ticket} expired after "
                                         f"{self.config.server.lease_seconds} s; its slots were released")
            return None, error_reply(msg, "unknown_ticket", f"no {kind} ticket {msg.ticket} for this client")
        return self._pop_lease(msg.ticket), None

    def store_commit(self, identity, session, msg, payload):
        lease, error = self._take_lease(msg, "store", identity)
        if error is not None:
            return error, []
        ok = msg.ok
        if ok and not lease.shm:
            problem = check_frames(payload, lease.slots)
            if problem:
                self._end_lease(lease, ok=False)
                return error_reply(msg, "bad_payload", problem), []
            try:
                for slot, frame in zip(lease.ticket.slots, payload):
                    slot.view[:] = frame.buffer
            except BaseException:
                self._end_lease(lease, ok=False)  # never leak the reservation
                raise
        elif payload:
            self._end_lease(lease, ok=False)
            return error_reply(msg, "bad_payload", "shared-memory store takes no payload frames"), []
        stored = self._end_lease(lease, ok=ok)
        if ok:
            self.metrics.observe("kvtier_store_seconds", time.monotonic() - lease.started)
        return P.StoreDone(id=msg.id, num_stored=stored), []

    def _promote_later(self, identity, session, msg, after: Job | None = None) -> bool:
        """Hand the promotion of the L2-only chunks of ``msg.tokens`` to the pool when the cache's promotion policy
        wants them (``Promotions.wanted``); it joins a promotion already reading that chunk (``JobPool.submit``). True: the
        reply is deferred (``answer_promotions``). ``after``: the job this request followed, now finished
        (its start and deadline are kept: what that promotion did not bring is read now)."""
        cache = session.cache
        tokens, namespace = session.prompt(msg)
        start = getattr(msg, "start", 0)  # RetrieveBegin's (a sliding-window part's chunks from there on)
        _, refs = cache.chunk_refs(tokens, namespace, extra_keys=msg.extra_keys)
        refs = refs[start // cache.chunk_size:] if start > 0 else refs
        n = cache.l1_prefix(refs)
        if not cache.promotions.wanted(refs, n):
            return False
        now = time.monotonic()
        started, deadline = (after.started, after.deadline) if after else \
            (now, now + self.config.server.promote_timeout_seconds)
        if deadline <= now:
            return False
        job = Job(identity, msg, session, started, deadline)
        if self.pool.submit(job, lambda: cache.prefetch(tokens, namespace, extra_keys=msg.extra_keys,
                                                            start=start), key=refs[n].key):
            if job.joined:
                self.metrics.inc("kvtier_l2_promotions_joined_total")
            return True
        self.metrics.inc("kvtier_l2_promotions_refused_total")
        return False

    def answer_promotions(self, jobs: list[Job], timed_out: bool = False) -> None:
        """Reply to finished (or timed-out) promotions; a client gone meanwhile gets nothing and pins nothing."""
        if not jobs:
            return
        with self.lock:
            replies = []
            for job in jobs:
                if timed_out and isinstance(job.msg, P.Lookup):
                    self.lookups.timed_out(job)
                elif timed_out:
                    self.metrics.inc("kvtier_l2_promote_timeouts_total")
                    log.warning("L2 promotion for %s not done after %.1f s: answered from L1",
                                type(job.msg).__name__, self.config.server.promote_timeout_seconds)
                if self.connections.get(job.identity) is not job.session:  # said Bye, went idle, or said Hello again
                    continue
                if job.joined and not timed_out and self._promote_later(job.identity, job.session, job.msg, job):
                    continue  # the promotion it waited for left part of its prompt in L2 only: read that now
                handler = {P.RetrieveBegin: self._retrieve_reply, P.Lookup: self.lookups.reply}.get(
                    type(job.msg), self._prefetch_reply)
                try:
                    replies.append((job.identity, *handler(job.identity, job.session, job.msg, job.started)))
                except KVTierError as exc:
                    replies.append((job.identity, error_reply(job.msg, "bad_request", str(exc)), []))
        for identity, reply, out in replies:
            self._send(identity, reply, out)

    def prefetch(self, identity, session, msg, payload):
        self.metrics.inc("kvtier_prefetch_requests_total")
        if self._promote_later(identity, session, msg):
            return None, []
        return self._prefetch_reply(identity, session, msg, time.monotonic())

    def _prefetch_reply(self, identity, session, msg, started):
        _, refs = session.chunk_refs(msg)
        n = session.cache.l1_prefix(refs)
        self.trace.prefetch(identity, session, msg, n)
        return P.PrefetchReply(id=msg.id, num_tokens=refs[n - 1].end if n else 0), []

    def retrieve_begin(self, identity, session, msg, payload):
        if self._promote_later(identity, session, msg):
            return None, []
        return self._retrieve_reply(identity, session, msg, time.monotonic())

    def _retrieve_reply(self, identity, session, msg, started):
        """Pin what L1 holds of the prompt (no L2 access) and answer ``RetrieveBegin``."""
        cache = session.cache
        refusal = self.limits.check_leases(session.usage)
        if refusal and msg.shm and session.shm:
            return limited_reply(self.metrics, msg, *refusal), []
        ticket = cache.begin_retrieve(*session.prompt(msg), extra_keys=msg.extra_keys, promote=False, start=msg.start)
        shm = msg.shm and session.shm
        self.trace.retrieve(identity, session, msg, ticket, pending=shm and bool(ticket.slots))
        if not shm:
            keep = frame_budget(ticket.slots, self.config.server.max_message_bytes)
            refusal = self.limits.check_unread(session.usage, sum(s.nbytes for s in ticket.slots[:keep]))
            if refusal:
                cache.end_retrieve(ticket)
                return limited_reply(self.metrics, msg, *refusal), []
            try:
                slots = [P.Slot(s.ref.index, -1, s.nbytes) for s in ticket.slots[:keep]]
                frames = [bytes(s.view) for s in ticket.slots[:keep]]  # copied before the pins go
                num_tokens = ticket.slots[keep - 1].ref.end if keep else 0
            finally:
                cache.end_retrieve(ticket)
            self.metrics.observe("kvtier_retrieve_seconds", time.monotonic() - started)
            return P.RetrieveData(id=msg.id, num_tokens=num_tokens, slots=slots), frames
        if not ticket.slots:
            self.metrics.observe("kvtier_retrieve_seconds", time.monotonic() - started)
            return P.RetrieveSlots(id=msg.id, ticket=0, num_tokens=0, slots=[]), []
        slots = [P.Slot(s.ref.index, s.offset, s.nbytes) for s in ticket.slots]
        tid = self._new_lease("retrieve", identity, session, ticket, True, slots, started)
        return P.RetrieveSlots(id=msg.id, ticket=tid, num_tokens=ticket.num_tokens, slots=slots), []

    def retrieve_end(self, identity, session, msg, payload):
        lease, error = self._take_lease(msg, "retrieve", identity)
        if error is not None:
            return error, []
        self._end_lease(lease, ok=True)
        self.metrics.observe("kvtier_retrieve_seconds", time.monotonic() - lease.started)
        return P.Ok(id=msg.id), []

    def _end_lease(self, lease: Lease, ok: bool, tid: int = 0) -> int:
        self.trace.end(lease.ticket, ok)
        if lease.kind == "store":
            if not ok and lease.shm and tid:  # expired: the client may still be writing into these slots
                session = self.connections.get(lease.identity)
                pid, start = (session.pid, session.pid_start) if session is not None else (0, None)
                self.quarantine.add(lease.identity, tid, pid, start, lease.cache.quarantine_store(lease.ticket),
                                    lease.usage)
                return 0
            return lease.cache.commit_store(lease.ticket, ok=ok)
        lease.cache.end_retrieve(lease.ticket)
        return 0
