"""Record authentication for shared L2s (issue 9 §4, issue 22): a record forged by someone who can write the
store is a miss, deleted and counted; another deployment's valid records are misses that are kept; key
rotation; on a real local disk and a real redis-server."""

from __future__ import annotations

from contextlib import closing

import pytest
import torch
from support.server import CHUNK, LAYOUT

from kvtier_harness import services

from kvtier.cache import KVCache  # noqa: E402
from kvtier.config import build_config  # noqa: E402
from kvtier.l2.base import create_adapter  # noqa: E402
from kvtier.record import encode_record  # noqa: E402

RECORD_KEY = "shared-l2-record-key-0123456789"


@pytest.fixture(scope="module")
def redis_service(tmp_path_factory):
    with services.redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["local_disk", "redis"])
def l2_spec(request, tmp_path):
    if request.param == "local_disk":
        return {"type": "local_disk", "path": str(tmp_path / "disk")}
    redis = request.getfixturevalue("redis_service")
    return {"type": "redis", "url": redis.url, "prefix": f"{tmp_path.name}:"}


def cache(spec: dict, record_key: str | None) -> KVCache:
    return KVCache(build_config({"chunk_size": CHUNK, "l2_adapters": [spec], "l2_record_key": record_key}), "m", LAYOUT)


def forge(spec: dict, honest: KVCache, tokens: list[int], forger_key: bytes | None) -> torch.Tensor:
    """Overwrite the stored record of ``tokens``' first chunk as someone who can write the store would: the
    right key and token ids, other KV, a correct checksum; signed with ``forger_key`` (not the real one)."""
    _, refs = honest.chunk_refs(tokens)
    fake = torch.full(LAYOUT.chunk_shape(CHUNK), 7.0)
    with closing(create_adapter(spec)) as store:
        name = refs[0].key.name()
        assert store.delete([name]) == 1
        parts = encode_record(refs[0].key, LAYOUT, tokens[:CHUNK], fake.numpy(), auth_key=forger_key)
        assert store.put([(name, parts)]) == [True]
    return fake


def test_a_forged_record_is_a_miss_deleted_and_counted(l2_spec):
    """Forged under the real key id (or unsigned): a wrong tag under a key the reader holds is a forgery."""
    tokens = list(range(1000, 1000 + 2 * CHUNK))
    kv = torch.randn(LAYOUT.chunk_shape(2 * CHUNK))
    with cache(l2_spec, RECORD_KEY) as writer:
        assert writer.store(tokens, kv) == 2 and writer.flush(30.0)
        forge(l2_spec, writer, tokens, None)  # unsigned: a keyed reader requires a tag
    with cache(l2_spec, RECORD_KEY) as reader:
        assert reader.lookup(tokens) == 2 * CHUNK  # present in the store, not yet verified
        out, n = reader.retrieve(tokens)
        assert n == 0 and out.shape[2] == 0  # the forged first chunk is a miss, so the prefix stops there
        assert reader.metrics.value("kvtier_l2_auth_failures_total", adapter=l2_spec["type"]) == 1
        assert reader.metrics.value("kvtier_corrupt_records_total", adapter=l2_spec["type"]) == 0
        assert reader.lookup(tokens) == 0  # deleted
        assert reader.store(tokens, kv) == 2 and reader.flush(30.0)
    with cache(l2_spec, RECORD_KEY) as again:  # rewritten honestly: served with the real bytes
        out, n = again.retrieve(tokens)
        assert n == 2 * CHUNK and torch.equal(out, kv)


def test_another_deployments_records_are_kept_and_never_reported_as_held(l2_spec):
    """Issue 22 finding 2: a server with another record key used to delete every valid record it read (a key
    rotation, or a second deployment on the same bucket, wiped the other side). Now: a miss, kept, counted
    apart from forgeries; its lookup stops reporting the chunk; the owner still reads it."""
    tokens = list(range(3000, 3000 + 2 * CHUNK))
    kv = torch.randn(LAYOUT.chunk_shape(2 * CHUNK))
    with cache(l2_spec, RECORD_KEY) as owner:
        assert owner.store(tokens, kv) == 2 and owner.flush(30.0)
    with cache(l2_spec, "the other deployment's record key") as other:
        out, n = other.retrieve(tokens)
        assert n == 0
        assert other.metrics.value("kvtier_l2_foreign_records_total", adapter=l2_spec["type"]) == 2  # one batched read
        assert other.metrics.value("kvtier_l2_auth_failures_total", adapter=l2_spec["type"]) == 0
        assert other.metrics.value("kvtier_corrupt_records_total", adapter=l2_spec["type"]) == 0
        assert other.lookup(tokens) == 0  # lookup never reports what retrieve refuses
    with cache(l2_spec, RECORD_KEY) as owner_again:
        out, n = owner_again.retrieve(tokens)
        assert n == 2 * CHUNK and torch.equal(out, kv)  # both records survived


def test_a_rotated_key_reads_the_old_records_and_an_unkeyed_server_refuses_signed_ones(l2_spec):
    tokens = list(range(5000, 5000 + CHUNK))
    kv = torch.randn(LAYOUT.chunk_shape(CHUNK))
    with cache(l2_spec, RECORD_KEY) as old:
        assert old.store(tokens, kv) == 1 and old.flush(30.0)
    with cache(l2_spec, None) as unkeyed:  # finding 3: used to serve records of a keyed deployment unchecked
        assert unkeyed.retrieve(tokens)[1] == 0
        assert unkeyed.metrics.value("kvtier_l2_foreign_records_total", adapter=l2_spec["type"]) == 1
    with KVCache(build_config({"chunk_size": CHUNK, "l2_adapters": [l2_spec], "l2_accept_signed_records": True}),
                 "m", LAYOUT) as opted_in:
        assert opted_in.retrieve(tokens)[1] == CHUNK
    rotated = build_config({"chunk_size": CHUNK, "l2_adapters": [l2_spec], "l2_record_key": "a new record key 0123",
                            "l2_record_verify_keys": [RECORD_KEY]})
    with KVCache(rotated, "m", LAYOUT) as new:
        out, n = new.retrieve(tokens)
        assert n == CHUNK and torch.equal(out, kv)
