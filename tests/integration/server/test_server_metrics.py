"""Exact counters on /metrics after a scripted mix of hits, misses, evictions, L2 faults and a corrupt
record; admin HTTP (/healthz, /status, token-protected /clear) and ``kvtier status``."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
import torch
from support.server import (
    CHUNK,
    CHUNK_BYTES,
    LAYOUT,
    ServerProc,
    kvtier_cmd,
    metric_value,
    wait_for,
)

from kvtier.hashing import prefix_hashes
from kvtier.client import Client
from kvtier.keys import ChunkKey, chunk_layout_id

TOKEN = "s3cret-admin-token"


def prompt(first: int, num_chunks: int) -> list[int]:
    return list(range(first, first + num_chunks * CHUNK))


def kv_for(tokens, seed):
    return torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def server(tmp_path):
    disk = tmp_path / "disk"
    config = {"l2_write_queue_size": 2,  # a 3-chunk store queues 2 L2 writes and drops 1
              "l2_adapters": [{"type": "local_disk", "name": "disk", "path": str(disk)},
                              {"type": "faulty", "name": "flaky", "inner": {"type": "memory"},
                               "error_rate": 1.0, "ops": ["put"]}]}
    # L1 holds exactly 3 chunks of 2048 bytes
    with ServerProc(tmp_path, l1="6200B", config=config, token=TOKEN) as srv:
        srv.disk = disk
        yield srv


def test_every_counter_is_exact_after_a_scripted_mix(server):
    a = Client(server.url, model="m", layout=LAYOUT)  # shared memory
    b = Client(server.url, model="m", layout=LAYOUT, shared_memory=False)  # frames
    p2, p3, p4 = prompt(2000, 3), prompt(3000, 3), prompt(4000, 3)
    kv2, kv3, kv4 = kv_for(p2, 2), kv_for(p3, 3), kv_for(p4, 4)

    def l2_batches_done(n):  # each 3-chunk store: one L2 batch; disk stores 2, flaky fails once
        return lambda: a.stats().get("kvtier_l2_errors_total", {}).get("adapter=flaky,op=put") == n

    assert a.lookup(p2) == 0                                   # miss
    assert a.store(p2, kv2) == 3                               # L1 full now
    wait_for(l2_batches_done(1), what="first L2 batch")
    assert b.lookup(p2) == 3 * CHUNK                           # all in L1
    assert a.store(p3, kv3) == 3                               # evicts all of p2 (3)
    wait_for(l2_batches_done(2), what="second L2 batch")
    assert a.lookup(p2) == 2 * CHUNK                           # 2 chunks on disk (the 3rd write was dropped)
    out, n = a.retrieve(p2)                                    # promotes 2 chunks, evicting 2 of p3
    assert n == 2 * CHUNK and torch.equal(out, kv2[:, :, :n])
    assert b.store(p4, kv4) == 3                               # evicts the 3 chunks in L1
    wait_for(l2_batches_done(3), what="third L2 batch")
    out, n = b.retrieve(p4)
    assert n == 3 * CHUNK and torch.equal(out, kv4)
    # corrupt p3's first chunk on disk: the read verifies it, deletes it and counts it
    name = ChunkKey("m", chunk_layout_id(LAYOUT.layout_id, CHUNK), "", prefix_hashes(p3, CHUNK)[0]).name()
    (path,) = [p for p in server.disk.rglob(f"*{name}*") if p.is_file()]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    out, n = a.retrieve(p3)
    assert n == 0 and out.shape[2] == 0
    assert a.lookup(p3) == 0

    text = server.metrics_text()
    capacity = server.status()["l1"]["capacity_bytes"]
    expected = {
        ("kvtier_lookup_requests_total", ()): 4,
        ("kvtier_lookup_tokens_total", ()): 4 * 3 * CHUNK,
        ("kvtier_lookup_hit_tokens_total", (("medium", "CPU"),)): 3 * CHUNK,
        ("kvtier_lookup_hit_tokens_total", (("medium", "STORAGE"),)): 2 * CHUNK,
        ("kvtier_store_chunks_total", ()): 9,
        ("kvtier_retrieve_chunks_total", ()): 5,
        ("kvtier_l1_usage_bytes", ()): 3 * CHUNK_BYTES,
        ("kvtier_l1_capacity_bytes", ()): capacity,
        ("kvtier_l1_chunks", ()): 3,
        ("kvtier_evicted_chunks_total", (("medium", "CPU"),)): 8,
        ("kvtier_l2_errors_total", (("adapter", "flaky"), ("op", "put"))): 3,
        ("kvtier_l2_write_dropped_total", ()): 3,
        ("kvtier_l2_writes_total", (("adapter", "disk"),)): 6,
        ("kvtier_l2_promoted_chunks_total", ()): 2,
        ("kvtier_corrupt_records_total", (("adapter", "disk"),)): 1,
        ("kvtier_store_seconds_count", ()): 3,
        ("kvtier_retrieve_seconds_count", ()): 3,
        ("kvtier_connected_clients", ()): 2,
    }
    got = {key: metric_value(text, key[0], **dict(key[1])) for key in expected}
    assert got == expected
    assert capacity == 6200 and 6200 < 4 * CHUNK_BYTES
    assert metric_value(text, "kvtier_client_unavailable_total") == 0  # client-side metric, never moved here
    assert a.metrics.value("kvtier_client_unavailable_total") == 0
    a.close()
    b.close()
    assert metric_value(server.metrics_text(), "kvtier_connected_clients") == 0


def test_admin_endpoints_and_token_protected_clear(server):
    with Client(server.url, model="m", layout=LAYOUT) as client:
        tokens = prompt(100, 2)
        assert client.store(tokens, kv_for(tokens, 1)) == 2
        health = httpx.get(server.admin + "/healthz")
        assert (health.status_code, health.text) == (200, "ok")
        status = server.status()
        assert status["l1"]["num_chunks"] == 2 and status["l1"]["used_bytes"] == 2 * CHUNK_BYTES
        assert status["connected_clients"] == 1 and status["clients"][0]["model"] == "m"
        with Client(server.url, model="m", layout=LAYOUT, namespace="salt-of-tenant-x") as salted:
            assert salted.ping()
            shown = {c["namespace"] for c in server.status()["clients"]}
            assert "salt-of-tenant-x" not in str(server.status()) and any(n and n.startswith("sha256:") for n in shown)
        assert [a["name"] for a in status["l2"]] == ["disk", "flaky"] and status["l2"][0]["healthy"] is True
        assert status["config"]["chunk_size"] == CHUNK and status["uptime_seconds"] >= 0
        for path in ("/status", "/metrics", "/healthz"):
            body = httpx.get(server.admin + path).text
            assert TOKEN not in body and "PATH" not in body and "HOME" not in body
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            refused = httpx.post(server.admin + "/clear", headers={**headers, "X-KVTier-Admin": "1"})
            assert refused.status_code == 401
            assert client.lookup(tokens) == 2 * CHUNK  # nothing cleared
        cleared = httpx.post(server.admin + "/clear", headers={"Authorization": f"Bearer {TOKEN}", "X-KVTier-Admin": "1"})
        assert cleared.status_code == 200 and cleared.json()["num_l1_chunks"] == 2
        assert client.lookup(tokens) == 0
        assert httpx.get(server.admin + "/clear").status_code == 405


def test_kvtier_status_prints_the_status_json(server):
    out = subprocess.run(kvtier_cmd("status", "--admin-url", server.admin), capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["server_id"] == server.status()["server_id"] and "l1" in body


def test_status_masks_secrets_in_adapter_specs():
    from kvtier.server.admin.status import redact

    spec = {"type": "faulty", "inner": {"type": "s3", "aws_secret_access_key": "AKIA-SECRET", "bucket": "b"},
            "url": "redis://user:pa55@host:6379/0", "connection_string": "AccountKey=abc", "path": "/data"}
    out = redact(spec)
    text = repr(out)
    assert "AKIA-SECRET" not in text and "pa55" not in text and "AccountKey=abc" not in text
    assert out["inner"]["bucket"] == "b" and out["path"] == "/data" and out["url"] == "redis://***@host:6379/0"


def test_healthz_is_503_with_the_reason_once_stopping():
    from starlette.testclient import TestClient

    from kvtier.config import build_config
    from kvtier.server.admin.http import build_app
    from kvtier.server.server import KVTierServer
    from kvtier.server.admin.telemetry import Telemetry

    config = build_config({"l1_size_gb": 0.001, "server": {"port": 0, "shared_memory": False}})
    server = KVTierServer(config)
    telemetry = Telemetry(server.metrics)
    try:
        http = TestClient(build_app(server, telemetry))
        assert http.get("/healthz").status_code == 200
        server.stop()
        down = http.get("/healthz")
        assert down.status_code == 503 and down.text == "unhealthy: shutting down"
        assert metric_value(http.get("/metrics").text, "kvtier_l1_capacity_bytes") == 1_000_000
    finally:
        server.close()
        telemetry.close()
