"""What one client may hold in the server, and the quarantine of slots a late writer may still touch.

Per-client bounds (``server.*_per_client``, ``server.max_prompt_tokens``; all off with ``server.client_limits:
false``): a request past one is answered ``Error(code="limit_exceeded")`` (``too_large`` for a prompt) with a
message naming the bound and the key that sets it, and counted in
``kvtier_client_limit_exceeded_total{limit=...}``. Reserved bytes count the client's open store reservations
plus its quarantined slots, so a client that keeps stalling past its leases only uses up its own share of L1.

Quarantine (``Quarantine``): when a store lease expires the client may still be inside its copy (SIGSTOP, swap,
a debugger), writing through its shared-memory mapping. Its slots leave the key space at once (the chunk never
becomes visible; another client may store the same key elsewhere) but are not reused until the writer is
known to be done: it sends the late ``StoreCommit`` for that ticket (a client commits only after its copy),
it says ``Bye``, or its process is gone (the pid from its ``Hello`` no longer runs with the start time it had
then; checked every ``SWEEP_SECONDS``). A client whose pid the server cannot see (another pid namespace, pid 0)
frees its quarantine only by the first two.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvtier.config import ServerConfig

log = logging.getLogger(__name__)
SWEEP_SECONDS = 1.0  # how often quarantined slots of dead processes are looked for
LOG_EVERY_SECONDS = 10.0  # lease-expiry warnings: at most one line per this interval


def pid_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None when there
    is no such process visible here. With the pid it names one process, even after the pid is reused."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after the last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(slots=True)
class ClientUsage:
    """What one session holds now (kept on ``Session``)."""

    reserved_bytes: int = 0  # bytes of its open store reservations
    leases: int = 0  # its open store and retrieve leases
    inflight: int = 0  # its requests accepted and not yet answered (deferred replies)
    unread: deque = field(default_factory=deque)  # (zmq.MessageTracker, nbytes) of KV frames sent, maybe unread

    def unread_bytes(self) -> int:
        """Bytes of sent KV frames libzmq still holds (the client has not read them yet)."""
        while self.unread and self.unread[0][0].done:
            self.unread.popleft()
        return sum(nbytes for tracker, nbytes in self.unread if not tracker.done)


class ClientLimits:
    """The per-client bounds of ``server`` config; each ``check_*`` returns None or the refusal message."""

    def __init__(self, srv: ServerConfig, l1_capacity_bytes: int):
        self.enabled = srv.client_limits
        self.max_prompt_tokens = srv.max_prompt_tokens
        self.max_reserved_bytes = int(srv.max_reserved_fraction_per_client * l1_capacity_bytes)
        self.max_leases = srv.max_leases_per_client
        self.max_inflight = srv.max_inflight_requests_per_client
        self.max_unread_bytes = srv.max_unread_reply_bytes_per_client

    def check_prompt(self, tokens_field: bytes) -> str | None:
        num_tokens = len(tokens_field) // 8
        if self.enabled and num_tokens > self.max_prompt_tokens:
            return (f"prompt of {num_tokens} tokens exceeds server.max_prompt_tokens ({self.max_prompt_tokens}); "
                    "send a shorter prompt or raise the server's max_prompt_tokens")
        return None

    def reserve_budget(self, usage: ClientUsage, quarantined_bytes: int) -> int | None:
        """Bytes this client may still reserve (None: unbounded)."""
        if not self.enabled:
            return None
        return max(0, self.max_reserved_bytes - usage.reserved_bytes - quarantined_bytes)

    def reserved_refusal(self, usage: ClientUsage, quarantined_bytes: int) -> str:
        return (f"this client holds {usage.reserved_bytes} reserved and {quarantined_bytes} quarantined bytes of "
                f"L1, its bound is {self.max_reserved_bytes} (server.max_reserved_fraction_per_client of L1): "
                "commit or abort open stores first")

    def check_leases(self, usage: ClientUsage) -> str | None:
        if self.enabled and usage.leases >= self.max_leases:
            return (f"this client holds {usage.leases} open leases, the bound (server.max_leases_per_client); "
                    "end its stores (StoreCommit) and retrieves (RetrieveEnd) first")
        return None

    def check_inflight(self, usage: ClientUsage) -> str | None:
        if self.enabled and usage.inflight >= self.max_inflight:
            return (f"this client has {usage.inflight} requests waiting for an answer, the bound "
                    "(server.max_inflight_requests_per_client); wait for their replies")
        return None

    def check_unread(self, usage: ClientUsage, nbytes: int) -> str | None:
        if not self.enabled or not usage.unread:
            return None  # one reply always goes when nothing is queued
        queued = usage.unread_bytes()
        if queued and queued + nbytes > self.max_unread_bytes:
            return (f"{queued} bytes of earlier replies to this client are still unread; with {nbytes} more it "
                    f"would pass server.max_unread_reply_bytes_per_client ({self.max_unread_bytes}): read replies")
        return None


@dataclass(slots=True)
class _Held:
    identity: bytes
    ticket: int
    pid: int
    pid_start: int | None
    slots: list  # (L1 quarantine token, nbytes)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.slots)


class Quarantine:
    """Slots of expired store leases, kept out of use until their writer is done or gone (module docstring).

    Args:
        l1: the ``L1Store`` whose ``free_quarantined`` frees the slots.
        metrics: ``kvtier_l1_quarantined_bytes`` (gauge) and ``kvtier_quarantine_released_total{reason}``.
    """

    def __init__(self, l1, metrics):
        self.l1 = l1
        self.metrics = metrics
        self._held: dict[tuple[bytes, int], _Held] = {}
        self._bytes_of: dict[bytes, int] = {}
        self._next_sweep = 0.0

    def add(self, identity: bytes, ticket: int, pid: int, pid_start: int | None, slots: list) -> None:
        if not slots:
            return
        held = _Held(identity, ticket, pid, pid_start, slots)
        self._held[(identity, ticket)] = held
        self._bytes_of[identity] = self._bytes_of.get(identity, 0) + held.nbytes
        self._gauge()

    def bytes_of(self, identity: bytes) -> int:
        """Quarantined bytes of slots this connection was writing."""
        return self._bytes_of.get(identity, 0)

    def release_ticket(self, identity: bytes, ticket: int) -> bool:
        """The client sent the late commit of ``ticket``: its copy is over. True when something was freed."""
        held = self._held.pop((identity, ticket), None)
        if held is not None:
            self._free(held, "late_commit")
        return held is not None

    def release_client(self, identity: bytes) -> None:
        """The client said Bye (never in the middle of a copy): free all it held."""
        for key in [k for k in self._held if k[0] == identity]:
            self._free(self._held.pop(key), "bye")

    def sweep(self, now: float) -> None:
        """Free the slots of writers whose process is gone (at most every ``SWEEP_SECONDS``)."""
        if not self._held or now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_SECONDS
        alive: dict[tuple[int, int | None], bool] = {}
        for key, held in list(self._held.items()):
            if held.pid_start is None:
                continue  # not visible here: only a late commit or Bye frees it
            proc = (held.pid, held.pid_start)
            if proc not in alive:
                alive[proc] = pid_start_time(held.pid) == held.pid_start
            if not alive[proc]:
                self._free(self._held.pop(key), "process_gone")

    def _free(self, held: _Held, reason: str) -> None:
        for token, _ in held.slots:
            self.l1.free_quarantined(token)
        left = self._bytes_of.get(held.identity, 0) - held.nbytes
        if left > 0:
            self._bytes_of[held.identity] = left
        else:
            self._bytes_of.pop(held.identity, None)
        self.metrics.inc("kvtier_quarantine_released_total", len(held.slots), reason=reason)
        self._gauge()

    def _gauge(self) -> None:
        self.metrics.set("kvtier_l1_quarantined_bytes", self.l1.quarantined_bytes)

    @property
    def num_slots(self) -> int:
        return sum(len(h.slots) for h in self._held.values())


class ExpiryLog:
    """Lease-expiry warnings, at most one line per ``LOG_EVERY_SECONDS`` (the counter metric counts every one)."""

    def __init__(self):
        self._next = 0.0
        self._suppressed = 0

    def expired(self, kind: str, ticket: int, lease_seconds: float, what: str) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more expired since the last line)" if self._suppressed else ""
        log.warning("%s lease %d expired after %.1f s: %s%s; further expiries are logged at most every %.0f s "
                    "(kvtier_lease_expired_total counts each)", kind, ticket, lease_seconds, what, more,
                    LOG_EVERY_SECONDS)
        self._suppressed = 0
        self._next = now + LOG_EVERY_SECONDS
