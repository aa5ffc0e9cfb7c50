"""``examples/dynamo/two_nodes.sh`` as a Python object: start it on free ports, talk to it, stop it.

Used by ``benchmarks/dynamo_routing.py`` and ``tests/integration/dynamo/test_dynamo_two_nodes.py`` (no test code here).
The script starts two kvtier servers, a ``dynamo.vllm`` worker per server and ``dynamo.frontend``; it stops them
itself (by pid) when it gets SIGTERM.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from kvtier_harness.metrics import scrape

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "smollm2"
VLLM_BLOCK_TOKENS = 128  # vLLM CPU's block size
SMOLLM2_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head size x fp32
PLANE_HOSTS = ("DYN_EVENT_PLANE_HOST", "DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST")


def free_port_base(count: int = 15) -> int:
    """A port ``base`` with ``base .. base + count - 1`` free on 127.0.0.1 (node B's ports are node A's + 10)."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - count)  # Dynamo 1.6.1 reads some ports as signed 16-bit numbers
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
    raise RuntimeError("no range of free ports found on 127.0.0.1")


class TwoNodes:
    """A running ``two_nodes.sh`` (node ``"a"`` and node ``"b"``).

    Args:
        work: the log folder (``LOG_DIR``; Dynamo's discovery folder is ``work/discovery``).
        shared_l2: a Redis URL both servers use as L2, or None.
        router_mode: the frontend's ``--router-mode`` (``kv``, ``round-robin``, ...).
        engine_kv_tokens: each vLLM's KV cache, in tokens (``--kv-cache-memory-bytes``); None: vLLM's default.
        l1_size_gb: each kvtier server's L1.
        start_timeout_seconds: how long the script may take to report it is serving.

    Raises RuntimeError (with the script's output) when the script fails or times out.
    """

    def __init__(self, work: Path, *, shared_l2: str | None = None, router_mode: str = "kv",
                 engine_kv_tokens: int | None = None, max_model_len: int = 4096, l1_size_gb: float = 0.5,
                 start_timeout_seconds: float = 900.0):
        base = free_port_base()
        self.work, self.http_port = work, base
        self.url = f"http://127.0.0.1:{base}"
        self.admin = {"a": f"http://127.0.0.1:{base + 2}", "b": f"http://127.0.0.1:{base + 12}"}
        env = dict(os.environ)
        env.update(LOG_DIR=str(work), HTTP_PORT=str(base), KV_PORT=str(base + 1), KV_ADMIN_PORT=str(base + 2),
                   KV_EVENTS_PORT=str(base + 3), KV_REPLAY_PORT=str(base + 4), B_OFFSET="10",
                   SHARED_L2=shared_l2 or "", ROUTER_MODE=router_mode, L1_SIZE_GB=str(l1_size_gb))
        argv = [str(REPO / "examples/dynamo/two_nodes.sh"), "--max-model-len", str(max_model_len)]
        if engine_kv_tokens:
            argv += ["--kv-cache-memory-bytes", str(engine_kv_tokens * SMOLLM2_BYTES_PER_TOKEN)]
        self.log_path = work / "two_nodes.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - the script writes to it until stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + start_timeout_seconds
        while "serving on" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = self.output()
                self.stop()
                raise RuntimeError(f"two_nodes.sh did not start (logs in {work}):\n{out[-4000:]}")
            time.sleep(1)
        ids = dict(line.split("=", 1) for line in (work / "worker-ids").read_text().split())
        self.worker = {"a": ids["node-a"], "b": ids["node-b"]}
        urls = dict(line.split("=", 1) for line in (work / "metrics-urls").read_text().split())
        self.metrics_url = {"a": urls["node-a"], "b": urls["node-b"]}
        self.env = {"DYN_FILE_KV": str(work / "discovery"), **{k: "127.0.0.1" for k in PLANE_HOSTS}}

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def node_of(self, answer: dict) -> str | None:
        """``"a"`` / ``"b"``: the node whose worker served ``answer`` (its ``nvext.worker_id``)."""
        wid = str(((answer.get("nvext") or {}).get("worker_id") or {}).get("decode_worker_id"))
        return {v: k for k, v in self.worker.items()}.get(wid)

    def body(self, prompt, *, node: str | None = None, max_tokens: int = 8, stream: bool = False) -> dict:
        """An OpenAI completion request; ``node`` pins it to that node's worker (``nvext.backend_instance_id``)."""
        nvext: dict = {"extra_fields": ["worker_id"]}
        if node is not None:
            nvext["backend_instance_id"] = int(self.worker[node])
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "nvext": nvext}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def complete(self, prompt, *, node: str | None = None, max_tokens: int = 8) -> dict:
        """A non-streamed completion; the answer gets ``served_by`` (``"a"`` / ``"b"``)."""
        reply = httpx.post(f"{self.url}/v1/completions", json=self.body(prompt, node=node, max_tokens=max_tokens),
                           timeout=600)
        if reply.status_code != 200:
            raise RuntimeError(f"completion failed: {reply.status_code} {reply.text}")
        answer = reply.json()
        answer["served_by"] = self.node_of(answer)
        return answer

    def kvtier_metric(self, node: str, name: str, **labels) -> float:
        """One sample of node ``node``'s kvtier server (0 when absent)."""
        return scrape(f"{self.admin[node]}/metrics").get((name, tuple(sorted(labels.items()))), 0.0)

    def stop(self) -> None:
        """SIGTERM the script (it stops everything it started); SIGKILL its process group after 90 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
