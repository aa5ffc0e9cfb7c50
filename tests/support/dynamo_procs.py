"""NVIDIA Dynamo processes for tests, with no GPU, etcd or NATS: file discovery, TCP request plane, ZMQ event
plane, everything on 127.0.0.1 (shared reference dynamo.md §2).

Dynamo lives in its own environment (``.venv-dynamo``, made by ``scripts/setup-dynamo.sh``); each process here is
started from that python by ``service_proc.Proc`` (own session, stopped by pid: SIGTERM, then SIGKILL) and all of
one deployment share one discovery folder. ``require_dynamo()`` fails with what to run when it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvtier_harness import services
from kvtier_harness.kvtier_server import ServerProcess
from kvtier_harness.vllm import model_dir

REPO = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
HERE = Path(__file__).resolve().parent
PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
MODEL_NAME = "smollm2"


def require_dynamo() -> str:
    if not DYNAMO_PYTHON.exists():
        raise RuntimeError(f"{DYNAMO_PYTHON} is missing: run scripts/setup-dynamo.sh (NVIDIA Dynamo 1.6.1 environment)")
    return str(DYNAMO_PYTHON)


class Deployment:
    """One Dynamo deployment's shared settings: a discovery folder, a log folder and the environment."""

    def __init__(self, work: Path):
        require_dynamo()
        self.work = work
        self.discovery = work / "discovery"
        self.discovery.mkdir(parents=True, exist_ok=True)
        host = "127.0.0.1"
        self.env = {"DYN_FILE_KV": str(self.discovery), "DYN_EVENT_PLANE_HOST": host, "DYN_TCP_RPC_HOST": host,
                    "DYN_TCP_RESPONSE_STREAM_HOST": host, "DYN_SYSTEM_HOST": host, "DYN_HTTP_HOST": host,
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_COLOR": "1"}
        self.procs: list[services.Proc] = []

    def start(self, name: str, argv: list[str]) -> services.Proc:
        proc = services.Proc(name, [str(DYNAMO_PYTHON), *argv], self.work / f"{name}.log", env=self.env).start()
        self.procs.append(proc)
        return proc

    def worker_ids(self) -> set[int]:
        """Instance ids of the registered workers (their ``generate`` endpoints in the discovery folder)."""
        out = set()
        for path in (self.discovery / "v1" / "instances").glob("*"):
            if "%2Fgenerate%2F" in path.name:
                out.add(json.loads(path.read_text())["instance_id"])
        return out

    def start_mocker(self, name: str, block_size: int, *extra: str) -> int:
        """A ``dynamo.mocker`` worker (simulated engine: random tokens, real KV events); returns its worker id."""
        before = self.worker_ids()
        proc = self.start(name, ["-m", "dynamo.mocker", "--model-path", str(model_dir()), "--model-name",
                                 MODEL_NAME, *PLANES, "--block-size", str(block_size), "--num-gpu-blocks-override",
                                 "512", "--speedup-ratio", "10", *extra])
        proc.wait_ready(lambda: len(self.worker_ids() - before) == 1)
        return (self.worker_ids() - before).pop()

    def start_frontend(self) -> str:
        """``dynamo.frontend --router-mode kv``; returns its URL once it lists the model."""
        port = services.free_port()
        proc = self.start("frontend", ["-m", "dynamo.frontend", *PLANES, "--router-mode", "kv", "--http-host",
                                       "127.0.0.1", "--http-port", str(port)])
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(lambda: MODEL_NAME in httpx.get(f"{url}/v1/models", timeout=1).text)
        return url

    def start_indexer(self, workers: dict[int, str], block_size: int) -> str:
        """The standalone ``dynamo.indexer`` reading raw event streams (``workers``: worker id -> ZMQ endpoint)."""
        port = services.free_port()
        spec = ",".join(f"{wid}={endpoint}" for wid, endpoint in workers.items())
        proc = self.start("indexer", ["-m", "dynamo.indexer", "--workers", spec, "--block-size", str(block_size),
                                      "--model-name", MODEL_NAME, "--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(lambda: services.port_open(port))
        return url

    def start_kvtier_relay(self, addresses: dict) -> str:
        """``kvtier events relay`` of the kvtier server's authenticated event stream (``start_kvtier_server``'s
        addresses, with the subscriber key it made) to an ``ipc://`` socket of mode 0600, the supported way for a
        router that speaks plain ZMQ; returns that endpoint."""
        endpoint = f"ipc://{self.work}/kvtier-events.ipc"
        proc = services.Proc("kvtier-relay", [sys.executable, "-m", "kvtier", "events", "relay", "--endpoint",
                                              addresses["events"], "--auth-secret-file", addresses["subscriber_file"],
                                              "--to", endpoint], self.work / "kvtier-relay.log").start()
        self.procs.append(proc)
        proc.wait_ready(lambda: "relaying" in proc.log_tail())
        return endpoint

    def start_relay(self, worker_id: int, block_size: int, zmq_endpoint: str) -> None:
        """Dynamo's relay of ``zmq_endpoint`` (vLLM-format events) as ``worker_id``'s events (dynamo_event_relay.py)."""
        proc = self.start(f"relay-{worker_id}", [str(HERE / "dynamo_event_relay.py"), "--worker-id", str(worker_id),
                                                 "--block-size", str(block_size), "--zmq-endpoint", zmq_endpoint])
        proc.wait_ready(lambda: "ready" in proc.log_tail())

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout_seconds=20)


def start_kvtier_server(work: Path, chunk_size: int, block_size: int, *, replay: bool = False
                        ) -> tuple[ServerProcess, dict]:
    """A running ``kvtier server`` hashing per ``block_size`` tokens (the engines' block size) and publishing KV
    events for those blocks, with a local-disk L2.

    Returns the server and its addresses: ``url`` (requests), ``admin`` (HTTP), ``events`` (the PUB socket,
    CurveZMQ), ``admin_headers`` (the admin token, which ``POST /clear`` needs), ``secret_file`` (the server's
    secret), ``subscriber_file`` (a KV event subscriber's credential file, for ``Deployment.start_kvtier_relay``),
    and with ``replay`` ``replay`` (the replay socket).
    """
    events, replay_port = services.free_port(), services.free_port()
    token = "dynamo-test-admin-token"
    flags = ("--enable-kv-events", "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
             *(["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}"] if replay else []))
    server = ServerProcess(work, chunk_size, "0.1", block_size, l2={"type": "local_disk", "path": str(work / "kvtier-l2")},
                          token=token, extra=flags)
    addresses = {"url": server.url, "admin": server.admin, "events": f"tcp://127.0.0.1:{events}",
                 "admin_headers": {"Authorization": f"Bearer {token}"}}
    from kvtier.auth.secret_file import add_tenant, secret_file_for, subscriber_credentials, write_private

    addresses["secret_file"] = str(secret_file_for(addresses["url"])[0])
    addresses["subscriber_file"] = str(work / "router.cred")
    write_private(work / "router.cred", subscriber_credentials(add_tenant(addresses["secret_file"], "router",
                                                                           role="subscriber"), "router"))
    if replay:
        addresses["replay"] = f"tcp://127.0.0.1:{replay_port}"
    return server, addresses


class RouterProbe:
    """``dynamo_router_probe.py`` in the Dynamo environment: Dynamo's ``KvRouter`` answering per query.

    ``query(tokens)`` returns ``{"workers": {id: {"device", "host", "disk"}}, "best": {"worker", "overlap"}}``
    (worker ids as strings; block counts cumulative over faster tiers, see the probe's docstring).
    """

    def __init__(self, deployment: Deployment, block_size: int):
        self.log_path = deployment.work / "router-probe.log"
        with open(self.log_path, "w") as log:
            self.popen = subprocess.Popen([str(DYNAMO_PYTHON), str(HERE / "dynamo_router_probe.py"), "--block-size",
                                           str(block_size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=log, text=True, env={**os.environ, **deployment.env},
                                          start_new_session=True)
        if self.popen.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError(f"the router probe did not start:\n{self.log_path.read_text()[-3000:]}")

    def query(self, tokens: list[int]) -> dict:
        self.popen.stdin.write(json.dumps({"tokens": tokens}) + "\n")
        self.popen.stdin.flush()
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"the router probe exited:\n{self.log_path.read_text()[-3000:]}")
        return json.loads(line)

    def until(self, tokens: list[int], done, what: str, poke=None, wait_seconds: float = 60.0) -> dict:
        """``query(tokens)`` until ``done(view)``, calling ``poke()`` between tries (an engine step publishes the
        events vLLM queued); returns that view. Raises AssertionError with the last view after ``wait_seconds``."""
        deadline = time.monotonic() + wait_seconds
        while True:
            view = self.query(tokens)
            if done(view):
                return view
            if time.monotonic() > deadline:
                raise AssertionError(f"the router never saw {what} within {wait_seconds:.0f} s; last view: {view}")
            if poke is not None:
                poke()
            time.sleep(0.5)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.stdin.close()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
