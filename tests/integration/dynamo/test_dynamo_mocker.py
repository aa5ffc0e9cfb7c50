"""kvtier's tiers steer NVIDIA Dynamo's KV router (Dynamo 1.6.1, no vLLM, no GPU; seconds).

A real deployment on 127.0.0.1: a ``kvtier server`` (L1 + local-disk L2, KV events per 16-token block), two
``dynamo.mocker`` workers (simulated engines with 16-token blocks), ``dynamo.frontend --router-mode kv`` and the
standalone ``dynamo.indexer``. Worker A publishes no engine events of its own; its event stream is the kvtier
server's, relayed by Dynamo's own ZMQ relay (what ``dynamo.vllm`` runs for vLLM's stream), so A announces what
kvtier holds. Worker B is a plain mocker with its own prefix cache and events.

Worker C runs the connector's server feed (``kvtier.connectors.server_feed``) as its only event source, as a
``dynamo.vllm`` worker with the kvtier connector does: started after the server, it announces what kvtier
already holds; after the engine's ``AllBlocksCleared`` it announces kvtier's chunks again.

The router is asked through ``dynamo.llm.KvRouter`` (``get_overlap_scores`` / ``best_worker``, the frontend's
router code), the indexer through its ``POST /query``, and the frontend through OpenAI requests whose answers
name the worker that served them. Nothing depends on hash values: Dynamo re-hashes the events' token ids.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from support.dynamo_procs import MODEL_NAME, Deployment, RouterProbe, start_kvtier_server

from kvtier.client import Client

BLOCK = 16  # the mocker's block size, and the kvtier server's block size
CHUNK = 256
PROMPT = [100 + (i * 7919) % 40_000 for i in range(2 * CHUNK)]  # two chunks of SmolLM2 token ids
OTHER = [100 + (i * 104_729) % 40_000 for i in range(2 * CHUNK)]  # nobody stores this one
LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    work = tmp_path_factory.mktemp("dynamo")
    dep = Deployment(work)
    server = probe = None
    try:
        server, addresses = start_kvtier_server(work, CHUNK, BLOCK)
        worker_a = dep.start_mocker("mocker-a", BLOCK, "--no-enable-prefix-caching")  # events: kvtier's only
        worker_b = dep.start_mocker("mocker-b", BLOCK)
        plain = dep.start_kvtier_relay(addresses)  # Dynamo's subscribers speak plain ZMQ: kvtier's relay over ipc
        dep.start_relay(worker_a, BLOCK, plain)
        frontend = dep.start_frontend()
        indexer = dep.start_indexer({worker_a: plain}, BLOCK)
        probe = RouterProbe(dep, BLOCK)
        yield {"a": str(worker_a), "b": str(worker_b), "frontend": frontend, "indexer": indexer, "probe": probe,
               **addresses}
    finally:
        if probe is not None:
            probe.stop()
        dep.stop()
        if server is not None:
            server.stop()


def indexer_view(deployment: dict, tokens: list[int]) -> dict:
    reply = httpx.post(f"{deployment['indexer']}/query", json={"token_ids": tokens, "model_name": MODEL_NAME},
                       timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["instances"]


def complete(deployment: dict, tokens: list[int]) -> dict:
    """An OpenAI completion through the frontend; returns the JSON answer (``nvext.worker_id`` names the worker)."""
    body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": 4, "nvext": {"extra_fields": ["worker_id"]}}
    reply = httpx.post(f"{deployment['frontend']}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def served_by(answer: dict) -> str:
    return str(answer["nvext"]["worker_id"]["decode_worker_id"])


def test_frontend_answers_and_nobody_is_credited_for_an_unknown_prompt(deployment):
    answer = complete(deployment, OTHER)
    assert answer["choices"][0]["text"], answer
    assert answer["usage"]["prompt_tokens"] == len(OTHER)
    assert served_by(answer) in (deployment["a"], deployment["b"])
    view = deployment["probe"].query(PROMPT)["workers"]
    assert set(view) == {deployment["a"], deployment["b"]}
    assert all(tiers == {"device": 0, "host": 0, "disk": 0} for tiers in view.values()), view


def test_router_credits_host_and_disk_of_the_worker_whose_kvtier_holds_the_prefix(deployment):
    a, b, n_blocks = deployment["a"], deployment["b"], len(PROMPT) // BLOCK
    with Client(deployment["url"], model=MODEL_NAME, layout=LAYOUT) as client:
        kv = np.random.default_rng(0).random((2, 2, len(PROMPT), 1, 8), dtype=np.float32)
        assert client.store(PROMPT, kv) == 2
        assert client.flush(30), "kvtier's L2 write did not finish"
    # L1 (CPU) and L2 (STORAGE) both hold both chunks: A is credited on its host and disk tiers, B on none
    answer = deployment["probe"].until(PROMPT, lambda r: r["workers"][a]["host"] == n_blocks
                                       and r["workers"][a]["disk"] == n_blocks,
                                       "kvtier's chunks on worker A's host and disk tiers")
    assert answer["workers"][a]["device"] == 0
    assert answer["workers"][b] == {"device": 0, "host": 0, "disk": 0}
    assert answer["best"]["worker"] == a and answer["best"]["overlap"] > 0
    view = indexer_view(deployment, PROMPT)
    assert view[a]["cpu"] == len(PROMPT) and view[a]["disk"] == len(PROMPT) and view[a]["gpu"] == 0, view
    # the frontend's own router agrees: the prompt goes to A
    assert served_by(complete(deployment, PROMPT)) == a


def test_after_clearing_l1_only_the_disk_tier_stays_credited(deployment):
    a, n_blocks = deployment["a"], len(PROMPT) // BLOCK
    before = deployment["probe"].query(PROMPT)["best"]
    reply = httpx.post(f"{deployment['admin']}/clear", json={"medium": "CPU"}, headers=deployment["admin_headers"],
                       timeout=10)
    assert reply.status_code == 200 and reply.json()["num_l1_chunks"] == 2, reply.text
    answer = deployment["probe"].until(PROMPT, lambda r: r["workers"][a]["host"] == 0,
                                       "the removal of worker A's host-tier blocks")
    assert answer["workers"][a]["disk"] == n_blocks, answer
    # a disk hit is worth less than a host hit, but A is still the only worker with any of the prefix
    assert answer["best"]["worker"] == a and 0 < answer["best"]["overlap"] < before["overlap"], (before, answer)
    view = indexer_view(deployment, PROMPT)
    assert view[a]["cpu"] == 0 and view[a]["disk"] == len(PROMPT), view
    assert served_by(complete(deployment, PROMPT)) == a


# ---------------------------------------------------------------------------------------------------------
# The connector's server feed (kvtier.connectors.server_feed) as one worker's only event source: worker C's
# stream is an engine-style publisher carrying its own GPU blocks and the feed's CPU/STORAGE blocks, relayed by
# Dynamo's relay exactly as dynamo.vllm relays vLLM's stream (which the connector's take_events() feeds).

FED = [100 + (i * 31_337) % 40_000 for i in range(2 * CHUNK)]  # stored in kvtier before the worker starts
LATER = [100 + (i * 65_537) % 40_000 for i in range(CHUNK)]  # stored after the engine's clear
ENGINE_ONLY = [100 + (i * 7_127) % 40_000 for i in range(4 * BLOCK)]  # in the engine's own (GPU) cache only
JOINED = [100 + (i * 3_571) % 40_000 for i in range(BLOCK)]  # an engine block that shows the relay is listening


class FedWorker:
    """An engine stream (kvtier's vLLM-compatible publisher) pumped with the feed's events, as vLLM's scheduler
    drains the connector's ``take_events()`` each step; ``step(events)`` adds engine events before them."""

    def __init__(self, feed):
        from kvtier.config import KVEventsConfig
        from kvtier.events import EventPublisher

        self.feed = feed
        self.publisher = EventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0", batch_max_delay_seconds=0))
        self._stop = False
        import threading

        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Start stepping (the engine's first step comes after its relay subscribed)."""
        self._thread.start()

    def step(self, engine_events=(), reset_connector=False) -> None:
        with self._lock:  # one engine step: its block pool's events, then the connector's
            if reset_connector:
                self.feed.reannounce()
            events = [*engine_events, *self.feed.take_events()]
            if events:
                self.publisher.publish(events)

    def _run(self) -> None:
        while not self._stop:
            self.step()
            time.sleep(0.05)

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(5)
        self.publisher.close()


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    from kvtier.connectors.server_feed import ServerFeed

    work = tmp_path_factory.mktemp("dynamo-feed")
    dep = Deployment(work)
    server = probe = feed = worker = None
    try:
        server, addresses = start_kvtier_server(work, CHUNK, BLOCK, replay=True)
        with Client(addresses["url"], model=MODEL_NAME, layout=LAYOUT) as client:
            kv = np.random.default_rng(1).random((2, 2, len(FED), 1, 8), dtype=np.float32)
            assert client.store(FED, kv) == 2 and client.flush(30)
        worker_c = dep.start_mocker("mocker-c", BLOCK, "--no-enable-prefix-caching")
        probe = RouterProbe(dep, BLOCK)  # before the worker's first event: the router learns live events only
        feed = ServerFeed(addresses["events"], addresses["replay"], BLOCK, secret_file=addresses["secret_file"])
        worker = FedWorker(feed)
        dep.start_relay(worker_c, BLOCK, worker.publisher.endpoint)
        from kvtier.events import BlockStored

        joined = BlockStored([7], None, JOINED, BLOCK, None, "GPU", None)
        probe.until(JOINED, lambda r: worker.publisher.publish([joined]) and r["workers"][str(worker_c)]["device"],
                    "worker C's relay subscribed")
        worker.start()
        yield {"c": str(worker_c), "probe": probe, "worker": worker, **addresses}
    finally:
        for thing in (worker, feed, probe):
            if thing is not None:
                (thing.close if hasattr(thing, "close") else thing.stop)()
        dep.stop()
        if server is not None:
            server.stop()


def test_a_worker_started_after_the_server_announces_what_it_already_holds(fed):
    c, n_blocks = fed["c"], len(FED) // BLOCK
    answer = fed["probe"].until(FED, lambda r: r["workers"][c]["host"] == n_blocks
                                and r["workers"][c]["disk"] == n_blocks,
                                "the replayed chunks on worker C's host and disk tiers")
    assert answer["workers"][c]["device"] == 0 and answer["best"]["worker"] == c


def test_after_the_engines_clear_the_worker_still_announces_kvtiers_chunks(fed):
    from kvtier.events import AllBlocksCleared, BlockStored

    c, probe, worker = fed["c"], fed["probe"], fed["worker"]
    gpu = BlockStored([10**6 + i for i in range(4)], None, ENGINE_ONLY, BLOCK, None, "GPU", None)
    worker.step([gpu])
    probe.until(ENGINE_ONLY, lambda r: r["workers"][c]["device"] == 4, "the engine's own GPU blocks")
    # vLLM's reset_prefix_cache with a connector reset: AllBlocksCleared, then the connector's re-announcement
    worker.step([AllBlocksCleared()], reset_connector=True)
    with Client(fed["url"], model=MODEL_NAME, layout=LAYOUT) as client:  # an event the router sees after both
        kv = np.random.default_rng(2).random((2, 2, len(LATER), 1, 8), dtype=np.float32)
        assert client.store(LATER, kv) == 1
    probe.until(LATER, lambda r: r["workers"][c]["host"] == len(LATER) // BLOCK, "a store after the clear")
    assert probe.query(ENGINE_ONLY)["workers"][c]["device"] == 0  # the clear reached the router ...
    assert probe.query(FED)["workers"][c]["host"] == len(FED) // BLOCK  # ... and kvtier's chunks came back
