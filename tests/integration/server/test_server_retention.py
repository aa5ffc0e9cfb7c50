"""Retention hints over the real server (issue 19 §1): a session's chunks survive a stream of other prompts that
evicts the same chunks stored without a hint; bad hints are refused with the field named."""

from __future__ import annotations

import httpx
import torch
from support.raw import Raw
from support.server import CHUNK, CHUNK_BYTES, LAYOUT, ServerProc, metric_value, tenant_file

from kvtier import protocol as P
from kvtier.client import Client
from kvtier.hints import RetentionHint


def kv_for(tokens, seed):
    return torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(seed))


def tokens_of(i: int, num_chunks: int) -> list[int]:
    return list(range(i * 100_000, i * 100_000 + num_chunks * CHUNK))


def test_a_session_survives_pressure_that_evicts_an_unhinted_prompt(tmp_path):
    with ServerProc(tmp_path, l1=f"{16 * CHUNK_BYTES}B") as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        session, plain = tokens_of(1, 3), tokens_of(2, 3)
        kv = kv_for(session, 1)
        assert client.store(session, kv, hint=RetentionHint(ttl_seconds=600.0, session_id="agent-7")) == 3
        assert client.store(plain, kv_for(plain, 2)) == 3
        for i in range(10, 30):  # 20 chunks of other prompts through a 16-chunk L1
            other = tokens_of(i, 1)
            client.store(other, kv_for(other, i))
        assert client.lookup(plain) == 0
        assert client.lookup(session) == 3 * CHUNK
        out, n = client.retrieve(session)
        assert n == 3 * CHUNK and torch.equal(out, kv)


def test_hints_past_the_share_are_counted_as_refused(tmp_path):
    with ServerProc(tmp_path, l1=f"{16 * CHUNK_BYTES}B", config={"l1_retention_max_share": 0.25}) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        prompt = tokens_of(3, 6)
        assert client.store(prompt, kv_for(prompt, 3), hint=RetentionHint(priority=3)) == 6
        stats = client.stats()
        refused = sum(stats.get("kvtier_retention_refused_chunks_total", {}).values())
        assert refused == 2  # a quarter of a 16-chunk L1 protects 4 of the 6 chunks


def test_bad_hints_are_refused_naming_the_field(tmp_path):
    with ServerProc(tmp_path) as server:
        raw = Raw(server.url)
        tokens = P.pack_tokens(tokens_of(4, 1))
        for fields, name in [({"priority": 9}, "priority"), ({"ttl_seconds": 0}, "ttl_seconds"),
                             ({"ttl_seconds": -1.5}, "ttl_seconds"), ({"session_id": ""}, "session_id")]:
            reply = raw.ask(P.StoreBegin(id=1, tokens=tokens, **fields))
            assert isinstance(reply, P.Error) and reply.code == "bad_request", reply
            assert name in reply.message
        raw.close()


def test_one_tenant_cannot_take_the_protected_share(tmp_path):
    """Issue 38 finding 3: tenant A stored with priority 3 and took all of ``l1_retention_max_share``: B's hints were
    then refused, so was the admin's pin, and ``ttl_seconds=1e12`` was accepted. One principal's hints now hold at
    most ``l1_retention_max_share_per_principal`` of L1, and a TTL is bounded by ``retention_max_ttl_seconds``."""
    config = {"l1_retention_max_share": 0.5, "l1_retention_max_share_per_principal": 0.25,
              "retention_max_ttl_seconds": 3600}
    with ServerProc(tmp_path, l1=f"{64 * CHUNK_BYTES}B", config=config, token="admin-token") as server:
        a_file, b_file = tenant_file(server, "team-a", tmp_path), tenant_file(server, "team-b", tmp_path)
        with Client(server.url, model="m", layout=LAYOUT, secret_file=a_file) as a, \
                Client(server.url, model="m", layout=LAYOUT, secret_file=b_file) as b:
            hog = tokens_of(1, 40)
            assert a.store(hog, kv_for(hog, 1), hint=RetentionHint(priority=3)) == 40

            def refused() -> float:
                return metric_value(server.metrics_text(), "kvtier_retention_refused_chunks_total") or 0

            assert refused() == 24  # 16 chunks (a quarter of L1) protected, the rest stored as ordinary chunks
            mine = tokens_of(2, 8)
            assert b.store(mine, kv_for(mine, 2), hint=RetentionHint(priority=1, session_id="b-agent")) == 8
            assert refused() == 24  # B's hints are honoured
            for i in range(10, 74):  # a whole L1 of A's ordinary prompts: B's session stays, and A's protected quarter
                other = tokens_of(i, 1)
                a.store(other, kv_for(other, i))
            assert b.lookup(mine) == 8 * CHUNK and a.lookup(hog) == 16 * CHUNK
            raw = Raw(server.url, secret_file=a_file)
            reply = raw.ask(P.StoreBegin(id=1, tokens=P.pack_tokens(tokens_of(90, 1)), priority=3, ttl_seconds=1e12))
            assert reply.code == "bad_request" and "retention_max_ttl_seconds (3600)" in reply.message
            raw.close()
        pinned = httpx.post(server.admin + "/cache/pin", json={"model": "m", "tenant": "team-b", "tokens": mine},
                            headers={"Authorization": "Bearer admin-token"})
        assert pinned.status_code == 200 and pinned.json()["pinned"] == 8  # the admin's pin still finds room
