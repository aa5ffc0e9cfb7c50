"""Retention hints in L1 (issue 19 §1): every policy evicts unprotected chunks first, then hinted ones by priority;
an expired TTL is an ordinary candidate; hinted bytes are bounded by the share; bad hints name their field."""

from __future__ import annotations

import pytest

from kvtier.errors import InputError
from kvtier.hints import RetentionHint, check_hint, hint_from_params
from kvtier.l1.retention import Retention
from kvtier.l1.store import L1Store

SLOT = 4096
POLICIES = ["LRU", "ARC", "S3FIFO"]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def put(store, key):
    view = store.reserve(key, SLOT)
    assert view is not None, key
    store.commit(key)


def make(policy, slots=8, share=0.5, clock=None):
    return L1Store(slots * SLOT, policy, retention=Retention(slots * SLOT, share, 60.0, clock or Clock()))


@pytest.mark.parametrize("policy", POLICIES)
def test_session_chunks_outlive_unhinted_ones(policy):
    store = make(policy)
    for i in range(4):
        put(store, ("s", i))
    assert store.hint([("s", i) for i in range(4)], RetentionHint(session_id="agent-1")) == (4, 0)
    for i in range(40):  # a stream of other prompts, far more than L1 holds
        put(store, ("x", i))
        store.acquire(("x", i)) and store.release(("x", i), store.offset(("x", i)))
    assert all(store.contains(("s", i)) for i in range(4))
    assert sorted(store.session_keys("agent-1")) == [("s", i) for i in range(4)]
    assert store.sessions() == {"agent-1": (4, 4 * SLOT)}


@pytest.mark.parametrize("policy", POLICIES)
def test_without_hints_the_same_chunks_are_evicted(policy):
    store = make(policy)
    for i in range(4):
        put(store, ("s", i))
    for i in range(40):
        put(store, ("x", i))
    assert not any(store.contains(("s", i)) for i in range(4))


@pytest.mark.parametrize("policy", POLICIES)
def test_lower_priority_goes_first_when_only_hinted_chunks_are_left(policy):
    store = make(policy, slots=4, share=1.0)
    for i, prio in enumerate([3, 1, 2, 1]):
        put(store, i)
        store.hint([i], RetentionHint(priority=prio))
    put(store, "new")  # every resident chunk is hinted: the budget still holds, priority 1 goes
    assert store.num_chunks == 4 and store.contains("new")
    assert store.contains(0) and store.contains(2)
    assert [store.contains(1), store.contains(3)].count(False) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_a_session_chunk_is_not_evicted_while_ordinary_chunks_are_only_pinned(policy):
    store = make(policy, slots=4)
    put(store, "s")
    store.hint(["s"], RetentionHint(session_id="agent"))
    held = []
    for i in range(3):  # the rest of L1: ordinary chunks an L2 write (or a reader) holds for a moment
        put(store, i)
        held.append((i, store.acquire(i)[2]))
    assert store.reserve("new", SLOT) is None  # not stored, rather than the session's chunk evicted
    assert store.contains("s")
    for key, offset in held:
        store.release(key, offset)
    put(store, "new")  # once the pins are gone an ordinary chunk goes
    assert store.contains("s") and store.contains("new") and store.num_chunks == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_expired_ttl_makes_a_chunk_an_ordinary_candidate(policy):
    clock = Clock()
    store = make(policy, slots=4, clock=clock)
    put(store, "old")
    store.hint(["old"], RetentionHint(ttl_seconds=10.0))
    for i in range(3):
        put(store, i)
    put(store, "a")  # TTL live: an unhinted chunk goes
    assert store.contains("old")
    clock.now += 11.0
    for i in range(8):
        put(store, ("b", i))
    assert not store.contains("old")
    assert store.retention.held_bytes == 0


def test_session_hint_without_ttl_gets_the_session_ttl():
    clock = Clock()
    store = make("LRU", clock=clock)
    put(store, "k")
    store.hint(["k"], RetentionHint(session_id="s"))
    assert store.retention_of("k")["expires_in_seconds"] == pytest.approx(60.0)
    store.hint(["k"], RetentionHint(priority=2), pinned=True)
    assert store.retention_of("k") == {"priority": 2, "expires_in_seconds": None, "session_id": "s", "pinned": True}


def test_hints_past_the_share_are_refused_and_pins_never_evicted():
    store = make("LRU", slots=8, share=0.25)  # 2 of 8 slots may be protected
    for i in range(4):
        put(store, i)
    assert store.hint(range(4), RetentionHint(priority=1), pinned=True) == (2, 2)
    assert store.retention.num_refused == 2
    for i in range(30):
        put(store, ("x", i))
    assert store.contains(0) and store.contains(1)
    assert not store.contains(2) and not store.contains(3)
    assert store.unhint([0, 1]) == 2
    for i in range(30, 60):
        put(store, ("x", i))
    assert not store.contains(0) and not store.contains(1)


def test_remove_and_clear_drop_the_hints():
    store = make("LRU")
    put(store, "a")
    put(store, "b")
    store.hint(["a", "b"], RetentionHint(session_id="s"))
    store.remove("a")
    assert store.sessions() == {"s": (1, SLOT)}
    store.clear()
    assert store.sessions() == {} and store.retention.held_bytes == 0


@pytest.mark.parametrize("args, field", [
    ({"priority": 4}, "priority"), ({"priority": -1}, "priority"), ({"priority": "high"}, "priority"),
    ({"priority": True}, "priority"), ({"ttl_seconds": 0}, "ttl_seconds"), ({"ttl_seconds": -5}, "ttl_seconds"),
    ({"ttl_seconds": float("nan")}, "ttl_seconds"), ({"ttl_seconds": "10"}, "ttl_seconds"),
    ({"session_id": ""}, "session_id"), ({"session_id": 7}, "session_id"), ({"session_id": "x" * 300}, "session_id"),
])
def test_bad_hints_name_their_field(args, field):
    with pytest.raises(InputError, match=f"'{field}'"):
        check_hint(**args)


def test_hints_from_engine_params():
    assert hint_from_params(None) is None
    assert hint_from_params({"do_remote_prefill": True}) is None
    assert hint_from_params({"kvtier.session_id": "a", "kvtier.ttl_seconds": 30}) == RetentionHint(0, 30.0, "a")
    assert hint_from_params({"kvtier.priority": 2}) == RetentionHint(2, None, None)
    with pytest.raises(InputError, match="ttl_seconds"):
        hint_from_params({"kvtier.ttl_seconds": 0})


def test_a_later_ttl_hint_does_not_shorten_a_hint_without_expiry():
    """A shared system prompt hinted with a priority and no TTL, then stored again inside a session's prompt (a
    TTL hint): it keeps no expiry and the higher priority; an expired hint takes the new one as it is."""
    clock = Clock()
    store = make("LRU", clock=clock)
    put(store, "system")
    store.hint(["system"], RetentionHint(priority=3))
    store.hint(["system"], RetentionHint(priority=1, ttl_seconds=30.0, session_id="agent-1"))
    assert store.retention_of("system") == {"priority": 3, "expires_in_seconds": None, "session_id": "agent-1",
                                            "pinned": False}
    put(store, "turn")
    store.hint(["turn"], RetentionHint(priority=2, ttl_seconds=10.0))
    clock.now += 11.0  # expired: the next hint replaces it
    store.hint(["turn"], RetentionHint(priority=1, ttl_seconds=30.0))
    assert store.retention_of("turn") == {"priority": 1, "expires_in_seconds": 30.0, "session_id": None,
                                          "pinned": False}


def test_one_owner_holds_at_most_its_share_and_a_hint_without_ttl_expires_at_the_default():
    """Issue 38 finding 3: per-owner share (the server's principals) inside the global one; a priority hint with no
    TTL lapses after ``default_ttl_seconds`` (``retention_max_ttl_seconds``); a management pin never does."""
    clock = Clock()
    store = L1Store(8 * SLOT, "LRU", retention=Retention(8 * SLOT, 0.75, 300.0, clock, max_owner_share=0.25,
                                                          default_ttl_seconds=100.0))
    for i in range(6):
        put(store, i)
    assert store.hint([0, 1, 2], RetentionHint(priority=3, owner="key:tenant:a")) == (2, 1)  # 2 of 8 slots
    assert store.hint([3, 4], RetentionHint(priority=1, owner="key:tenant:b")) == (2, 0)
    assert store.hint([2], RetentionHint(priority=1)) == (1, 0)  # no owner: only the global share counts
    assert store.retention.owner_bytes("key:tenant:a") == 2 * SLOT
    assert store.hint([5], RetentionHint(priority=1, owner="key:tenant:b")) == (0, 1)  # b holds its 2 slots already
    assert store.retention_of(0)["expires_in_seconds"] == 100.0
    store.hint([5], RetentionHint(), pinned=True)
    clock.now += 100.0  # every client hint lapsed; the pin stays
    assert store.retention.expire() == 5 and store.retention_of(5)["pinned"]
    assert store.retention.owner_bytes("key:tenant:a") == 0
    assert store.hint([0, 1], RetentionHint(priority=3, owner="key:tenant:a")) == (2, 0)  # room again
