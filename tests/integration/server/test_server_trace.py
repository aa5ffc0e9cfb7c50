"""The server's request trace (issue 19 §3): a real ``kvtier server`` with --trace-file records the requests made, in
order, with their hits; it stays within trace_max_bytes; and simulating it at the server's own size and policy gives
the hit rate the server answered."""

from __future__ import annotations

import pytest
import torch
from support.server import CHUNK, CHUNK_BYTES, LAYOUT, ServerProc, metric_value, wait_for

from kvtier.client import Client
from kvtier.hints import RetentionHint
from kvtier.trace.format import read_trace
from kvtier.trace.simulate import SimConfig, simulate


def prompt(first: int, num_chunks: int) -> list[int]:
    return list(range(first, first + num_chunks * CHUNK))


def kv_for(tokens, seed: int = 0):
    return torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(seed))


def test_the_trace_has_the_requests_made(tmp_path):
    path = tmp_path / "server.trace"
    first, longer = prompt(0, 3), prompt(0, 4) + [7, 7, 7]  # the second continues the first, with a partial tail
    with ServerProc(tmp_path, l1=f"{16 * CHUNK_BYTES}B", token="admin-secret",
                    extra=("--trace-file", str(path), "--trace-token-ids")) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        assert client.lookup(first) == 0
        assert client.store(first, kv_for(first)) == 3
        assert client.lookup_tiers(first).num_l1_tokens == 3 * CHUNK
        assert client.retrieve(first)[1] == 3 * CHUNK
        assert client.store(longer, kv_for(longer), hint=RetentionHint(priority=2, session_id="agent-1")) == 1
        assert client.clear("CPU", admin_token="admin-secret") == 4
        assert server.stop() == 0  # SIGTERM: the server writes what is queued and closes the trace
    header, records = read_trace(path)
    assert (header.chunk_size, header.l1_size_bytes, header.eviction_policy) == (CHUNK, 16 * CHUNK_BYTES, "LRU")
    everything = [r for _, r in records]
    assert [r.op for r in everything] == ["lookup", "store", "end", "lookup", "retrieve", "end", "store", "end",
                                          "clear"]
    assert everything[-1].medium == "CPU"
    ends = [r for r in everything if r.op == "end"]
    recs = [r for r in everything if r.op not in ("end", "clear")]
    assert [e.ticket for e in ends] == [recs[1].ticket, recs[3].ticket, recs[4].ticket]  # shared memory: leases
    assert len({e.ticket for e in ends}) == 3 and all(e.ok for e in ends)
    assert [r.tokens for r in recs] == [3 * CHUNK] * 4 + [4 * CHUNK + 3]
    assert [r.hits for r in recs[:4]] == [[0, 0], [], [3, 0], [3, 0]]
    assert recs[1].stored == 3 and recs[1].bytes == 3 * CHUNK_BYTES
    assert recs[4].stored == 1 and recs[4].priority == 2 and recs[4].session == "s:agent-1"
    assert len({r.session for r in recs[:4]}) == 1 and recs[0].session.startswith("c:")
    assert all(r.bytes_per_token == LAYOUT.bytes_per_token for r in recs)
    assert len(recs[4].chunks) == 4 and recs[4].chunks[:3] == recs[0].chunks  # the shared prefix, the same digests
    assert recs[4].token_ids == longer and recs[0].token_ids == first


def test_the_trace_stops_at_its_size_bound(tmp_path):
    path = tmp_path / "small.trace"
    bound = 6000
    with ServerProc(tmp_path, config={"server": {"trace_file": str(path), "trace_max_bytes": bound}}) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        for i in range(60):
            client.lookup(prompt(1000 * i, 2))
        dropped = wait_for(lambda: metric_value(server.metrics_text(), "kvtier_trace_records_dropped_total",
                                                reason="size_limit"), what="records dropped at the size limit")
        written = metric_value(server.metrics_text(), "kvtier_trace_records_total")
        assert server.stop() == 0
    assert path.stat().st_size <= bound
    _, records = read_trace(path)  # whole lines only: a valid trace
    recs = [r for _, r in records]
    assert len(recs) == written and 0 < len(recs) < 60 and dropped + written == 60
    assert all(r.op == "lookup" for r in recs)


@pytest.mark.parametrize("policy", ["LRU", "S3FIFO"])
def test_simulating_the_trace_at_the_servers_size_gives_its_hit_rate(tmp_path, policy):
    path = tmp_path / "cycle.trace"
    prompts = [prompt(10_000 * i, 2) for i in range(6)]  # 12 chunks through an L1 of 8
    hit = looked = 0
    with ServerProc(tmp_path, l1=f"{8 * CHUNK_BYTES}B", extra=("--trace-file", str(path), "--eviction-policy", policy)) \
            as server, Client(server.url, model="m", layout=LAYOUT) as client:
        for round_ in range(4):
            for i, tokens in enumerate(prompts[: 3 + round_]):  # a growing working set: hits, then evictions
                hit += client.lookup_tiers(tokens).num_l1_tokens
                looked += len(tokens)
                client.retrieve(tokens)
                client.store(tokens, kv_for(tokens, i))
        assert server.stop() == 0
    sim = simulate(path, [SimConfig(8 * CHUNK_BYTES, policy)])
    assert sim.header.eviction_policy == policy
    assert sim.traced.hit_rate == pytest.approx(hit / looked)  # the trace holds what the server answered
    assert sim.results[0][1].hit_rate == pytest.approx(hit / looked)  # and the replay reproduces it
    assert 0 < hit < looked
