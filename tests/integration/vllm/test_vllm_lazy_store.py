"""``connector.store_after_seen``: a chunk is stored only once that many prompts held it (vLLM 0.32 OpenAI
server, SmolLM2 fp32, vLLM's own prefix cache off, a real kvtier server). Prompts of 700 tokens hold two whole
256-token chunks; a hit loads 512 tokens."""

from __future__ import annotations

import pytest
from kvtier_harness.metrics import metric_sum
from kvtier_harness.vllm import ServerProcessForVLLM, OpenAIServer, document_tokens, model_dir
from test_vllm_support import assert_same_reply, cached_tokens

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def kvtier(tmp_path_factory):
    srv = ServerProcessForVLLM(tmp_path_factory.mktemp("lazy"), chunk_size=256)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def vllm(kvtier, tmp_path_factory):
    srv = OpenAIServer(tmp_path_factory.mktemp("lazy-vllm"), {"kvtier.server_url": kvtier.url,
                                                               "kvtier.store_after_seen": 2})
    yield srv
    srv.stop()


def stored_chunks(kvtier) -> int:
    return int(metric_sum(kvtier.metrics_text(), "kvtier_store_chunks_total"))


def test_chunks_are_stored_at_their_second_sighting(vllm, kvtier):
    ids = document_tokens(model_dir())
    prompt, other = ids[:700], ids[700:1400]
    first = vllm.complete(prompt)
    vllm.complete(other)
    assert stored_chunks(kvtier) == 0, "prompts seen once cost no store"
    second = vllm.complete(prompt)
    assert cached_tokens(second) == 0
    assert stored_chunks(kvtier) == 2, "the second sighting stores the prompt's two chunks"
    third = vllm.complete(prompt)
    assert cached_tokens(third) == 512
    assert_same_reply(third, first, "loaded after a lazy store")
    shared = ids[:256] + ids[1400:1844]  # shares the first chunk with `prompt` only
    vllm.complete(shared)
    assert stored_chunks(kvtier) == 2, "only the shared first chunk was seen twice, and kvtier already holds it"
