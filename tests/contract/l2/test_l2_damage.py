"""The L2 adapter contract against damage (l2/base.py): a corrupt, empty, truncated or torn record is detected,
never returned as KV; injected faults (``l2.faulty.FaultyAdapter``) are deterministic and hit only the chosen
operations. Run against every adapter in ADAPTER_FACTORIES."""

from __future__ import annotations

import pytest

from kvtier.errors import CorruptRecordError, StorageError
from kvtier.l2.faulty import FaultyAdapter
from kvtier.record import decode_record
from support.l2_records import SIZES, Rec, assert_record, make_record


def _damage(kind: str, rec: Rec) -> list:
    data = bytearray(b"".join(bytes(p) for p in rec.parts))
    if kind == "garbage":
        return [b"this is not a kvtier record" * 40]
    if kind == "empty":
        return [b""]
    if kind == "truncated":
        return [bytes(data[: len(data) // 2])]
    if kind == "flipped_payload":
        data[-10] ^= 0xFF
    elif kind == "flipped_header_checksum":  # the u64 checksum sits before the trailing "raw" encoding
        data[len(rec.parts[0]) - 6] ^= 0x01
    return [bytes(data)]


@pytest.mark.parametrize("kind", ["garbage", "empty", "truncated", "flipped_payload", "flipped_header_checksum"])
def test_corrupt_record_is_detected(adapter_factory, kind):
    rec = make_record(3)
    adapter = adapter_factory()
    assert adapter.put([(rec.name, _damage(kind, rec))]) == [True]
    buf = adapter.get([rec.name])[0]
    assert buf is not None
    with pytest.raises(CorruptRecordError):
        decode_record(buf, key=rec.key, token_ids=rec.tokens)
    assert adapter.delete([rec.name]) == 1  # what the cache does next
    assert adapter.get([rec.name]) == [None]


@pytest.mark.parametrize("fault", ["torn_write_rate", "corrupt_rate"])
def test_faulty_damaged_writes_are_detected(adapter_factory, fault):
    recs = [make_record(i, *SIZES["1MiB"]) for i in range(4)]
    faulty = FaultyAdapter.wrap(adapter_factory(), seed=5, **{fault: 1.0})
    assert faulty.put([(r.name, r.parts) for r in recs]) == [True] * 4
    assert sum(faulty.injected.values()) == 4
    for buf, rec in zip(faulty.get([r.name for r in recs]), recs):
        with pytest.raises(CorruptRecordError):
            decode_record(buf, key=rec.key, token_ids=rec.tokens)


def _fault_pattern(adapter, seed: int, recs: list[Rec]) -> list[str]:
    faulty = FaultyAdapter.wrap(adapter, seed=seed, error_rate=0.5)
    pattern = []
    for rec in recs:
        for op in ("put", "get", "contains"):
            try:
                if op == "put":
                    result = faulty.put([(rec.name, rec.parts)])
                    assert result == [True]
                elif op == "get":
                    buf = faulty.get([rec.name])[0]
                    if buf is not None:  # stored by an earlier put that was not failed
                        assert_record(buf, rec)
                else:
                    faulty.contains([rec.name])
                pattern.append(op)
            except StorageError:
                pattern.append("error")
    assert sum(faulty.injected.values()) == pattern.count("error")
    return pattern


def test_faulty_error_injection_is_deterministic(adapter_factory):
    recs = [make_record(i) for i in range(20)]
    adapter = adapter_factory()
    first = _fault_pattern(adapter, 7, recs)
    adapter.clear()
    again = _fault_pattern(adapter, 7, recs)
    adapter.clear()
    other_seed = _fault_pattern(adapter, 8, recs)
    assert first == again
    assert first != other_seed
    assert 10 <= first.count("error") <= 50  # 60 draws at rate 0.5


def test_faulty_errors_only_on_selected_ops(adapter_factory):
    rec = make_record(4)
    faulty = FaultyAdapter.wrap(adapter_factory(), seed=1, error_rate=1.0, ops=["get"])
    assert faulty.put([(rec.name, rec.parts)]) == [True]
    assert faulty.contains([rec.name]) == [True]
    with pytest.raises(StorageError, match="injected get failure"):
        faulty.get([rec.name])
    assert_record(faulty.inner.get([rec.name])[0], rec)
