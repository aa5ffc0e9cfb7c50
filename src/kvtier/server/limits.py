"""What one client may hold in the server, and the quarantine of slots a late writer may still touch.

Bounds hold at three levels (all off with ``server.client_limits: false``): per client (one connection,
``server.*_per_client``), per principal (every connection of one authenticated key: a tenant, or the server's
own secret; ``server.*_per_principal``, ``server.max_connections_per_principal``; ``server/principals.py``), and
for all clients together (``server.max_reserved_fraction_all_clients``), so a process that opens more connections
does not get more of the server. Each session's ``ClientUsage`` has its principal's as ``parent``, whose parent
is the server-wide one; every change is added along the chain. A request past a bound is answered
``Error(code="limit_exceeded")`` (``too_large`` for a prompt over ``server.max_prompt_tokens``) with a message
naming the bound and the key that raises it, and counted in ``kvtier_client_limit_exceeded_total{limit=...}``
(``principal_`` / ``all_`` prefixes for the upper levels). Reserved bytes count open store reservations plus
quarantined slots, so a client that keeps stalling past its leases only uses up its own share of L1.

Quarantine (``LeaseQuarantine``): when a store lease expires the client may still be inside its copy (SIGSTOP, swap,
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
from kvtier.proc import pid_start_time

log = logging.getLogger(__name__)
SWEEP_SECONDS = 1.0  # how often quarantined slots of dead processes are looked for
LOG_EVERY_SECONDS = 10.0  # lease-expiry warnings: at most one line per this interval


@dataclass(slots=True)
class ClientUsage:
    """What one session (or, as its ``parent``, one principal, and above that all clients) holds now. Change it
    only through ``add`` / ``add_unread``, which keep every level of the chain in step."""

    reserved_bytes: int = 0  # bytes of open store reservations
    quarantined_bytes: int = 0  # bytes of quarantined slots (expired stores the writer may still touch)
    leases: int = 0  # open store and retrieve leases
    inflight: int = 0  # requests accepted and not yet answered (deferred replies)
    unread: deque = field(default_factory=deque)  # (zmq.MessageTracker, nbytes) of KV frames sent, maybe unread
    parent: ClientUsage | None = None  # the level above: the principal's usage, then all clients'
    track_unread: bool = True  # False where no bound reads ``unread`` (all clients': it would only grow)
    name: str = ""  # how refusals name this level ("" : the level's generic name, e.g. "this client")

    def chain(self):
        """This usage and every level above it, innermost first."""
        usage = self
        while usage is not None:
            yield usage
            usage = usage.parent

    def add(self, *, reserved_bytes: int = 0, quarantined_bytes: int = 0, leases: int = 0, inflight: int = 0) -> None:
        """Add (or, negative, remove) holdings at this level and every level above."""
        for usage in self.chain():
            usage.reserved_bytes += reserved_bytes
            usage.quarantined_bytes += quarantined_bytes
            usage.leases += leases
            usage.inflight += inflight

    def add_unread(self, tracker, nbytes: int) -> None:
        """KV frames of ``nbytes`` were queued for this client; ``tracker.done`` once libzmq let go of them."""
        for usage in self.chain():
            if usage.track_unread:
                usage.unread.append((tracker, nbytes))

    def unread_bytes(self) -> int:
        """Bytes of sent KV frames libzmq still holds (the client has not read them yet)."""
        while self.unread and self.unread[0][0].done:
            self.unread.popleft()
        return sum(nbytes for tracker, nbytes in self.unread if not tracker.done)

    @property
    def held_bytes(self) -> int:
        """L1 bytes held: open reservations plus quarantined slots."""
        return self.reserved_bytes + self.quarantined_bytes

    @property
    def idle(self) -> bool:
        """Holds nothing (so its record may be forgotten)."""
        return not (self.reserved_bytes or self.quarantined_bytes or self.leases or self.inflight
                    or self.unread_bytes())


@dataclass(frozen=True, slots=True)
class Bounds:
    """The bounds of one level of the chain (None: unbounded) and the config keys that set them."""

    who: str  # how refusals name the level when its usage has no name
    label: str  # prefix of the kvtier_client_limit_exceeded_total{limit=...} label ("" for the client level)
    suffix: str  # config key suffix: "_per_client", "_per_principal", "_all_clients"
    reserved_bytes: int | None
    leases: int | None = None
    inflight: int | None = None
    unread_bytes: int | None = None


def identity_refusal(srv, *, model: str | None = None, namespace: str | None = None) -> str | None:
    """Why a model id or namespace (a Hello's, or a request's namespace) is refused: longer in UTF-8 than
    ``server.max_model_id_bytes`` / ``max_namespace_bytes`` (``srv``: the ``server`` config), which bound what the
    server keeps of every identity it was ever told; None when both fit."""
    for what, value, key in (("model id", model, "max_model_id_bytes"), ("namespace", namespace, "max_namespace_bytes")):
        bound = getattr(srv, key)
        if value is not None and len(value.encode()) > bound:
            return (f"{what} of {len(value.encode())} bytes exceeds server.{key} ({bound}): name the model by its "
                    "weights' identity (kvtier.identity.model_identity) and the namespace by keys.namespace_of")
    return None


class ClientLimits:
    """The per-client, per-principal and server-wide bounds of ``server`` config. Each ``check_*`` returns
    None or (limit label, refusal message naming the bound and its config key)."""

    def __init__(self, srv: ServerConfig, l1_capacity_bytes: int):
        self.srv = srv
        self.enabled = srv.client_limits
        self.max_prompt_tokens = srv.max_prompt_tokens
        self.max_connections_per_principal = srv.max_connections_per_principal
        self.levels = (
            Bounds("this client", "", "_per_client", int(srv.max_reserved_fraction_per_client * l1_capacity_bytes),
                   srv.max_leases_per_client, srv.max_inflight_requests_per_client,
                   srv.max_unread_reply_bytes_per_client),
            Bounds("this principal", "principal_", "_per_principal",
                   int(srv.max_reserved_fraction_per_principal * l1_capacity_bytes), srv.max_leases_per_principal,
                   srv.max_inflight_requests_per_principal, srv.max_unread_reply_bytes_per_principal),
            Bounds("all clients together", "all_", "_all_clients",
                   int(srv.max_reserved_fraction_all_clients * l1_capacity_bytes)),
        )
        self.max_reserved_bytes = self.levels[0].reserved_bytes

    def check_request(self, msg, usage: ClientUsage) -> tuple[str, str, str] | None:
        """``(error code, limit label, message naming the bound)`` when a request of a client with ``usage`` is
        refused before it is handled: past its in-flight bounds (``limit_exceeded``), a prompt over
        ``server.max_prompt_tokens`` or a namespace over ``server.max_namespace_bytes`` (``too_large``, the latter
        also with ``client_limits`` off: identities are kept); None when it may be handled."""
        refusal = self.check_inflight(usage)
        if refusal:
            return ("limit_exceeded", *refusal)
        tokens = getattr(msg, "tokens", None)
        if tokens is not None and (message := self.check_prompt(tokens, getattr(msg, "pages", None))):
            return "too_large", "prompt_tokens", message
        namespace = getattr(msg, "namespace", None)
        if namespace is not None and (message := identity_refusal(self.srv, namespace=namespace)):
            return "too_large", "namespace_bytes", message
        return None

    def check_prompt(self, tokens_field: bytes, pages=None) -> str | None:
        """A refusal for a prompt over ``max_prompt_tokens``: its ``tokens`` field, or its ``pages`` (pages times
        the page size), else None."""
        num_tokens = len(tokens_field) // 8 + (len(pages.hashes) * pages.page_size if pages is not None else 0)
        if self.enabled and num_tokens > self.max_prompt_tokens:
            return (f"prompt of {num_tokens} tokens exceeds server.max_prompt_tokens ({self.max_prompt_tokens}); "
                    "send a shorter prompt or raise the server's max_prompt_tokens")
        return None

    def reserve_budget(self, usage: ClientUsage) -> int | None:
        """Bytes this client may still reserve: the least room left at any level (None: unbounded)."""
        if not self.enabled:
            return None
        return max(0, min(b.reserved_bytes - u.held_bytes for u, b in zip(usage.chain(), self.levels)))

    def reserved_refusal(self, usage: ClientUsage) -> tuple[str, str]:
        # the level with the least room (none may be quite full: the room left was less than one chunk)
        u, b = min(zip(usage.chain(), self.levels), key=lambda ub: ub[1].reserved_bytes - ub[0].held_bytes)
        return (b.label + "reserved_bytes",
                f"{u.name or b.who} holds {u.reserved_bytes} reserved and {u.quarantined_bytes} quarantined bytes of L1, the "
                f"bound is {b.reserved_bytes} (server.max_reserved_fraction{b.suffix} of L1): commit or abort open "
                "stores first, or raise that key")

    def check_leases(self, usage: ClientUsage) -> tuple[str, str] | None:
        return self._check(usage, "leases", "leases", "max_leases", "open leases",
                           "end its stores (StoreCommit) and retrieves (RetrieveEnd) first")

    def check_inflight(self, usage: ClientUsage) -> tuple[str, str] | None:
        return self._check(usage, "inflight", "inflight_requests", "max_inflight_requests",
                           "requests waiting for an answer", "wait for their replies")

    def _check(self, usage, attr, label, key, what, fix) -> tuple[str, str] | None:
        if not self.enabled:
            return None
        for u, b in zip(usage.chain(), self.levels):
            bound = getattr(b, attr)
            if bound is not None and getattr(u, attr) >= bound:
                return (b.label + label, f"{u.name or b.who} has {getattr(u, attr)} {what}, the bound (server.{key}{b.suffix}); "
                        f"{fix}, or raise that key")
        return None

    def check_unread(self, usage: ClientUsage, nbytes: int) -> tuple[str, str] | None:
        """One reply always goes to a client (and a principal) with nothing queued."""
        if not self.enabled:
            return None
        for u, b in zip(usage.chain(), self.levels):
            if b.unread_bytes is None or not u.unread:
                continue
            queued = u.unread_bytes()
            if queued and queued + nbytes > b.unread_bytes:
                return (b.label + "unread_reply_bytes",
                        f"{queued} bytes of earlier replies to {u.name or b.who} are still unread; with {nbytes} more it would "
                        f"pass server.max_unread_reply_bytes{b.suffix} ({b.unread_bytes}): read replies, or raise "
                        "that key")
        return None


@dataclass(slots=True)
class _Held:
    identity: bytes
    ticket: int
    pid: int
    pid_start: int | None
    slots: list  # (L1 quarantine token, nbytes)
    usage: ClientUsage  # the writer's: these bytes count against its bounds until freed

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.slots)


class LeaseQuarantine:
    """Slots of expired store leases, kept out of use until their writer is done or gone (module docstring).

    Args:
        l1: the ``L1Store`` whose ``free_quarantined`` frees the slots.
        metrics: ``kvtier_l1_quarantined_bytes`` (gauge) and ``kvtier_quarantine_released_total{reason}``.
    """

    def __init__(self, l1, metrics):
        self.l1 = l1
        self.metrics = metrics
        self._held: dict[tuple[bytes, int], _Held] = {}
        self._next_sweep = 0.0

    def add(self, identity: bytes, ticket: int, pid: int, pid_start: int | None, slots: list,
            usage: ClientUsage) -> None:
        if not slots:
            return
        held = _Held(identity, ticket, pid, pid_start, slots, usage)
        self._held[(identity, ticket)] = held
        usage.add(quarantined_bytes=held.nbytes)
        self._gauge()

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
        held.usage.add(quarantined_bytes=-held.nbytes)
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
