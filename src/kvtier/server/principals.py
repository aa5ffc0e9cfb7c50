"""Principals: who stands behind a connection, so that opening more connections does not buy more of the server.

A principal is what authenticates a connection: with ``server.auth`` on, its CurveZMQ key (a tenant's, or the
server's own secret, which every same-user engine holds); with authentication off, the peer itself as the
transport tells it: the OS user (uid) owning a loopback TCP peer's socket (from ``/proc/net/tcp``, the socket
found by the ports of the connection libzmq read the ``Hello`` from, ``ZMQ_SRCFD``), else the peer's IP address.
The server listens on TCP only, where the peer's process is not told (no ``SO_PEERCRED``): a principal is
never narrower than its key or user.

Each principal has a ``ClientUsage`` that is the parent of its sessions' (``server/limits.py``), and at most
``server.max_connections_per_principal`` sessions. A principal with no session left is forgotten once it holds
nothing (its leases ended, its quarantined slots freed).
"""

from __future__ import annotations

import ipaddress
import socket

import zmq

from kvtier.auth.zap import tenant_of
from kvtier.server.limits import ClientLimits, ClientUsage

OWN_KEY = "key:server"  # the principal of clients holding the server's own secret


def principal_of(frame, auth: bool) -> tuple[bool, str | None, str]:
    """(authenticated, tenant, principal) of a received frame: the tenant as ``auth.tenant_of`` says (None:
    full access) and the principal the connection's usage is counted under (module docstring)."""
    authenticated, tenant = tenant_of(frame)
    if auth:
        return authenticated, tenant, OWN_KEY if tenant is None else f"key:tenant:{tenant}"
    return authenticated, tenant, peer_of(frame)


def peer_of(frame) -> str:
    """``uid:<n>`` for a loopback TCP peer whose socket owner is visible here, ``ip:<address>`` for another
    peer, ``peer:unknown`` when libzmq tells nothing (then all such peers share one principal)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return "peer:unknown"
    sock = None
    try:
        sock = socket.socket(fileno=fd)  # borrowed from libzmq: detached below, never closed here
        peer, mine, family = sock.getpeername(), sock.getsockname(), sock.family
    except OSError:
        return "peer:unknown"
    finally:
        if sock is not None:
            sock.detach()
    try:
        loopback = ipaddress.ip_address(peer[0].split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    uid = _socket_owner(peer[1], mine[1], family) if loopback else None
    return f"uid:{uid}" if uid is not None else f"ip:{peer[0]}"


def _socket_owner(peer_port: int, my_port: int, family: int) -> int | None:
    """The uid owning the local TCP socket from ``peer_port`` to ``my_port`` (None: not found)."""
    want = (f"{peer_port:04X}", f"{my_port:04X}")
    for table in ("/proc/net/tcp6", "/proc/net/tcp") if family == socket.AF_INET6 else ("/proc/net/tcp",):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 7 and (fields[1].rpartition(":")[2], fields[2].rpartition(":")[2]) == want:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


class Principals:
    """Sessions per principal and each principal's ``ClientUsage``; ``all`` is the usage of all clients.

    Args:
        limits: the bounds (``max_connections_per_principal``; off with ``client_limits: false``).
    """

    def __init__(self, limits: ClientLimits):
        self.limits = limits
        self.all = ClientUsage(track_unread=False, name="all clients together")
        self._usage: dict[str, ClientUsage] = {}
        self._members: dict[str, set[bytes]] = {}
        self._of: dict[bytes, str] = {}

    def refusal(self, identity: bytes, principal: str) -> tuple[str, str] | None:
        """(limit label, refusal message) when a new session of ``principal`` on connection ``identity`` would
        pass ``max_connections_per_principal``; None when ``admit`` may be called."""
        members = self._members.get(principal, ())
        if identity in members or not self.limits.enabled or len(members) < self.limits.max_connections_per_principal:
            return None
        return ("principal_connections",
                f"this principal ({principal}) already has {len(members)} sessions open, the bound "
                "(server.max_connections_per_principal); close idle clients (they say Bye on close) or raise that key")

    def admit(self, identity: bytes, principal: str) -> ClientUsage:
        """A new session's usage for connection ``identity`` (check ``refusal`` first). A second Hello on one
        connection keeps its session's usage instead."""
        self._members.setdefault(principal, set()).add(identity)
        self._of[identity] = principal
        usage = self._usage.get(principal)
        if usage is None:
            usage = self._usage[principal] = ClientUsage(parent=self.all, name=f"principal {principal} (all its "
                                                         "connections together)")
        return ClientUsage(parent=usage)

    def leave(self, identity: bytes) -> None:
        """Session ``identity`` ended (Bye, idle): it no longer counts against its principal's connections."""
        principal = self._of.pop(identity, None)
        if principal is None:
            return
        members = self._members.get(principal)
        if members is not None:
            members.discard(identity)
            if not members:
                del self._members[principal]
        for name in [p for p, u in self._usage.items() if p not in self._members and u.idle]:
            del self._usage[name]

    def usage_of(self, principal: str) -> ClientUsage | None:
        """What ``principal``'s sessions hold together (None: not known now)."""
        return self._usage.get(principal)

    def __len__(self) -> int:
        return len(self._members)
