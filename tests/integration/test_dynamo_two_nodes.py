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

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.dynamo_procs import MODEL_NAME, RouterProbe, require_dynamo  # noqa: E402
from support.server import metric_value, wait_for  # noqa: E402

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[2]
BLOCK = 128  # vLLM CPU's block size
KV_TOKENS = 3072  # vLLM's KV cache per worker
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, fp32
WAIT_S = 60.0


def free_base(count: int = 14) -> int:
    """A port base with ``count`` consecutive free 127.0.0.1 ports (the script derives node B's as base + 10)."""
    import socket

    for _ in range(200):
        base = random.randrange(20000, 32000)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


class TwoNodes:
    """``examples/dynamo/two_nodes.sh`` running; stopped by SIGTERM to the script (it stops what it started)."""

    def __init__(self, work: Path, shared_l2: str):
        require_dynamo()
        base = free_base()
        self.work, self.http_port = work, base
        self.admin = {"a": f"http://127.0.0.1:{base + 2}", "b": f"http://127.0.0.1:{base + 12}"}
        env = {**os.environ, "LOG_DIR": str(work), "HTTP_PORT": str(base), "KV_PORT": str(base + 1),
               "KV_ADMIN_PORT": str(base + 2), "KV_EVENTS_PORT": str(base + 3), "KV_REPLAY_PORT": str(base + 4),
               "B_OFFSET": "10", "SHARED_L2": shared_l2, "L1_SIZE_GB": "0.5"}
        self.log = open(work / "two_nodes.log", "w")  # noqa: SIM115 - written until stop()
        argv = [str(REPO / "examples/dynamo/two_nodes.sh"), "--kv-cache-memory-bytes", str(KV_TOKENS * BYTES_PER_TOKEN),
                "--max-model-len", "2048"]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 900
        while "serving on" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = self.output()
                self.stop()
                raise RuntimeError(f"two_nodes.sh did not start:\n{out[-4000:]}")
            time.sleep(1)
        ids = dict(line.split("=", 1) for line in (work / "worker-ids").read_text().split())
        self.worker = {"a": ids["node-a"], "b": ids["node-b"]}
        self.env = {"DYN_FILE_KV": str(work / "discovery"), **{k: "127.0.0.1" for k in (
            "DYN_EVENT_PLANE_HOST", "DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST")}}

    def output(self) -> str:
        self.log.flush()
        return (self.work / "two_nodes.log").read_text()

    def complete(self, tokens: list[int], node: str | None = None, max_tokens: int = 8) -> dict:
        nvext = {"extra_fields": ["worker_id"]}
        if node is not None:
            nvext["backend_instance_id"] = int(self.worker[node])
        body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, "nvext": nvext}
        reply = httpx.post(f"http://127.0.0.1:{self.http_port}/v1/completions", json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        answer["served_by"] = {v: k for k, v in self.worker.items()}.get(
            str(answer["nvext"]["worker_id"]["decode_worker_id"]))
        return answer

    def kvtier_metric(self, node: str, name: str, **labels) -> float:
        return metric_value(httpx.get(f"{self.admin[node]}/metrics", timeout=10).text, name, **labels) or 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(num_tokens)]


def until(probe: RouterProbe, tokens: list[int], done, what: str, poke=None) -> dict:
    """Ask the router until ``done(view)``; ``poke()`` between tries (an engine step publishes queued events)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        view = probe.query(tokens)
        if done(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"the router never saw {what} within {WAIT_S:.0f} s; last view: {view}")
        if poke is not None:
            poke()
        time.sleep(0.5)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    work = tmp_path_factory.mktemp("two-nodes")
    deployment = TwoNodes(work, shared_l2="redis://127.0.0.1:6379/0")
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
        return lambda: deployment.complete(prompt(rng, 8), node, max_tokens=1)

    # 1. computed on A, stored in A's kvtier; then three other prompts on A evict it from A's vLLM cache
    cold = deployment.complete(context, "a")
    assert cold["served_by"] == "a"
    for _ in range(3):
        deployment.complete(prompt(rng, 1500), "a", max_tokens=1)
    view = until(probe, context, lambda v: v["workers"][a]["host"] == blocks and v["workers"][a]["device"] < blocks,
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

    # 3. shared L2: stored through A, found by B's server in Redis, then credited to B's host tier
    shared = prompt(rng, 1024)
    l2_writes = lambda: deployment.kvtier_metric("a", "kvtier_l2_writes_total", adapter="redis")  # noqa: E731
    written = l2_writes()
    deployment.complete(shared, "a")
    wait_for(lambda: l2_writes() >= written + 4, WAIT_S, "A's server writing the context's 4 chunks to the shared L2")
    assert probe.query(shared)["workers"][b]["host"] == 0
    hits_before = deployment.kvtier_metric("b", "kvtier_l2_promoted_chunks_total")
    on_b = deployment.complete(shared, "b")
    assert on_b["served_by"] == "b"
    assert deployment.kvtier_metric("b", "kvtier_l2_promoted_chunks_total") > hits_before
    assert on_b["choices"][0]["text"] == deployment.complete(shared, "a")["choices"][0]["text"]
    until(probe, shared, lambda v: v["workers"][b]["host"] == blocks, "the shared context on B's host tier",
          poke=step("b"))
