"""A vLLM worker started after its kvtier server announces the server's chunks before its first request (real
vLLM; a minute).

The server already holds a prompt's chunks when ``vllm serve`` starts with ``KVTierConnector`` and the server feed
(``kvtier.server_events`` with replay). The connector finds vLLM's own KV event publisher when the scheduler binds
it (``bind_kv_cache_manager``; the lookup ``server_feed._scheduler_publisher`` relies on vLLM internals, so this
test fails if an installed vLLM breaks it) and publishes the server's blocks in the engine's stream while the
engine is idle: a subscriber of that stream (what ``dynamo.vllm`` relays to Dynamo's router) sees them although
no request was ever sent.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from support.dynamo_procs import start_kvtier_server
from support.server import LAYOUT

from kvtier_harness.vllm import OpenAIServer, require_vllm
from kvtier.client import Client
from kvtier.events.subscriber import Subscriber

pytestmark = pytest.mark.model
BLOCK, CHUNK = 128, 256  # vLLM CPU's block size; the server's chunk
WAIT_S = 120.0


def held_by_server(events: str, replay: str, secret_file: str, count: int) -> set[int]:
    """The block hashes the server announced as stored in L1 (``CPU``), read from its stream from seq 0."""
    sub = Subscriber(events, replay, start_seq=0, secret_file=secret_file)
    held: set[int] = set()
    deadline = time.monotonic() + WAIT_S
    try:
        while len(held) < count and time.monotonic() < deadline:
            got = sub.recv(timeout_seconds=0.5)
            if got is not None:
                held |= {h for ev in got[1].events if type(ev).__name__ == "BlockStored" and ev.medium == "CPU"
                         for h in ev.block_hashes}
    finally:
        sub.close()
    assert len(held) == count, f"the server announced {len(held)} of {count} blocks"
    return held


def test_a_late_worker_announces_the_servers_chunks_before_its_first_request(tmp_path):
    require_vllm()
    proc, addr = start_kvtier_server(tmp_path, CHUNK, BLOCK, replay=True)
    engine_events = f"ipc://{tmp_path}/engine-kv-events"
    watcher = Subscriber(engine_events)  # joins the engine's stream as soon as vLLM binds it
    vllm = None
    try:
        tokens = list(range(1000, 1000 + 2 * CHUNK))
        kv = np.random.default_rng(0).random(LAYOUT.chunk_shape(len(tokens)), dtype=np.float32)
        with Client(addr["url"], model="m", layout=LAYOUT) as client:
            assert client.store(tokens, kv) == 2
        held = held_by_server(addr["events"], addr["replay"], addr["secret_file"], len(tokens) // BLOCK)

        extra = {"kvtier.server_url": addr["url"], "kvtier.server_events": addr["events"],
                 "kvtier.server_events_replay": addr["replay"]}
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": engine_events}
        vllm = OpenAIServer(tmp_path, extra, prefix_caching=True, args=("--kv-events-config", json.dumps(kv_events)))
        announced: set[int] = set()
        deadline = time.monotonic() + WAIT_S
        while not held <= announced and time.monotonic() < deadline:
            got = watcher.recv(timeout_seconds=0.5)
            if got is not None:
                announced |= {h for ev in got[1].events if type(ev).__name__ == "BlockStored" and ev.medium == "CPU"
                              for h in ev.block_hashes}
        assert held <= announced, f"the idle engine announced {len(announced & held)} of the server's {len(held)} blocks"
        log = vllm.log()
        assert "publisher was not found" not in log
        assert _requests(vllm) == 0  # nothing ran: the announcement did not wait for a step
    finally:
        watcher.close()
        if vllm is not None:
            vllm.stop()
        proc.stop(grace_seconds=20)


def _requests(vllm: OpenAIServer) -> float:
    total = 0.0
    for line in vllm.metrics_text().splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total
