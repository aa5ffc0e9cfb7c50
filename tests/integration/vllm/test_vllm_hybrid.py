"""A hybrid model in vLLM with kvtier: Gemma-3-270M (sliding-window and full-attention layers, several KV cache
groups under vLLM's hybrid KV cache manager), fp32, through a kvtier server.

One module-wide scenario, each step a fresh vLLM process (``examples/vllm/offline.py``; the fresh load with
``vllm serve``'s engine core and worker processes, the other steps in one process, ``one_process``):
  * vLLM alone computes the prompts (the reference);
  * vLLM + kvtier computes them once (stores): each group's part as its own chunks, the sliding-window part only
    the chunks of its window; the requests carry a retention hint (``kv_transfer_params``), which every part's
    chunks get;
  * a fresh vLLM + kvtier loads them: same greedy tokens and top-3 log-probabilities (1e-4) as vLLM alone;
  * the kvtier server restarted over the same L2 with every L2 read failing: the load fails, vLLM recomputes the
    request (failed receive), same output again.
"""

from __future__ import annotations

import time

import httpx
import pytest
from test_vllm_support import assert_same_output, by_prompt

from kvtier_harness.metrics import metric_sum
from kvtier_harness.vllm import ServerProcessForVLLM, document_tokens, gemma3_dir, run_vllm

pytestmark = pytest.mark.model
CHUNK = 256
BLOCK = 128  # vLLM CPU's block size for every Gemma-3 group
WINDOW = 512  # Gemma-3's sliding window
PROMPT_TOKENS = (1200, 1100)
TOKEN = "hybrid-admin-token"
HINT = {"kvtier.session_id": "hybrid-agent", "kvtier.priority": 2, "kvtier.ttl_seconds": 600}


def _expected_chunks(num_tokens: int) -> tuple[int, int]:
    """(full-attention chunks, sliding-window chunks) kvtier stores for a prompt of ``num_tokens`` tokens: every
    whole chunk, and the chunks holding the window a load of this prompt needs (vLLM's skipped tokens before it)."""
    last = num_tokens // CHUNK * CHUNK
    load_end = min(last, (num_tokens - 1) // BLOCK * BLOCK)
    first = (load_end - WINDOW + 1) // BLOCK * BLOCK // CHUNK * CHUNK
    return last // CHUNK, (last - first) // CHUNK


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    work = tmp_path_factory.mktemp("hybrid")
    model = gemma3_dir()
    ids = document_tokens(model)
    prompts = [ids[:PROMPT_TOKENS[0]], ids[2000:2000 + PROMPT_TOKENS[1]]]
    disk = {"type": "local_disk", "path": str(work / "l2")}
    out = {"prompts": prompts, "reference": run_vllm(work, "alone", prompts, model=model, one_process=True)}
    server = ServerProcessForVLLM(work, chunk_size=CHUNK, l2=disk, block_size=BLOCK, token=TOKEN)
    try:
        kvtier = {"kvtier.server_url": server.url, "kvtier.timeout_seconds": 5}
        out["cold"] = run_vllm(work, "cold", prompts, kvtier=kvtier, model=model, one_process=True,
                               kv_transfer_params=HINT)
        out["stored"] = metric_sum(server.metrics_text(), "kvtier_store_chunks_total")
        out["sessions"] = httpx.get(f"{server.admin}/cache/sessions", timeout=10,
                                    headers={"Authorization": f"Bearer {TOKEN}"}).json()["sessions"]
        out["fresh"] = run_vllm(work, "fresh", prompts, kvtier=kvtier, model=model)
        out["stored_after_fresh"] = metric_sum(server.metrics_text(), "kvtier_store_chunks_total")
        port, admin_port = server.port, server.admin_port
        server.stop()
        server = ServerProcessForVLLM(work, chunk_size=CHUNK, block_size=BLOCK, port=port, admin_port=admin_port,
                              l2={"type": "faulty", "inner": disk, "ops": ["get"], "error_rate": 1.0})
        time.sleep(1.0)
        out["failed"] = run_vllm(work, "failed", prompts[:1], kvtier=kvtier, model=model, one_process=True)
    finally:
        server.stop()
    return out


def test_fresh_process_loads_every_group_with_identical_output(scenario):
    fresh, reference, cold = by_prompt(scenario["fresh"]), by_prompt(scenario["reference"]), by_prompt(scenario["cold"])
    log = scenario["fresh"]["log"]
    assert "parts=full_attention groups [5]; sliding_window/512 groups [0, 1, 2, 3, 4]" in log
    for i, prompt in enumerate(scenario["prompts"]):
        assert_same_output(cold[i], reference[i], f"prompt {i}, kvtier storing")
        assert_same_output(fresh[i], reference[i], f"prompt {i}, loaded from kvtier in a fresh process")
        loaded = len(prompt) // CHUNK * CHUNK
        assert fresh[i]["num_cached_tokens"] == loaded, fresh[i]
        assert f"kvtier has every part up to {loaded}" in log


def test_sliding_window_part_stores_only_its_window(scenario):
    full, sliding = zip(*(_expected_chunks(len(p)) for p in scenario["prompts"]))
    assert sum(sliding) < sum(full)  # the window is shorter than the prompts: fewer chunks than full attention
    assert scenario["stored"] == sum(full) + sum(sliding)
    assert scenario["stored_after_fresh"] == scenario["stored"]  # the fresh process loaded and stored nothing new


def test_retention_hint_reaches_every_part(scenario):
    """The requests' ``kvtier.*`` hint is passed by the hybrid save path: every stored chunk, of the full-attention
    and the sliding-window parts alike, is in the hinted session."""
    rows = scenario["sessions"]
    assert [(r["session_id"], r["num_chunks"]) for r in rows] == [("hybrid-agent", scenario["stored"])], rows


def test_failed_load_is_recomputed_with_identical_output(scenario):
    failed, reference = by_prompt(scenario["failed"]), by_prompt(scenario["reference"])
    log = scenario["failed"]["log"]
    # once: the recomputed request is not offered the failing load again
    assert log.count("the load from kvtier failed (not available); vLLM recomputes the request") == 1
    assert failed[0]["num_cached_tokens"] == 0
    assert_same_output(failed[0], reference[0], "load failed, recomputed")


def test_in_process_cache_shares_one_l2_between_parts(scenario, tmp_path):
    """No server: each vLLM process keeps the parts' caches in process over one L1 and one local-disk L2."""
    model, prompt = gemma3_dir(), scenario["prompts"][1]
    kvtier = {"kvtier.local_disk": str(tmp_path / "l2")}
    run_vllm(tmp_path, "in-process-cold", [prompt], kvtier=kvtier, model=model, one_process=True)
    fresh = by_prompt(run_vllm(tmp_path, "in-process-fresh", [prompt], kvtier=kvtier, model=model, one_process=True))[0]
    assert fresh["num_cached_tokens"] == len(prompt) // CHUNK * CHUNK
    assert_same_output(fresh, by_prompt(scenario["reference"])[1], "loaded in process in a fresh process")
