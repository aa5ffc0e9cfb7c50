"""The chain of bounds (client -> principal -> all clients) and the principal registry, without a server."""

from __future__ import annotations

from kvtier.config import ServerConfig
from kvtier.server.limits import ClientLimits
from kvtier.server.principals import Principals

L1 = 1000


def setup(**keys):
    limits = ClientLimits(ServerConfig(**keys), L1)
    return limits, Principals(limits)


def test_reserve_budget_is_the_least_room_left_at_any_level():
    limits, principals = setup(max_reserved_fraction_per_client=0.4, max_reserved_fraction_per_principal=0.5,
                               max_reserved_fraction_all_clients=0.7)
    a1, a2 = principals.admit(b"a1", "key:tenant:a"), principals.admit(b"a2", "key:tenant:a")
    b1 = principals.admit(b"b1", "key:tenant:b")
    assert limits.reserve_budget(a1) == 400  # its own share first
    a1.add(reserved_bytes=300)
    assert limits.reserve_budget(a2) == 200  # the principal's half, less what a1 holds
    a2.add(quarantined_bytes=200)  # quarantined slots count as held
    assert limits.reserve_budget(a2) == 0
    label, message = limits.reserved_refusal(a2)
    assert label == "principal_reserved_bytes" and "key:tenant:a" in message
    assert "max_reserved_fraction_per_principal" in message
    assert limits.reserve_budget(b1) == 200  # all clients: 700 of 1000, 500 held by a
    b1.add(reserved_bytes=200)
    assert limits.reserved_refusal(b1)[0] == "all_reserved_bytes"
    a1.add(reserved_bytes=-300)
    a2.add(quarantined_bytes=-200)
    assert principals.all.held_bytes == 200 and limits.reserve_budget(a1) == 400


def test_leases_and_inflight_are_checked_at_each_level():
    limits, principals = setup(max_leases_per_client=3, max_leases_per_principal=4,
                               max_inflight_requests_per_client=2, max_inflight_requests_per_principal=2)
    a1, a2 = principals.admit(b"a1", "p"), principals.admit(b"a2", "p")
    a1.add(leases=3)
    assert limits.check_leases(a1)[0] == "leases" and "max_leases_per_client" in limits.check_leases(a1)[1]
    assert limits.check_leases(a2) is None
    a2.add(leases=1)
    assert limits.check_leases(a2)[0] == "principal_leases"
    a1.add(inflight=1)
    a2.add(inflight=1)
    assert "max_inflight_requests_per_principal" in limits.check_inflight(a2)[1]
    assert ClientLimits(ServerConfig(client_limits=False, max_leases_per_client=1), L1).check_leases(a1) is None


def test_connections_per_principal_and_forgetting_idle_principals():
    limits, principals = setup(max_connections_per_principal=2)
    first = principals.admit(b"1", "p")
    principals.admit(b"2", "p")
    assert principals.refusal(b"2", "p") is None  # a second Hello on a connection it has
    refused = principals.refusal(b"3", "p")
    assert refused[0] == "principal_connections" and "max_connections_per_principal" in refused[1]
    assert principals.refusal(b"x", "q") is None  # another principal
    first.add(leases=1)
    principals.leave(b"1")
    principals.leave(b"2")
    assert principals.usage_of("p") is first.parent  # still holds a lease: kept, so the count stays right
    again = principals.admit(b"4", "p")
    assert again.parent is first.parent
    first.add(leases=-1)
    principals.leave(b"4")
    assert principals.usage_of("p") is None
