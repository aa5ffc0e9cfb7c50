"""Trust boundary of a real ``kvtier server`` (issue 9, §2 and §3): routing ids chosen by peers, clients
without the secret, a process squatting on the port, tenants. Real server subprocesses, real ZMQ."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch
import zmq
from support.server import CHUNK, LAYOUT, ServerProc, free_port, kvtier_cmd, metric_value, wait_for

from kvtier.auth.curve import apply_client
from kvtier.auth.secret_file import Credentials, default_secret_file, load_or_create, read_credentials
from kvtier.events.subscriber import Subscriber
from kvtier.client import Client
from kvtier.zmq_context import Context


ADMIN_TOKEN = "security-test-admin-token"


def kv_for(n: int, seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape(n), generator=torch.Generator().manual_seed(seed))


def libzmq_counter_starts(n: int = 8) -> list[int]:
    """The first ``n`` values libzmq's ``generate_random()`` gives in a process that never seeded libc rand()
    (two rand() calls each, ``high << 31 | low``): where a ROUTER's generated routing ids start."""
    out = subprocess.run([sys.executable, "-c", "import ctypes; libc = ctypes.CDLL(None); libc.srand(1); "
                          f"print(' '.join(str(libc.rand()) for _ in range({2 * n})))"],
                         capture_output=True, text=True, check=True).stdout.split()
    values = [int(v) for v in out]
    return [((values[2 * i + 1] << 31) | values[2 * i]) & 0xFFFFFFFF for i in range(n)]


class Attack:
    """Local peers of a ROUTER: DEALERs that choose ids libzmq generates itself (``\\x00`` + counter), then
    DEALERs with no id, which make libzmq generate one (the abort, on an unguarded ROUTER)."""

    def __init__(self):
        self.ctx = Context()
        self.socks: list[zmq.Socket] = []  # held open: a collected socket would close its connection

    def peer(self, url: str, routing_id: bytes | None, creds=None) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if creds is not None:
            apply_client(sock, creds)
        sock.connect(url)
        try:  # an empty frame: a malformed request / replay request, answered or ignored
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # the connection was already refused at its greeting: nothing left to send on
            pass
        self.socks.append(sock)

    def run(self, url: str, creds=None) -> None:
        for start in libzmq_counter_starts():
            for offset in range(2):
                self.peer(url, b"\x00" + ((start + offset) & 0xFFFFFFFF).to_bytes(4, "big"), creds)
        time.sleep(0.5)  # handshakes done (ZAP answers after 50 ms)
        for _ in range(3):
            self.peer(url, None, creds)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.ctx.destroy(linger=0)  # also when the test fails: a collected context with open sockets blocks


def events_config(events_auth: bool) -> dict:
    return {"enable_kv_events": True,
            "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
                          "batch_max_delay_seconds": 0.001, "auth": events_auth}}


def serves_a_real_client(server: ServerProc, config: dict, seed: int, secret_file=None) -> None:
    """A real client stores and retrieves through ``server``, and a real subscriber replays its events."""
    cfg = config["kv_events"]
    with Client(server.url, model="m", layout=LAYOUT, secret_file=secret_file) as client:
        tokens = list(range(seed * 1000, seed * 1000 + 2 * CHUNK))
        kv = kv_for(len(tokens), seed)
        assert client.store(tokens, kv) == 2
        out, n = client.retrieve(tokens)
        assert n == 2 * CHUNK and torch.equal(out, kv)
    with Subscriber(cfg["endpoint"], cfg["replay_endpoint"], start_seq=0, secret_file=secret_file) as sub:
        batches = list(sub.iter(timeout_seconds=3.0))
    assert batches and batches[0][0] == 0 and sub.stats.replayed >= 1  # seq 0 came from the replay port
    assert server.proc.poll() is None


def test_chosen_routing_ids_cannot_abort_an_authenticating_server(tmp_path):
    config = events_config(events_auth=True)
    with Attack() as attack, ServerProc(tmp_path, config=config) as server:
        secret = default_secret_file(server.port)
        creds = read_credentials(secret)
        # the server's public key is no secret: a peer may know it and still hold no accepted client key
        stranger = Credentials(secret, "ef" * 32, "stranger", creds.server_public_key().decode())
        for url in (server.url, config["kv_events"]["replay_endpoint"]):
            attack.run(url)  # no CurveZMQ at all: refused at the greeting
            attack.run(url, stranger)  # an unknown key: refused by the ZAP handler
            attack.run(url, creds)  # the secret itself: admitted, but the server picks every routing id
        time.sleep(1.0)
        assert server.proc.poll() is None, server.log()
        serves_a_real_client(server, config, seed=1, secret_file=secret)
        for socket in ("requests", "replay"):  # the stranger's handshakes end on the server's own time
            wait_for(lambda s=socket: (metric_value(server.metrics_text(), "kvtier_auth_refused_total", socket=s)
                                       or 0) >= 19, what=f"19 refused handshakes on the {socket} socket")
    assert "Assertion failed" not in server.log()


def test_chosen_routing_ids_cannot_abort_a_server_without_auth(tmp_path):
    config = events_config(events_auth=False)  # a replay port vLLM-compatible consumers can use
    with Attack() as attack, ServerProc(tmp_path, config=config, extra=("--no-auth",)) as server:
        wait_for(lambda: "authentication is OFF" in server.log(), what="the --no-auth warning")
        for url in (server.url, config["kv_events"]["replay_endpoint"]):
            attack.run(url)
        time.sleep(1.0)
        assert server.proc.poll() is None, server.log()
        serves_a_real_client(server, config, seed=2)


def test_a_client_without_the_secret_gets_misses_and_says_what_to_do(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="kvtier")
    tokens = list(range(7, 7 + CHUNK))
    with ServerProc(tmp_path) as server:
        secret = default_secret_file(server.port)
        elsewhere = tmp_path / "runtime"
        elsewhere.mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(elsewhere))  # another user's view: no secret file here
        wrong = tmp_path / "wrong.secret"
        wrong.write_text("secret: " + "ab" * 32 + "\n")
        wrong.chmod(0o600)
        unsafe = tmp_path / "unsafe.secret"
        unsafe.write_text(secret.read_text())
        unsafe.chmod(0o644)
        cases = [(None, f"requires authentication and this client has none: looked for secret file "
                        f"{elsewhere}/kvtier/server-{server.port}.secret"),
                 (tmp_path / "missing.secret", "missing.secret does not exist"),
                 (unsafe, "readable by other users (mode 0644); run: chmod 600"),
                 (wrong, "failed the CurveZMQ handshake")]
        for secret_file, message in cases:
            caplog.clear()
            with Client(server.url, model="m", layout=LAYOUT, secret_file=secret_file, timeout_seconds=2.0) as client:
                assert client.info is None
                assert client.lookup(tokens) == 0 and client.store(tokens, kv_for(CHUNK, 3)) == 0

                def told() -> bool:  # a refused handshake is seen when it ends, on the server's time: each call
                    assert client.lookup(tokens) == 0  # looks for it (and stays a miss)
                    return message in caplog.text

                wait_for(told, what=f"{message!r} in the log, for secret file {secret_file}")
        assert server.proc.poll() is None
        with Client(server.url, model="m", layout=LAYOUT, secret_file=secret) as client:
            assert client.store(tokens, kv_for(CHUNK, 3)) == 1


@pytest.mark.parametrize("squatter", ["plain", "curve"])
def test_a_process_squatting_on_the_port_learns_nothing(tmp_path, squatter, caplog):
    caplog.set_level(logging.ERROR, logger="kvtier")
    port = free_port()
    load_or_create(default_secret_file(port))  # a server ran on this port before, as this user
    ctx = Context()
    trap = ctx.socket(zmq.ROUTER)
    if squatter == "curve":  # a CurveZMQ server with a key of its own that accepts every client key
        trap.curve_server = True
        trap.curve_publickey, trap.curve_secretkey = zmq.curve_keypair()
    trap.bind(f"tcp://127.0.0.1:{port}")
    try:
        with Client(f"tcp://127.0.0.1:{port}", model="m", layout=LAYOUT, timeout_seconds=1.0) as client:
            tokens = list(range(123, 123 + 2 * CHUNK))
            assert client.lookup(tokens) == 0 and client.store(tokens, kv_for(2 * CHUNK, 4)) == 0
            assert client.retrieve(tokens)[1] == 0
            assert client.info is None and not client.uses_shared_memory  # no shared-memory name taken from it
        said = [f"tcp://127.0.0.1:{port} failed the CurveZMQ handshake"]
        if squatter == "plain":  # libzmq reports the mechanism mismatch or a generic protocol error, by timing
            said.append(f"tcp://127.0.0.1:{port} does not use authentication")
        assert any(s in caplog.text for s in said), caplog.text
        assert trap.poll(500) == 0  # not one message reached the squatter: no model, no token ids
    finally:
        ctx.destroy(linger=0)


def test_the_secret_file_is_private_and_an_unsafe_one_stops_the_server(tmp_path):
    with ServerProc(tmp_path) as server:
        path = default_secret_file(server.port)
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
        with Client(server.url, model="m", layout=LAYOUT) as client:
            assert client.info is not None and client.uses_shared_memory
            arena = f"/dev/shm/{client.info.shm_name}"
            assert os.stat(arena).st_mode & 0o777 == 0o600  # other users cannot map the shared L1
    unsafe = tmp_path / "unsafe.secret"
    unsafe.write_text("secret: " + "cd" * 32 + "\n")
    unsafe.chmod(0o640)
    with pytest.raises(RuntimeError, match="readable by other users"):
        ServerProc(tmp_path, extra=("--auth-secret-file", str(unsafe)))


def test_a_secret_made_for_an_os_picked_port_is_deleted_at_shutdown(tmp_path, monkeypatch):
    from kvtier.config import KVTierConfig
    from kvtier.server.server import KVTierServer

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    fixed = free_port()
    for port in (0, fixed):
        server = KVTierServer(KVTierConfig.model_validate(
            {"l1_size_gb": 0.001, "eviction_policy": "LRU", "server": {"port": port, "shared_memory": False}}))
        path = default_secret_file(server.port)
        assert path.parent == tmp_path / "kvtier" and path.exists()
        server.close()
        assert path.exists() == (port == fixed)  # a fixed port's secret stays: a restart keeps its clients' keys


def test_tenants_reach_only_their_own_chunks(tmp_path):
    secrets = tmp_path / "secrets.yaml"

    def add_tenant(name: str):
        out = tmp_path / f"{name}.yaml"
        done = subprocess.run(kvtier_cmd("auth", "tenant", name, "--secret-file", str(secrets), "--out", str(out)),
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert out.stat().st_mode & 0o777 == 0o600
        return out

    a_file = add_tenant("team-a")
    with ServerProc(tmp_path, extra=("--auth-secret-file", str(secrets)), token=ADMIN_TOKEN) as server:
        b_file = add_tenant("team-b")  # added while the server runs: picked up without a restart
        tokens = list(range(500, 500 + 2 * CHUNK))
        kv = kv_for(len(tokens), 5)
        with Client(server.url, model="m", layout=LAYOUT, secret_file=secrets) as owner, \
                Client(server.url, model="m", layout=LAYOUT, secret_file=a_file) as a, \
                Client(server.url, model="m", layout=LAYOUT, secret_file=b_file) as b:
            assert (owner.info.tenant, a.info.tenant, b.info.tenant) == (None, "team-a", "team-b")
            assert owner.uses_shared_memory and not a.uses_shared_memory and not b.uses_shared_memory
            assert a.store(tokens, kv) == 2
            out, n = a.retrieve(tokens)
            assert n == 2 * CHUNK and torch.equal(out, kv)
            for ns in (None, "", "tenant:team-a/", "tenant:team-a/tenant:team-a/"):
                assert b.lookup(tokens, namespace=ns) == 0 and b.retrieve(tokens, namespace=ns)[1] == 0
            assert owner.lookup(tokens) == 0  # the owner's "" is not team-a's ""
            assert owner.lookup(tokens, namespace="tenant:team-a/") == 2 * CHUNK  # full access
            other = list(range(900, 900 + CHUNK))
            assert owner.store(other, kv_for(CHUNK, 6)) == 1
            assert a.lookup(other) == 0 and b.lookup(other) == 0
            assert b.store(tokens, kv_for(len(tokens), 7)) == 2  # team-b's own copy, not team-a's bytes
            assert torch.equal(a.retrieve(tokens)[0], kv)
            # issue 22 finding 5: server-wide counters would show team-b when team-a hits; a tenant sees its own
            before = b.stats()
            assert before["tenant"] == "team-b" and not any(k.startswith("kvtier_") for k in before)
            assert a.retrieve(tokens)[1] == 2 * CHUNK
            assert b.stats() == before
            assert any(k.startswith("kvtier_") for k in owner.stats())  # the operator still sees everything
            seen = server.status()  # issue 22 finding 5: any local process reads /status, tenant names only the admin
            assert seen["auth"]["num_tenants"] == 2 and "tenants" not in seen["auth"]
            assert "team-a" not in str(seen) and "team-b" not in str(seen)
            assert sorted(c["tenant"] for c in seen["clients"] if c["tenant"]) == ["(hidden: send the admin token)"] * 2
            as_admin = server.status(ADMIN_TOKEN)
            assert sorted(c["tenant"] for c in as_admin["clients"] if c["tenant"]) == ["team-a", "team-b"]
        status = server.status(ADMIN_TOKEN)
        assert status["auth"]["tenants"] == ["team-a", "team-b"]
        assert read_credentials(secrets).secret not in str(status)


def test_flush_is_false_after_the_server_restarted(tmp_path):
    port = free_port()
    disk = {"type": "local_disk", "path": str(tmp_path / "disk")}
    # the first server's L2 write never ends (a 2 s one ended before the kill when this process was that slow)
    hung = {"type": "faulty", "inner": disk, "latency_seconds": 3600, "ops": ["put"]}
    server = ServerProc(tmp_path, port=port, config={"l2_adapters": [hung]})
    client = Client(server.url, model="m", layout=LAYOUT, retry_after_seconds=0.2)
    try:
        assert client.store(list(range(CHUNK)), kv_for(CHUNK, 8)) == 1  # acknowledged; L2 write still queued
        server.proc.kill()  # SIGKILL: the queued write is lost
        server.stop()
        server = ServerProc(tmp_path, port=port, config={"l2_adapters": [disk]})
        assert wait_for(client.ping, what="the client to reconnect")
        assert client.flush(30.0) is False  # the write acknowledged before the restart is not durable
        assert client.flush(30.0) is True  # reported once
        assert client.store(list(range(CHUNK, 2 * CHUNK)), kv_for(CHUNK, 9)) == 1
        assert client.flush(30.0) is True
    finally:
        client.close()
        server.stop()



def test_flush_is_false_when_an_acknowledged_write_did_not_reach_l2(tmp_path):
    """A store is acknowledged once L1 holds it; its L2 write can still be dropped (a full write queue) or fail
    (the adapter refuses it). Flush says so, to the client whose write it was, once."""
    failing = {"type": "faulty", "inner": {"type": "local_disk", "path": str(tmp_path / "bad")}, "error_rate": 1.0,
               "ops": ["put"]}
    with ServerProc(tmp_path, config={"l2_adapters": [failing]}) as server, \
            Client(server.url, model="m", layout=LAYOUT) as writer, Client(server.url, model="m", layout=LAYOUT) as idle:
        assert writer.store(list(range(2 * CHUNK)), kv_for(2 * CHUNK, 3)) == 2
        assert writer.flush(30.0) is False and idle.flush(30.0) is True  # only the writer's own losses count
        assert writer.flush(30.0) is True  # reported once
    disk = {"type": "local_disk", "path": str(tmp_path / "disk")}
    with ServerProc(tmp_path, config={"l2_adapters": [disk], "l2_write_queue_size": 4}) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        assert client.store(list(range(64 * CHUNK)), kv_for(64 * CHUNK, 4)) == 64  # 60 of its writes find no room
        assert client.flush(30.0) is False
        assert client.store(list(range(10**6, 10**6 + 2 * CHUNK)), kv_for(2 * CHUNK, 5)) == 2
        assert client.flush(30.0) is True


def test_a_restart_on_the_same_port_with_other_auth_settings_keeps_clients_working(tmp_path):
    """Issue 21: a client of a --no-auth server found the secret file a previous server with authentication left
    on that port, failed the CurveZMQ handshake and stored nothing."""
    port = free_port()
    tokens = list(range(4000, 4000 + CHUNK))
    for round_, extra in enumerate([(), ("--no-auth",), ()]):
        work = tmp_path / f"run{round_}"
        work.mkdir()
        with ServerProc(work, port=port, extra=extra) as server:
            secret = default_secret_file(port)
            assert secret.exists() == (not extra)  # without auth the earlier server's file is gone
            with Client(server.url, model="m", layout=LAYOUT) as client:
                kv = kv_for(CHUNK, round_)
                assert client.store(tokens, kv) == 1
                out, n = client.retrieve(tokens)
                assert n == CHUNK and torch.equal(out, kv)
            if extra:
                assert "removed" in server.log() and str(secret) in server.log()
