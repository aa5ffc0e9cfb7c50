"""Eviction policies: order of victims, scan resistance (ARC), quick demotion (S3-FIFO), ghosts."""

import random

import pytest

from kvtier.errors import ConfigError
from kvtier.l1.policies import ARC, LRU, S3FIFO, make_policy


class Sim:
    """A cache of ``capacity`` equal-size entries driven by a policy, like L1Store does it."""

    def __init__(self, policy, capacity: int, pinned=()):
        self.policy, self.capacity, self.pinned = policy, capacity, set(pinned)
        self.resident: set = set()
        self.evicted: list = []

    def get(self, key) -> bool:
        if key in self.resident:
            self.policy.access(key)
            return True
        if len(self.resident) >= self.capacity:
            for victim in self.policy.victims():
                if victim in self.pinned:
                    continue
                self.policy.remove(victim, evicted=True)
                self.resident.discard(victim)
                self.evicted.append(victim)
                break
            else:
                return False  # everything pinned: not stored
        self.policy.insert(key)
        self.resident.add(key)
        return False


@pytest.mark.parametrize("name,cls", [("LRU", LRU), ("lru", LRU), ("ARC", ARC), ("arc", ARC),
                                      ("S3FIFO", S3FIFO), ("s3-fifo", S3FIFO), ("S3-FIFO", S3FIFO)])
def test_make_policy_names(name, cls):
    assert type(make_policy(name)) is cls


def test_make_policy_unknown_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        make_policy("MRU")
    for valid in ("LRU", "ARC", "S3FIFO"):
        assert valid in str(err.value)


def test_lru_evicts_least_recently_used_first():
    lru = LRU()
    for k in "abcde":
        lru.insert(k)
    lru.access("a")
    lru.access("c")
    assert list(lru.victims()) == ["b", "d", "e", "a", "c"]


def test_victims_skip_and_rotate_pinned_keys_each_yielded_once():
    for policy in (LRU(), ARC(), S3FIFO()):
        for k in range(10):
            policy.insert(k)
        yielded = []
        for k in policy.victims():
            yielded.append(k)
            if k % 2 == 0:  # evict even keys, skip (pin) odd ones
                policy.remove(k, evicted=True)
        assert sorted(yielded) == list(range(10)), type(policy).__name__
        assert len(policy) == 5 and all(k in policy for k in (1, 3, 5, 7, 9))


def test_everything_pinned_ends_the_pass():
    for policy in (LRU(), ARC(), S3FIFO()):
        for k in range(50):
            policy.insert(k)
            policy.access(k)
        assert sorted(policy.victims()) == list(range(50))
        assert len(policy) == 50


def _scan_survival(policy) -> bool:
    sim = Sim(policy, capacity=10)
    for _ in range(2):  # the hot key is used twice
        sim.get("hot")
    for i in range(100):  # a scan of one-time keys, ten times the cache
        sim.get(f"scan{i}")
    return "hot" in sim.resident


def test_arc_key_used_twice_survives_a_scan_of_one_time_keys():
    assert _scan_survival(ARC())
    assert not _scan_survival(LRU())  # the baseline the scan does flush


def test_arc_ghost_hit_adapts_p_and_ghosts_are_bounded():
    arc = ARC()
    sim = Sim(arc, capacity=4)
    sim.get("a")
    sim.get("a")  # T2 = {a}
    for k in range(4):  # T1 = {0, 1, 2}, then 3 evicts 0 from T1 into the ghost list B1
        sim.get(k)
    assert 0 in arc.b1 and arc.p == 0
    sim.get(0)  # ghost hit in B1: recency was undervalued, p grows, 0 goes to T2
    assert arc.p > 0 and 0 in arc.t2 and 0 not in arc.b1
    rng = random.Random(7)
    for _ in range(5000):
        sim.get(rng.randrange(1000))
        assert len(arc.t1) + len(arc.b1) <= arc._max_resident
        assert len(arc) + len(arc.b1) + len(arc.b2) <= 2 * arc._max_resident
    assert 0 <= arc.p <= arc._max_resident


def test_arc_explicit_remove_leaves_no_ghost():
    arc = ARC()
    arc.insert("a")
    arc.remove("a")
    assert "a" not in arc.b1 and len(arc) == 0
    arc.insert("b")
    arc.remove("b", evicted=True)
    assert "b" in arc.b1


def test_s3fifo_one_hit_wonders_are_evicted_before_reaccessed_keys():
    s3 = S3FIFO()
    sim = Sim(s3, capacity=20)
    for i in range(10):
        sim.get(f"re{i}")
        sim.get(f"re{i}")  # accessed again while in the small queue
    for i in range(10):
        sim.get(f"once{i}")
    for i in range(10):  # ten more newcomers force ten evictions
        sim.get(f"new{i}")
    assert sorted(sim.evicted) == sorted(f"once{i}" for i in range(10))
    assert all(f"re{i}" in sim.resident for i in range(10))
    assert all(f"once{i}" in s3.ghost for i in range(10))  # remembered: a return goes to main


def test_s3fifo_ghost_readmits_into_main_and_frequency_is_capped():
    s3 = S3FIFO()
    s3.insert("x")
    s3.remove("x", evicted=True)
    assert "x" in s3.ghost
    s3.insert("x")
    assert "x" in s3.main and "x" not in s3.ghost
    for _ in range(10):
        s3.access("x")
    assert s3.main["x"] == 3


def test_s3fifo_main_reinsertion_gives_accessed_keys_another_round():
    s3 = S3FIFO()
    for k in ("a", "b", "c"):
        s3.insert(k)
        s3.remove(k, evicted=True)
        s3.insert(k)  # back from the ghost: straight into main
    s3.access("a")
    order = []
    for k in s3.victims():
        order.append(k)
        s3.remove(k, evicted=True)
    assert order == ["b", "c", "a"]


def test_s3fifo_ghost_is_bounded():
    s3 = S3FIFO()
    sim = Sim(s3, capacity=8)
    for i in range(2000):
        sim.get(i)
    assert len(s3.ghost) <= s3._max_resident == 8


def test_hit_rate_on_skewed_trace_with_scans_beats_lru():
    """A hot set reused often, interleaved with long one-time scans: ARC and S3-FIFO keep the hot set."""
    rng = random.Random(42)
    trace, scan = [], 0
    for _ in range(300):
        trace += [f"hot{rng.randrange(30)}" for _ in range(20)]
        trace += [f"scan{scan + j}" for j in range(60)]
        scan += 60
    hits = {}
    for cls in (LRU, ARC, S3FIFO):
        sim = Sim(cls(), capacity=50)
        hits[cls.__name__] = sum(sim.get(k) for k in trace)
    assert hits["ARC"] > hits["LRU"] and hits["S3FIFO"] > hits["LRU"], hits
