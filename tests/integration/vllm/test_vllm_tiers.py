"""The vLLM connector's contract with vLLM 0.32, against a real OpenAI server (SmolLM2, fp32) and kvtier server:

* per-tier hit reporting: vLLM's ``vllm:prompt_tokens_cached_by_source`` (host, disk) equals kvtier's
  ``kvtier_lookup_hit_tokens_total`` (CPU = L1, STORAGE = L2) exactly over a scripted run of 20 requests;
* per-request controls through ``kv_transfer_params``; an unknown kvtier key is refused by name; a retention hint
  reaches the server's L1, and a hinted request that adds no whole chunk still renews it;
* ``reset_prefix_cache`` with the connector keeps kvtier's data, and says so.

vLLM's own prefix cache is off, so every cached token reported by vLLM came from kvtier. Prompts of 700 tokens
hold two whole 256-token chunks: a hit loads 512 tokens (whole 128-token blocks before the last prompt token).
"""

from __future__ import annotations

import httpx
import pytest
from support.server import wait_for
from kvtier_harness.metrics import metric_sum
from kvtier_harness.vllm import ServerProcessForVLLM, OpenAIServer, document_tokens, model_dir
from test_vllm_support import assert_same_reply, cached_tokens

pytestmark = pytest.mark.model
TOKEN = "vllm-tiers-admin"


@pytest.fixture(scope="module")
def ids():
    return document_tokens(model_dir())


@pytest.fixture(scope="module")
def kvtier(tmp_path_factory):
    work = tmp_path_factory.mktemp("tiers")
    srv = ServerProcessForVLLM(work, chunk_size=256, l2={"type": "local_disk", "path": str(work / "l2")}, token=TOKEN)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def vllm(kvtier, tmp_path_factory):
    srv = OpenAIServer(tmp_path_factory.mktemp("tiers-vllm"), {"kvtier.server_url": kvtier.url,
                                                                "kvtier.timeout_seconds": 5})
    yield srv
    srv.stop()


def by_source(vllm) -> dict[str, int]:
    text = vllm.metrics_text()
    return {s: int(metric_sum(text, "vllm:prompt_tokens_cached_by_source_total", source=s))
            for s in ("host", "disk", "external_unspecified")}


def by_medium(kvtier) -> dict[str, int]:
    text = kvtier.metrics_text()
    return {m: int(metric_sum(text, "kvtier_lookup_hit_tokens_total", medium=m)) for m in ("CPU", "STORAGE")}


def test_per_tier_hits_agree_with_kvtier_over_20_requests(vllm, kvtier, ids):
    prompts = [ids[i * 700:(i + 1) * 700] for i in range(7)]
    replies: dict[int, list] = {i: [] for i in range(7)}

    def run(indices):
        for i in indices:
            replies[i].append(vllm.complete(prompts[i]))

    before = metric_sum(kvtier.metrics_text(), "kvtier_prefetch_requests_total")
    prefetches = lambda: metric_sum(kvtier.metrics_text(), "kvtier_prefetch_requests_total") - before  # noqa: E731
    run(range(5))  # 5 misses: stored in L1, written through to L2
    run(range(5))  # 5 L1 hits
    wait_for(lambda: metric_sum(kvtier.metrics_text(), "kvtier_l2_writes_total") >= 10, 60, "10 chunks in L2")
    assert prefetches() == 0, "a lookup that finds nothing in L2 alone sends no prefetch"
    kvtier.clear_l1()
    run(range(5))  # 5 L2 hits (promoted into L1 by the scheduler's prefetch and the load)
    assert prefetches() == 5, "each lookup that found chunks only in L2 sent one prefetch"
    run([0, 1, 2, 5, 6])  # 3 L1 hits (promoted) and 2 misses
    assert prefetches() == 5
    want = {"host": 8 * 512, "disk": 5 * 512, "external_unspecified": 0}
    # vLLM's Prometheus counters follow the responses by a logging step: wait until every hit is counted
    wait_for(lambda: sum(by_source(vllm).values()) >= sum(want.values()), 30, "vLLM's hit counters")
    got_vllm, got_kvtier = by_source(vllm), by_medium(kvtier)
    print(f"\nper-tier hits over 20 requests: vLLM {got_vllm}, kvtier {got_kvtier}")
    assert got_vllm == want
    assert (got_kvtier["CPU"], got_kvtier["STORAGE"]) == (got_vllm["host"], got_vllm["disk"])
    for i, answers in replies.items():
        for n, reply in enumerate(answers[1:], 1):
            assert_same_reply(reply, answers[0], f"prompt {i} request {n}")
    assert [cached_tokens(r) for r in replies[0]] == [0, 512, 512, 512]


def test_per_request_controls(vllm, ids):
    base = ids[4900:5600]
    cold = vllm.complete(base, {"kvtier.skip_store": True})
    assert cached_tokens(vllm.complete(base)) == 0, "skip_store: nothing was stored"
    assert cached_tokens(vllm.complete(base, {"max_load_tokens": 0})) == 0, "max_load_tokens 0: no load"
    assert cached_tokens(vllm.complete(base, {"kvtier.skip_load": True})) == 0
    limited = vllm.complete(base, {"max_load_tokens": 300})
    assert cached_tokens(limited) == 256  # whole 128-token blocks within the first 300 tokens
    assert_same_reply(limited, cold, "max_load_tokens 300")
    other = ids[5600:6300]
    vllm.complete(other, {"max_offload_tokens": 256})  # stores the first chunk only
    assert cached_tokens(vllm.complete(other, {"kvtier.skip_store": True})) == 256
    bad = vllm.complete(ids[6300:7000], {"kvtier.skip_stor": True})
    assert cached_tokens(bad) == 0
    assert "unknown kvtier key 'kvtier.skip_stor' in kv_transfer_params; did you mean 'kvtier.skip_store'" in vllm.log()
    assert cached_tokens(vllm.complete(ids[6300:7000])) == 0, "a refused request is neither loaded nor stored"


def test_reset_prefix_cache_keeps_kvtier_data(vllm, ids):
    prompt = ids[7000:7658]
    first = vllm.complete(prompt)
    assert cached_tokens(vllm.complete(prompt)) == 512
    resp = httpx.post(vllm.base + "/reset_prefix_cache", params={"reset_external": "true"}, timeout=60)
    resp.raise_for_status()
    assert resp.json().get("success") is True  # the connector answers None: vLLM's reset succeeds, kvtier keeps its data
    assert "kvtier keeps its data" in vllm.log()
    again = vllm.complete(prompt)
    assert cached_tokens(again) == 512
    assert_same_reply(again, first, "after reset_prefix_cache")


def store_counts(kvtier) -> tuple[int, int]:
    """(store requests the server answered, chunks it stored) from its /metrics."""
    text = kvtier.metrics_text()
    return int(metric_sum(text, "kvtier_store_seconds_count")), int(metric_sum(text, "kvtier_store_chunks_total"))


def test_identical_request_stores_nothing_new(vllm, kvtier, ids):
    prompt = ids[350:1050]  # starts mid-way into prompt 0: chunks no other test stored
    before = store_counts(kvtier)
    first = vllm.complete(prompt)
    after_first = store_counts(kvtier)
    assert after_first[1] - before[1] == 2, "the first request stores its two whole chunks"
    again = vllm.complete(prompt)
    assert cached_tokens(again) == 512
    assert store_counts(kvtier) == after_first, "the chunks the lookup found are never offered for saving"
    assert_same_reply(again, first, "identical request")


def sessions(kvtier) -> dict[str, int]:
    """session_id -> chunks L1 holds under its hints (the management API)."""
    rows = httpx.get(f"{kvtier.admin}/cache/sessions", timeout=10,
                     headers={"Authorization": f"Bearer {TOKEN}"}).json()["sessions"]
    return {row["session_id"]: row["num_chunks"] for row in rows}


def test_retention_hint_reaches_kvtier_and_a_turn_adding_no_chunk_renews_it(vllm, kvtier, ids):
    """``kvtier.*`` hints in ``kv_transfer_params`` go with the store; a later turn that adds less than a chunk
    (kvtier holds all its whole chunks: nothing new to store) still puts them under its own hint (here: its
    session), where before it left the first turn's hint to run out."""
    first = ids[1050:1650]  # 600 tokens, 2 whole chunks; no other test's prompt starts at 1050
    vllm.complete(first, {"kvtier.session_id": "agent-a", "kvtier.priority": 1, "kvtier.ttl_seconds": 600})
    assert sessions(kvtier).get("agent-a") == 2
    stored = store_counts(kvtier)[1]
    turn = vllm.complete(ids[1050:1750], {"kvtier.session_id": "agent-b", "kvtier.priority": 1,
                                          "kvtier.ttl_seconds": 600})
    assert cached_tokens(turn) == 512
    assert store_counts(kvtier)[1] == stored, "the renewal stored no chunk"
    got = sessions(kvtier)
    assert got.get("agent-b") == 2 and "agent-a" not in got, got
