"""The s3 adapter against real S3 servers (moto_server, SeaweedFS) on 127.0.0.1: startup faults, bucket and
credential errors, out-of-band deletes, multipart uploads, and two servers sharing one bucket."""

from __future__ import annotations

import logging
from contextlib import closing

import numpy as np
import pytest

from kvtier_harness import services

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.hashing import prefix_hashes  # noqa: E402
from kvtier.keys import ChunkKey  # noqa: E402
from kvtier.l2.base import create_adapter  # noqa: E402
from kvtier.l2.s3 import S3Config  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402
from kvtier.record import decode_record, encode_record  # noqa: E402

pytestmark = pytest.mark.services
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64)


def record(seed: int, layout: KVLayout = LAYOUT, num_tokens: int = 16, payload_seed: int | None = None):
    """(name, parts, payload) of a real chunk record; ``payload_seed`` gives the same key another payload."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1000, 50_000, num_tokens).tolist()
    key = ChunkKey("m", layout.layout_id, "", prefix_hashes(tokens, num_tokens)[0])
    if payload_seed is not None:
        rng = np.random.default_rng(payload_seed)
    payload = rng.bytes(layout.chunk_bytes(num_tokens))
    return key.name(), encode_record(key, layout, tokens, payload), payload


def payload_of(buf) -> bytes:
    return bytes(decode_record(buf)[1])


# spec fields that make an adapter whose service is down fail fast and retry often
FAST_RETRY = {"retries": 0, "connect_timeout_seconds": 1, "retry_backoff_seconds": 0.1, "retry_backoff_max_seconds": 0.5}


def round_trip(adapter, seed: int = 1) -> str:
    """Puts ``record(seed)``, checks its payload reads back, and returns its name."""
    name, parts, payload = record(seed)
    assert adapter.put([(name, parts)]) == [True]
    assert payload_of(adapter.get([name])[0]) == payload
    return name


def check_misses_while_down(adapter) -> str:
    """An adapter (made with FAST_RETRY) whose service is down answers every operation as a miss and keeps
    retrying, with a backoff that doubles up to its bound. Returns the reason its first ``health()`` gave."""
    healthy, reason = adapter.health()
    assert not healthy
    name, parts, _ = record(1)
    assert adapter.put([(name, parts)]) == [False]
    assert adapter.get([name]) == [None] and adapter.contains([name]) == [False]
    assert adapter.list_names() == [] and adapter.delete([name]) == 0
    services.wait_for(lambda: not adapter.health()[0] and adapter._link.num_attempts >= 4, 30, "retries")
    assert adapter._link._delay_seconds == 0.5
    return reason


def check_reconnects(adapter, what: str) -> str:
    """Once the service is up the adapter turns healthy and round-trips ``record(1)``; returns its name."""
    services.wait_for(lambda: adapter.health()[0], 30, f"the {what} adapter to reconnect")
    return round_trip(adapter)


def check_shared(first, second, recs) -> None:
    """Records put through ``first`` are seen, read, listed and counted through ``second``; the last one,
    deleted through ``second``, is gone for ``first``."""
    names = [n for n, _, _ in recs]
    assert first.put([(n, p) for n, p, _ in recs]) == [True] * len(recs)
    assert second.contains(names) == [True] * len(recs)
    assert [payload_of(b) for b in second.get(names)] == [pl for _, _, pl in recs]
    assert sorted(second.list_names()) == sorted(names)
    assert second.usage().num_records == len(recs)
    assert second.delete(names[-1:]) == 1 and first.get(names[-1:]) == [None]


def spec(s3: services.S3Service, **kw) -> dict:
    return {"type": "s3", "bucket": "kvtier-it", "endpoint_url": s3.endpoint_url, "create": True,
            "aws_access_key_id": s3.access_key_id, "aws_secret_access_key": s3.secret_access_key, **kw}


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    with services.moto_server(tmp_path_factory.mktemp("moto")) as s3:
        yield s3


def test_endpoint_down_at_startup_then_recovers(tmp_path):
    port = services.free_port()
    with closing(create_adapter({"type": "OBJ", "bucket": "kvtier-late", "endpoint_url": f"http://127.0.0.1:{port}",
                                 "create": True, "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                                 **FAST_RETRY})) as adapter:
        assert "connect" in check_misses_while_down(adapter).lower()
        with services.moto_server(tmp_path, port=port):
            check_reconnects(adapter, "s3")


def test_missing_bucket_is_named_or_created(moto):
    with pytest.raises(ConfigError, match="'kvtier-missing'.*does not exist.*create"):
        create_adapter(spec(moto, bucket="kvtier-missing", create=False))
    with closing(create_adapter(spec(moto, bucket="kvtier-created", create=True))) as adapter:
        assert "kvtier-created" in [b["Name"] for b in moto.client().list_buckets()["Buckets"]]
        assert adapter.health() == (True, "ok")


def test_wrong_credentials_are_a_clear_error_without_the_secret(tmp_path, caplog):
    secret = "s3cr3t-K3Y-do-not-show-0123456789"
    caplog.set_level(logging.DEBUG)
    with services.moto_server(tmp_path, auth=True) as s3:  # moto checks keys against its IAM: these do not exist
        with pytest.raises(ConfigError) as info:
            create_adapter(spec(s3, aws_access_key_id="AKIAWRONGKEY000000", aws_secret_access_key=secret))
    message = str(info.value)
    assert "'kvtier-it'" in message and "denied" in message and "credentials" in message
    assert secret not in message and secret not in caplog.text
    config = S3Config(type="s3", bucket="kvtier-it", aws_secret_access_key=secret)
    assert secret not in repr(config) and secret not in str(config.model_dump())


def test_record_deleted_out_of_band_is_a_miss(moto):
    with closing(create_adapter(spec(moto, prefix="oob/"))) as adapter:
        name, parts, _ = record(2)
        assert adapter.put([(name, parts)]) == [True]
        moto.client().delete_object(Bucket="kvtier-it", Key="oob/" + name)
        assert adapter.contains([name]) == [False]
        assert adapter.get([name]) == [None]


def test_large_record_goes_multipart_and_round_trips(moto):
    with closing(create_adapter(spec(moto, prefix="mp/", multipart_threshold_bytes="5MiB"))) as adapter:
        layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2: 11.25 MiB per 256 tokens
        name, parts, payload = record(3, layout, 256)
        assert adapter.put([(name, parts)]) == [True]
        etag = moto.client().head_object(Bucket="kvtier-it", Key="mp/" + name)["ETag"]
        assert "-" in etag  # S3 ETags of multipart uploads end in -<number of parts>
        assert payload_of(adapter.get([name])[0]) == payload


@pytest.mark.parametrize("kind", ["moto", "seaweedfs"])
def test_two_servers_share_one_bucket(kind, moto, tmp_path):
    def run(s3):
        with (closing(create_adapter(spec(s3, prefix="shared/"))) as first,
              closing(create_adapter(spec(s3, prefix="shared/"))) as second):
            check_shared(first, second, [record(10 + i) for i in range(3)])
    if kind == "moto":
        run(moto)
    else:
        with services.seaweedfs(tmp_path) as weed:
            run(weed)
