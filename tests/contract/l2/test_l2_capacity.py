"""The L2 adapter contract under capacity pressure (l2/base.py): least recently used records go first, retained
records outlive ordinary ones until their retention expires, a record larger than the capacity is refused. Run
against every adapter that enforces a capacity (``capacity_adapter_factory``)."""

from __future__ import annotations

import time

from kvtier.hints import RetentionHint
from support.l2_records import SIZES, assert_record, make_record


def test_capacity_evicts_least_recently_used(capacity_adapter_factory):
    recs = [make_record(i) for i in range(5)]
    size = recs[0].nbytes
    assert all(r.nbytes == size for r in recs)
    capacity = 3 * size + size // 2
    adapter = capacity_adapter_factory(capacity_bytes=capacity)
    evicted: list[str] = []
    adapter.on_evict = evicted.extend
    for rec in recs[:3]:
        assert adapter.put([(rec.name, rec.parts)]) == [True]
    assert evicted == []
    adapter.get([recs[0].name])  # recs[1] is now the least recently used
    assert adapter.put([(recs[3].name, recs[3].parts)]) == [True]
    assert evicted == [recs[1].name]
    assert adapter.contains([recs[1].name, recs[0].name]) == [False, True]
    assert adapter.put([(recs[4].name, recs[4].parts)]) == [True]
    assert evicted == [recs[1].name, recs[2].name]
    usage = adapter.usage()
    assert usage.capacity_bytes == capacity
    assert usage.used_bytes <= capacity and usage.num_records == 3
    assert sorted(adapter.list_names()) == sorted(r.name for r in (recs[0], recs[3], recs[4]))
    for rec in (recs[0], recs[3], recs[4]):
        assert_record(adapter.get([rec.name])[0], rec)


def test_retained_records_outlive_ordinary_ones_under_capacity_pressure(capacity_adapter_factory):
    recs = [make_record(i) for i in range(12)]
    size = recs[0].nbytes
    adapter = capacity_adapter_factory(capacity_bytes=4 * size + size // 2)  # 4 records; hints may hold 2
    session = recs[:2]
    for rec in session:
        assert adapter.put([(rec.name, rec.parts)]) == [True]
    hint = RetentionHint(priority=2, session_id="agent-1")
    assert adapter.retain([(r.name, r.nbytes) for r in session], hint) == 2
    for rec in recs[2:]:  # far more ordinary records than fit; the session's two are the least recently used
        assert adapter.put([(rec.name, rec.parts)]) == [True]
    assert adapter.contains([r.name for r in session]) == [True, True]
    usage = adapter.usage()
    assert usage.used_bytes <= usage.capacity_bytes and usage.num_records == 4
    assert adapter.retain([(recs[-1].name, size)], hint) == 0  # past the share (half of the capacity): refused
    for rec in session:
        assert_record(adapter.get([rec.name])[0], rec)


def test_an_expired_retention_makes_a_record_ordinary(capacity_adapter_factory):
    recs = [make_record(i) for i in range(6)]
    size = recs[0].nbytes
    adapter = capacity_adapter_factory(capacity_bytes=3 * size + size // 2)
    adapter.put([(recs[0].name, recs[0].parts)])
    assert adapter.retain([(recs[0].name, size)], RetentionHint(ttl_seconds=0.05)) == 1
    time.sleep(0.1)
    for rec in recs[1:]:
        adapter.put([(rec.name, rec.parts)])
    assert adapter.contains([recs[0].name]) == [False]  # least recently used, and no longer protected


def test_record_larger_than_capacity_is_refused(capacity_adapter_factory):
    small, big = make_record(1), make_record(2, *SIZES["1MiB"])
    adapter = capacity_adapter_factory(capacity_bytes=big.nbytes // 2)
    evicted: list[str] = []
    adapter.on_evict = evicted.extend
    adapter.put([(small.name, small.parts)])
    assert adapter.put([(big.name, big.parts)]) == [False]
    assert evicted == [] and adapter.contains([big.name, small.name]) == [False, True]
    assert adapter.usage().used_bytes == small.nbytes
