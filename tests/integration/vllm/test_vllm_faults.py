"""Loads that fail fall back to recompute: a vLLM OpenAI server (SmolLM2, fp32) keeps answering exactly as without
kvtier when kvtier fails in the middle of a load, and no request waits past the load deadline.

Each test stores a 700-token prompt through a healthy kvtier server, then restarts the server on the same ports
over the same L2 folder wrapped in the fault-injecting adapter (``l2/faulty.py``), so the load must read L2:
* every L2 read fails: the load delivers nothing, vLLM recomputes those blocks;
* L2 reads are slow and the server is stopped (SIGSTOP) once the load's read has started: the deadline
  (``kvtier.load_timeout_seconds``) ends the wait;
* L2 reads are slow and the server is killed (SIGKILL) once the load's read has started.
The first answer of each prompt (computed before anything was stored) is the reference. Each test prints its
request time next to that of the reference request (figures for benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from support.server import wait_for
from kvtier_harness.metrics import metric_sum
from kvtier_harness.vllm import ServerProcessForVLLM, OpenAIServer, document_tokens, model_dir
from test_vllm_support import assert_same_reply, cached_tokens

pytestmark = pytest.mark.model
LOAD_TIMEOUT = 2.0  # kvtier.load_timeout_seconds


class Kvtier:
    """The kvtier server the vLLM server talks to, restartable on the same ports with another L2 spec."""

    def __init__(self, work):
        self.work, self.disk = work, {"type": "local_disk", "path": str(work / "l2")}
        self.srv = ServerProcessForVLLM(work, chunk_size=256, l2=self.disk)
        self.clients = 0  # the most connections of vLLM's clients seen on a server

    def peers(self) -> int:
        """TCP connections the server holds on its request port (vLLM's clients: one per vLLM process)."""
        return sum(1 for c in psutil.Process(self.srv.proc.pid).net_connections("tcp")
                   if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == self.srv.port)

    def restart(self, **faults) -> None:
        port, admin_port = self.srv.port, self.srv.admin_port
        if self.srv.proc.poll() is None:
            self.clients = max(self.clients, self.peers())
        self.srv.stop()
        l2 = {"type": "faulty", "inner": self.disk, "ops": ["get"], **faults} if faults else self.disk
        self.srv = ServerProcessForVLLM(self.work, chunk_size=256, l2=l2, port=port, admin_port=admin_port)
        # vLLM's clients reconnect on ZMQ's timer (RECONNECT_IVL_MAX 1 s), when their processes get the CPU; until
        # then their calls miss. Wait for their connections, then for the CurveZMQ handshake each starts on its own
        # (a ZAP reply delayed 50 ms)
        wait_for(lambda: self.peers() >= self.clients, 60, f"vLLM's {self.clients} client(s) to reconnect")
        time.sleep(1.0)

    def stored_in_l2(self, num_chunks: int) -> None:
        wait_for(lambda: metric_sum(self.srv.metrics_text(), "kvtier_l2_writes_total") >= num_chunks, 60,
                 f"{num_chunks} chunks written to L2")


@pytest.fixture(scope="module")
def kvtier(tmp_path_factory):
    kv = Kvtier(tmp_path_factory.mktemp("faults"))
    yield kv
    kv.srv.stop()


@pytest.fixture(scope="module")
def vllm(kvtier, tmp_path_factory):
    srv = OpenAIServer(tmp_path_factory.mktemp("faults-vllm"), {
        "kvtier.server_url": kvtier.srv.url, "kvtier.timeout_seconds": 2, "kvtier.load_timeout_seconds": LOAD_TIMEOUT})
    kvtier.clients = wait_for(kvtier.peers, 60, "vLLM's clients to connect")  # connected at start-up
    yield srv
    srv.stop()


def timed(vllm, prompt) -> tuple[dict, float]:
    started = time.monotonic()
    reply = vllm.complete(prompt)
    return reply, time.monotonic() - started


def stored_reference(vllm, kvtier, prompt) -> tuple[dict, float]:
    """A healthy server, the prompt computed once (the reference) and its two chunks written to L2."""
    kvtier.restart()
    reply, seconds = timed(vllm, prompt)
    kvtier.stored_in_l2(2)
    return reply, seconds


def during_load(vllm, kvtier, prompt, sig) -> tuple[dict, float]:
    """Send ``prompt`` while L2 reads take 3 s each; once the load's read has started (the scheduler's prefetch,
    which the worker's retrieve joins), send ``sig``."""
    kvtier.restart(latency_seconds=3)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(zip(("reply", "seconds"), timed(vllm, prompt))))
    thread.start()
    # not a fixed pause: a signal before the scheduler's lookup (a loaded machine) made that lookup the miss
    wait_for(lambda: sum(kvtier.srv.status()["promotions"].values()), 60, "the load's L2 read to start")
    os.kill(kvtier.srv.proc.pid, sig)
    thread.join(150)
    if sig == signal.SIGSTOP:
        os.kill(kvtier.srv.proc.pid, signal.SIGCONT)
    assert "reply" in out, "the request did not complete"
    return out["reply"], out["seconds"]


def report(label: str, seconds: float, reference_seconds: float) -> None:
    over = seconds > reference_seconds + LOAD_TIMEOUT + 1.0
    print(f"\n{label}: {seconds:.2f} s (reference, computed: {reference_seconds:.2f} s; deadline {LOAD_TIMEOUT} s; "
          f"over deadline + 1 s: {int(over)})")


def test_l2_read_error_recomputes(vllm, kvtier):
    prompt = document_tokens(model_dir())[:700]
    cold, cold_seconds = stored_reference(vllm, kvtier, prompt)
    assert cached_tokens(vllm.complete(prompt)) == 512  # the healthy path loads
    kvtier.restart(error_rate=1.0)  # a new server: L1 empty, every L2 read fails
    got, seconds = timed(vllm, prompt)
    assert_same_reply(got, cold, "L2 read error")
    assert "loaded 0 of 512 promised tokens (not available); vLLM recomputes the rest" in vllm.log()
    report("L2 read error", seconds, cold_seconds)


def test_server_stopped_past_the_deadline(vllm, kvtier):
    prompt = document_tokens(model_dir())[1000:1700]
    cold, cold_seconds = stored_reference(vllm, kvtier, prompt)
    got, seconds = during_load(vllm, kvtier, prompt, signal.SIGSTOP)
    assert_same_reply(got, cold, "server stopped during the load")
    assert f"past the {LOAD_TIMEOUT:g} s deadline" in vllm.log()
    report("server SIGSTOP mid-load", seconds, cold_seconds)


def test_server_killed_mid_load(vllm, kvtier):
    ids = document_tokens(model_dir())
    prompt = ids[2000:2700]
    cold, cold_seconds = stored_reference(vllm, kvtier, prompt)
    got, seconds = during_load(vllm, kvtier, prompt, signal.SIGKILL)
    assert_same_reply(got, cold, "server killed during the load")
    report("server SIGKILL mid-load", seconds, cold_seconds)
    after = vllm.complete(prompt)  # no server at all now: misses, same answer
    assert cached_tokens(after) == 0
    assert_same_reply(after, cold, "no server")
    assert vllm.complete(ids[3000:3300])["choices"][0]["finish_reason"] == "length"
    assert vllm.proc.poll() is None, "vLLM must keep serving without kvtier"
