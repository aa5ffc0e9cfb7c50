"""The L2 adapter contract (l2/base.py), run against every adapter in ADAPTER_FACTORIES.

Records are real (``support.l2_records``). Capacity pressure: test_l2_capacity.py; damage and faults:
test_l2_damage.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.errors import StorageError
from kvtier.record import decode_record
from support.l2_records import SIZES, Rec, assert_record, make_record

@pytest.mark.parametrize("size", list(SIZES))
def test_round_trip(adapter_factory, size):
    layout, num_tokens = SIZES[size]
    rec = make_record(1, layout, num_tokens)
    adapter = adapter_factory()
    assert adapter.put([(rec.name, rec.parts)]) == [True]
    assert adapter.contains([rec.name]) == [True]
    usage = adapter.usage()
    assert (usage.used_bytes, usage.num_records) == (rec.nbytes, 1)
    assert_record(adapter.get([rec.name])[0], rec)


def test_batch_keeps_order_and_reports_missing(adapter_factory):
    recs = [make_record(i) for i in range(5)]
    missing = make_record(99)
    adapter = adapter_factory()
    assert adapter.put([(r.name, r.parts) for r in recs]) == [True] * 5
    names = [recs[3].name, missing.name, recs[0].name, recs[4].name]
    got = adapter.get(names)
    assert got[1] is None
    for buf, rec in zip([got[0], got[2], got[3]], [recs[3], recs[0], recs[4]]):
        assert_record(buf, rec)
    assert adapter.contains(names) == [True, False, True, True]


def test_missing_names(adapter_factory):
    adapter = adapter_factory()
    names = [make_record(i).name for i in range(3)]
    assert adapter.get(names) == [None, None, None]
    assert adapter.contains(names) == [False, False, False]
    assert adapter.delete(names) == 0
    assert adapter.get([]) == [] and adapter.put([]) == [] and adapter.contains([]) == []
    assert adapter.usage().num_records == 0


def test_batch_naming_same_key_twice(adapter_factory):
    rec = make_record(2)
    adapter = adapter_factory()
    assert adapter.put([(rec.name, rec.parts), (rec.name, rec.parts)]) == [True, True]
    assert adapter.list_names() == [rec.name]
    assert (adapter.usage().used_bytes, adapter.usage().num_records) == (rec.nbytes, 1)
    first, second = adapter.get([rec.name, rec.name])
    assert_record(first, rec)
    assert_record(second, rec)


def test_reput_leaves_usage_unchanged(adapter_factory):
    recs = [make_record(i, *SIZES["1MiB"]) for i in range(2)]
    adapter = adapter_factory()
    adapter.put([(r.name, r.parts) for r in recs])
    before = adapter.usage()
    assert before.used_bytes == sum(r.nbytes for r in recs)
    assert adapter.put([(recs[0].name, recs[0].parts)]) == [True]
    assert adapter.usage() == before
    assert_record(adapter.get([recs[0].name])[0], recs[0])


def test_two_writers_and_a_reader_never_see_a_torn_record(adapter_factory):
    layout, num_tokens = SIZES["1MiB"]
    one = make_record(10, layout, num_tokens)
    # the same key and tokens with another payload: a mixed record would fail the checksum
    other = make_record(11, layout, tokens=one.tokens)
    assert one.name == other.name and one.payload != other.payload
    adapter = adapter_factory()
    done = threading.Event()
    errors: list[BaseException] = []
    reads = {"none": 0, "one": 0, "other": 0}
    # the contract lets any call raise StorageError (the tier makes it a miss): a service may refuse a request
    # under this race (moto answers some concurrent PutObject calls with 500); a torn record is never allowed
    refused = {"puts": 0, "other": 0}
    stored = [0]

    def writer(rec: Rec) -> None:
        try:
            for i in range(30):
                try:
                    stored[0] += sum(adapter.put([(rec.name, rec.parts)]))
                    if i % 2:  # deleting makes the next put write again instead of finding it stored
                        adapter.delete([rec.name])
                except StorageError:
                    refused["puts"] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def reader() -> None:
        try:
            while not done.is_set():
                try:
                    buf = adapter.get([one.name])[0]
                except StorageError:
                    refused["other"] += 1
                    continue
                if buf is None:
                    reads["none"] += 1
                    continue
                _, payload = decode_record(buf, key=one.key, token_ids=one.tokens)
                payload = bytes(payload)
                assert payload in (one.payload, other.payload), "record mixes two writers"
                reads["one" if payload == one.payload else "other"] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(r,)) for r in (one, other)]
    read_thread = threading.Thread(target=reader)
    read_thread.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    read_thread.join()
    assert not errors, errors
    assert sum(reads.values()) > 0
    assert refused["puts"] < 15 and stored[0] > 0, (refused, stored)  # refusals are rare, not the rule
    # a service that refused calls under the race answers misses until its backoff passes: then the last put holds
    deadline = time.monotonic() + 30
    while True:
        try:
            adapter.delete([one.name])
            adapter.put([(other.name, other.parts)])
            buf = adapter.get([other.name])[0]
        except StorageError:
            buf = None
        if buf is not None and bytes(decode_record(buf, key=other.key, token_ids=other.tokens)[1]) == other.payload \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert_record(buf, other)
    assert adapter.usage().num_records == 1 and adapter.usage().used_bytes == other.nbytes


def test_recover_after_recreating_the_adapter(adapter_factory):
    recs = [make_record(i, *SIZES["1MiB"]) for i in range(4)]
    first = adapter_factory()
    assert first.put([(r.name, r.parts) for r in recs]) == [True] * 4
    first.close()
    second = adapter_factory()
    assert sorted(second.list_names()) == sorted(r.name for r in recs)
    usage = second.usage()
    assert (usage.used_bytes, usage.num_records) == (sum(r.nbytes for r in recs), 4)
    assert second.contains([r.name for r in recs]) == [True] * 4
    for buf, rec in zip(second.get([r.name for r in recs]), recs):
        assert_record(buf, rec)


def test_delete(adapter_factory):
    recs = [make_record(i) for i in range(3)]
    adapter = adapter_factory()
    adapter.put([(r.name, r.parts) for r in recs])
    assert adapter.delete([recs[0].name, recs[1].name, make_record(50).name]) == 2
    assert adapter.get([recs[0].name, recs[1].name]) == [None, None]
    assert adapter.contains([recs[0].name, recs[2].name]) == [False, True]
    assert adapter.list_names() == [recs[2].name]
    assert adapter.usage().used_bytes == recs[2].nbytes
    assert adapter.delete([recs[0].name]) == 0


def test_index_follows_put_delete_and_clear(adapter_factory):
    """``indexed`` (no I/O) agrees with what the adapter itself put, deleted and cleared; None means the
    adapter keeps no index (the L2 tier keeps one for it)."""
    recs = [make_record(i) for i in range(3)]
    adapter = adapter_factory()
    if adapter.indexed([]) is None:
        pytest.skip(f"{adapter.label} keeps no index")
    assert adapter.indexed([r.name for r in recs]) == [False, False, False]
    adapter.put([(r.name, r.parts) for r in recs])
    assert adapter.indexed([r.name for r in recs]) == [True, True, True]
    adapter.delete([recs[1].name])
    assert adapter.indexed([r.name for r in recs]) == [True, False, True]
    adapter.clear()
    assert adapter.indexed([r.name for r in recs]) == [False, False, False]


def test_clear(adapter_factory):
    recs = [make_record(i) for i in range(3)]
    adapter = adapter_factory()
    adapter.put([(r.name, r.parts) for r in recs])
    assert sorted(adapter.clear()) == sorted(r.name for r in recs)
    assert adapter.list_names() == []
    assert (adapter.usage().used_bytes, adapter.usage().num_records) == (0, 0)
    assert adapter.get([recs[0].name]) == [None]
    assert adapter.put([(recs[0].name, recs[0].parts)]) == [True]
    assert_record(adapter.get([recs[0].name])[0], recs[0])
