"""Two nodes on one machine under NVIDIA Dynamo with real vLLM (``examples/dynamo/two_nodes.sh``; minutes).

Node A and node B are each a ``kvtier server`` with its own ``dynamo.vllm`` worker (``KVTierConnector`` with the
server feed); one ``dynamo.frontend --router-mode kv``; both servers over one shared Redis L2. vLLM's own KV
cache holds 3,072 tokens, so a few prompts evict a context from it.

- A prompt computed on A and then evicted from A's vLLM cache is still credited to A's host tier (kvtier's L1,
  announced in A's own event stream), so the frontend sends it to A, and A loads it from kvtier.
- A prompt nobody holds is credited to nobody (it goes by load).
- A prompt stored through A is found by B's server in the shared L2 when B is asked for it, and once B's L1
  holds it the router credits B's host tier too.

The router's view is read with ``dynamo.llm.KvRouter`` (tests/support/dynamo_router_probe.py); requests go through
the frontend, pinned to a worker with ``nvext.backend_instance_id`` where the scenario needs it.
"""

from __future__ import annotations

import random
import time

import pytest

from kvtier_harness.dynamo_deploy import VLLM_BLOCK_TOKENS as BLOCK
from kvtier_harness.dynamo_deploy import TwoNodes
from support.dynamo_procs import RouterProbe, require_dynamo
from support.server import wait_for

pytestmark = pytest.mark.model

KV_TOKENS = 3072  # vLLM's KV cache per worker
WAIT_SECONDS = 60.0  # for the kvtier servers' metrics


def prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(num_tokens)]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    work = tmp_path_factory.mktemp("two-nodes")
    require_dynamo()
    deployment = TwoNodes(work, shared_l2="redis://127.0.0.1:6379/0", engine_kv_tokens=KV_TOKENS, max_model_len=2048)
    probe = None
    try:
        probe = RouterProbe(deployment, BLOCK)
        yield deployment, probe
    finally:
        if probe is not None:
            probe.stop()
        deployment.stop()


def test_routing_follows_kvtier_and_the_shared_l2(nodes):
    deployment, probe = nodes
    a, b = deployment.worker["a"], deployment.worker["b"]
    rng = random.Random(time.time_ns())  # fresh prompts: the shared Redis may hold earlier runs' chunks
    context = prompt(rng, 1024)
    blocks = len(context) // BLOCK

    def step(node: str):
        return lambda: deployment.complete(prompt(rng, 8), node=node, max_tokens=1)

    # 1. computed on A, stored in A's kvtier; then three other prompts on A evict it from A's vLLM cache
    cold = deployment.complete(context, node="a")
    assert cold["served_by"] == "a"
    for _ in range(3):
        deployment.complete(prompt(rng, 1500), node="a", max_tokens=1)
    view = probe.until(context, lambda v: v["workers"][a]["host"] == blocks and v["workers"][a]["device"] < blocks,
                       "the context on A's host tier only", poke=step("a"))
    assert view["workers"][b] == {"device": 0, "host": 0, "disk": 0}, view
    assert view["best"]["worker"] == a
    # ... so the frontend's KV router sends it to A, which loads it from kvtier: same greedy output
    loaded_before = deployment.kvtier_metric("a", "kvtier_retrieve_chunks_total")
    again = deployment.complete(context)
    assert again["served_by"] == "a", again
    assert deployment.kvtier_metric("a", "kvtier_retrieve_chunks_total") > loaded_before
    assert again["choices"][0]["text"] == cold["choices"][0]["text"]

    # 2. a prompt nobody holds is credited to nobody: the router decides by load
    other = prompt(rng, 512)
    assert all(t == {"device": 0, "host": 0, "disk": 0} for t in probe.query(other)["workers"].values())
    assert deployment.complete(other)["served_by"] in ("a", "b")


def test_shared_l2_record_of_a_is_loaded_by_b_on_the_first_request(nodes):
    deployment, probe = nodes
    b = deployment.worker["b"]
    rng = random.Random(time.time_ns())
    blocks = 1024 // BLOCK

    def step(node: str):
        return lambda: deployment.complete(prompt(rng, 8), node=node, max_tokens=1)

    # shared L2: stored through A, found by B's server in Redis, then credited to B's host tier
    shared = prompt(rng, 1024)
    l2_writes = lambda: deployment.kvtier_metric("a", "kvtier_l2_writes_total", adapter="redis")  # noqa: E731
    written = l2_writes()
    deployment.complete(shared, node="a")
    wait_for(lambda: l2_writes() >= written + 4, WAIT_SECONDS, "A's server writing the context's 4 chunks to the shared L2")
    assert probe.query(shared)["workers"][b]["host"] == 0
    hits_before = deployment.kvtier_metric("b", "kvtier_l2_promoted_chunks_total")
    on_b = deployment.complete(shared, node="b")
    assert on_b["served_by"] == "b"
    assert deployment.kvtier_metric("b", "kvtier_l2_promoted_chunks_total") > hits_before
    assert on_b["choices"][0]["text"] == deployment.complete(shared, node="a")["choices"][0]["text"]
    probe.until(shared, lambda v: v["workers"][b]["host"] == blocks, "the shared context on B's host tier",
                poke=step("b"))
