"""Retention hints over the real server (issue 19 §1): a session's chunks survive a stream of other prompts that
evicts the same chunks stored without a hint; bad hints are refused with the field named."""

from __future__ import annotations

import torch
from support.raw import Raw
from support.server import CHUNK, CHUNK_BYTES, LAYOUT, ServerProc

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
