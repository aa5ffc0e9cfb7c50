"""The redis adapter against real redis-server, a 3-node Redis Cluster and Valkey on 127.0.0.1: startup
faults, wrong passwords, out-of-band deletes, records split across keys, a cluster node stopped mid-run,
TTLs, and two servers sharing one store."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import closing

import pytest

from kvtier_harness import services
import test_l2_remote_s3 as common  # noqa: E402 - the record helpers and checks all remote adapters share
from test_l2_remote_s3 import payload_of, record  # noqa: E402

from kvtier.errors import ConfigError, StorageError  # noqa: E402
from kvtier.l2.base import create_adapter  # noqa: E402
from kvtier.l2.redis import RedisConfig  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402

pytestmark = pytest.mark.services
BIG = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)  # 11.25 MiB per 256 tokens


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    with services.redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with services.redis_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def test_server_down_at_startup_then_recovers(tmp_path):
    port = services.free_port()
    spec = {"type": "redis", "url": f"redis://127.0.0.1:{port}/0", **common.FAST_RETRY}
    with closing(create_adapter(spec)) as adapter:
        assert "connect" in common.check_misses_while_down(adapter).lower()
        with services.redis_server(tmp_path, port=port) as server:
            name = common.check_reconnects(adapter, "redis")
            # the server goes away mid-run: a StorageError (the tier's miss), then unhealthy, then back
            server.stop()
            with pytest.raises(StorageError, match="get"):
                adapter.get([name])
            assert adapter.health()[0] is False and adapter.get([name]) == [None]
        with services.redis_server(tmp_path, port=port):
            services.wait_for(lambda: adapter.health()[0], 30, "the redis adapter to reconnect again")
            assert adapter.get([name]) == [None]  # a fresh server without persistence: a miss, not an error


def test_wrong_password_is_a_clear_error_without_the_secret(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "not-the-password-8472"
    with services.redis_server(tmp_path, password="the-right-one-1234") as server:
        for spec in ({"url": f"redis://:{wrong}@127.0.0.1:{server.port}/0"},
                     {"url": server.url, "password": wrong}):
            with pytest.raises(ConfigError, match="authentication.*failed") as info:
                create_adapter({"type": "redis", **spec})
            assert wrong not in str(info.value)
        adapter = create_adapter({"type": "redis", "url": server.url, "password": "the-right-one-1234"})
        assert wrong not in repr(adapter) and "the-right-one-1234" not in repr(adapter)
        adapter.close()
    assert wrong not in caplog.text
    config = RedisConfig(type="redis", url=f"redis://:{wrong}@127.0.0.1:1/0")
    assert wrong not in repr(config) and wrong not in str(config.model_dump())


def test_tls_rediss_url(tmp_path, caplog):
    with services.redis_server(tmp_path, tls=True) as server:
        assert server.url.startswith("rediss://")
        spec = {"type": "redis", "url": server.url, "tls_ca_file": server.tls_ca_file}
        with closing(create_adapter(spec)) as adapter:
            common.round_trip(adapter, 7)
        with pytest.raises(ConfigError, match="TLS certificate.*tls_ca_file"):  # the system CAs do not trust it
            create_adapter({"type": "redis", "url": server.url})
        plain = create_adapter({"type": "redis", "url": f"redis://127.0.0.1:{server.port}/0", "retries": 0,
                                "socket_timeout_seconds": 1, "connect_timeout_seconds": 1})
        assert plain.health()[0] is False  # plain text to a TLS-only port: unhealthy, not a crash
        plain.close()


def test_bad_url_scheme_is_refused():
    with pytest.raises(ConfigError, match="url scheme"):
        create_adapter({"type": "redis", "url": "http://127.0.0.1:6379"})


def test_record_deleted_out_of_band_is_a_miss(redis_server):
    with closing(create_adapter({"type": "redis", "url": redis_server.url, "prefix": "oob:"})) as adapter:
        name, parts, _ = record(2)
        assert adapter.put([(name, parts)]) == [True]
        assert redis_server.client().delete(f"oob:{{{name}}}") == 1
        assert adapter.contains([name]) == [False] and adapter.get([name]) == [None]


def test_large_record_is_split_and_reassembled(redis_server):
    limit = 1 << 20
    adapter = create_adapter({"type": "redis", "url": redis_server.url, "prefix": "split:", "max_value_bytes": limit})
    raw = redis_server.client()
    try:
        name, parts, payload = record(3, BIG, 256)
        assert adapter.put([(name, parts)]) == [True]
        part_keys = sorted(raw.keys(f"split:{{{name}}}:part:*"))
        assert len(part_keys) == 12  # 11.25 MiB + header in 1 MiB parts
        assert all(raw.strlen(k) <= limit for k in part_keys) and raw.strlen(f"split:{{{name}}}") < 100
        assert payload_of(adapter.get([name])[0]) == payload
        assert adapter.usage().used_bytes == sum(len(p) for p in parts)
        # a re-put replaces the parts (new write id) and removes the old ones
        assert adapter.put([(name, parts)]) == [True]
        new_keys = sorted(raw.keys(f"split:{{{name}}}:part:*"))
        assert len(new_keys) == 12 and not set(new_keys) & set(part_keys)
        # a lost part or a damaged part is a miss, never a partial or wrong record
        raw.delete(new_keys[5])
        assert adapter.get([name]) == [None]
        assert adapter.put([(name, parts)]) == [True]
        damaged = sorted(raw.keys(f"split:{{{name}}}:part:*"))[0]
        raw.setrange(damaged, 100, b"\xff")
        assert adapter.get([name]) == [None]
        assert adapter.delete([name]) == 1
        assert raw.keys("split:*") == []  # manifest and parts all gone
    finally:
        adapter.close()


def test_ttl_expires_records(redis_server):
    adapter = create_adapter({"type": "redis", "url": redis_server.url, "prefix": "ttl:", "ttl_seconds": 30,
                              "max_value_bytes": 4096})
    raw = redis_server.client()
    try:
        small, small_parts, _ = record(4, num_tokens=1)
        big, big_parts, _ = record(5)  # above 4096 bytes: split, and every part gets the TTL too
        assert adapter.put([(small, small_parts), (big, big_parts)]) == [True, True]
        keys = raw.keys("ttl:*")
        assert len(keys) > 2 and all(0 < raw.pttl(k) <= 30_000 for k in keys)
    finally:
        adapter.close()


def test_cluster_node_stopped_mid_run(cluster):
    adapter = create_adapter({"type": "redis", "url": cluster.url, "cluster": True, "prefix": "node:"})
    try:
        recs = [record(20 + i) for i in range(24)]
        names = [n for n, _, _ in recs]
        assert adapter.put([(n, p) for n, p, _ in recs]) == [True] * 24
        owner = {n: cluster.node_of(f"node:{{{n}}}") for n in names}
        down = owner[names[0]]
        assert 0 < sum(owner[n] == down for n in names) < len(names)
        cluster.stop_node(down)
        got = adapter.get(names)  # misses for the stopped node's slots, hits for the others
        for (name, _, payload), buf in zip(recs, got):
            if owner[name] == down:
                assert buf is None
            else:
                assert payload_of(buf) == payload
        try:  # writes that touch the stopped node fail as a StorageError (the tier's miss), never anything else
            adapter.put([(n, p) for n, p, _ in recs[:1]])
        except StorageError:
            pass
        cluster.start_node(down)
        cluster.wait_ok()

        def all_hit() -> bool:
            try:
                return all(b is not None for b in adapter.get(names))
            except StorageError:
                return False
        services.wait_for(all_hit, 30, "hits after the node came back")
        assert [payload_of(b) for b in adapter.get(names)] == [pl for _, _, pl in recs]
    finally:
        adapter.close()


@pytest.mark.parametrize("kind", ["cluster", "valkey"])
def test_two_servers_share_one_store(kind, cluster, tmp_path):
    def run(url: str, is_cluster: bool):
        spec = {"type": "valkey" if kind == "valkey" else "redis", "url": url, "cluster": is_cluster,
                "prefix": "shared:", "max_value_bytes": 1 << 20}
        with closing(create_adapter(spec)) as first, closing(create_adapter(spec)) as second:
            recs = [record(40 + i) for i in range(3)] + [record(50, BIG, 256)]  # the last one is split
            common.check_shared(first, second, recs)
    if kind == "cluster":
        run(cluster.url, True)
    else:
        with services.valkey_server(tmp_path) as valkey:
            assert "valkey_version" in valkey.client().info("server")
            run(valkey.url, False)


def test_two_writers_race_on_a_split_record(redis_server):
    """Concurrent writers of one split record: readers see one writer's whole record or a miss."""
    spec = {"type": "redis", "url": redis_server.url, "prefix": "race:", "max_value_bytes": 64 << 10}
    a, b, reader = create_adapter(spec), create_adapter(spec), create_adapter(spec)
    name, parts_a, payload_a = record(60, num_tokens=256)
    name_b, parts_b, payload_b = record(60, num_tokens=256, payload_seed=61)
    assert name_b == name and payload_b != payload_a
    seen, stop = set(), threading.Event()
    try:
        def write(adapter, parts):
            for _ in range(20):
                adapter.put([(name, parts)])

        def read():
            while not stop.is_set():
                buf = reader.get([name])[0]
                seen.add(None if buf is None else payload_of(buf))
        threads = [threading.Thread(target=write, args=(a, parts_a)), threading.Thread(target=write, args=(b, parts_b))]
        rt = threading.Thread(target=read)
        rt.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.05)
        stop.set()
        rt.join()
        assert seen <= {None, payload_a, payload_b} and seen - {None}
        assert payload_of(reader.get([name])[0]) in (payload_a, payload_b)
        manifest_parts = redis_server.client().keys(f"race:{{{name}}}:part:*")
        assert len(manifest_parts) == -(-sum(len(p) for p in parts_a) // (64 << 10))  # old parts cleaned up
    finally:
        for adapter in (a, b, reader):
            adapter.close()
