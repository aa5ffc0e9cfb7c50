"""KV events of a real ``kvtier server`` with authentication (issue 22, finding 1): the PUB and replay sockets
need a key, a tenant's key sees only its namespaces' events (live and replayed), the operator's and a
subscriber key see every event, and a plain-ZMQ router reads them through the ipc:// relay."""

from __future__ import annotations

import os
import stat
import time

import pytest
import torch
import yaml
import zmq
from support.server import CHUNK, LAYOUT, ServerProc, free_port, metric_value, wait_for

from kvtier.auth.secret_file import (add_tenant, default_secret_file, subscriber_credentials, tenant_credentials,
                                     write_private)
from kvtier.client import Client
from kvtier.errors import ConfigError
from kvtier.events import BlockStored, Subscriber
from kvtier.events.relay import EventRelay
from kvtier.zmq_context import Context


def events_config() -> dict:
    return {"enable_kv_events": True,
            "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
                          "batch_max_delay_seconds": 0.001}}


def stored_tokens(batches) -> list[int]:
    return [t for _, batch in batches for ev in batch.events if isinstance(ev, BlockStored) for t in ev.token_ids]


def tokens_until(sub: Subscriber, want: list[int], timeout_seconds: float = 15.0) -> list[int]:
    """The stored token ids ``sub`` receives until it has ``want``'s count (or the time is up): a loaded
    machine may take longer than a fixed wait."""
    got: list = []
    deadline = time.monotonic() + timeout_seconds
    while len(stored_tokens(got)) < len(want) and time.monotonic() < deadline:
        item = sub.recv(0.2)
        if item is not None:
            got.append(item)
    return stored_tokens(got)


class Deployment:
    """A server with events, tenants team-a and team-b, a subscriber key, and their credential files."""

    def __init__(self, tmp_path):
        self.config = events_config()
        self.ev = self.config["kv_events"]
        self.server = ServerProc(tmp_path, config=self.config)
        self.secret = str(default_secret_file(self.server.port))
        self.files = {"*": self.secret}
        for name, role in (("team-a", "tenant"), ("team-b", "tenant"), ("router", "subscriber")):
            creds = add_tenant(self.secret, name, role=role)
            text = (tenant_credentials if role == "tenant" else subscriber_credentials)(creds, name)
            self.files[name] = str(tmp_path / f"{name}.cred")
            write_private(tmp_path / f"{name}.cred", text)
        # the server's public key is no secret: a peer may know it and still hold no accepted key
        self.files["stranger"] = str(tmp_path / "stranger.cred")
        write_private(tmp_path / "stranger.cred", yaml.safe_dump(
            {"tenant": "stranger", "secret": "ef" * 32, "server_key": creds.server_public_key().decode()}))

    def subscriber(self, who: str, **kw) -> Subscriber:
        return Subscriber(self.ev["endpoint"], self.ev["replay_endpoint"], secret_file=self.files[who], **kw)

    def store(self, who: str, tokens: list[int]) -> int:
        kv = torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(len(tokens)))
        with Client(self.server.url, model="m", layout=LAYOUT, secret_file=self.files[who]) as client:
            return client.store(tokens, kv)


@pytest.fixture
def deployment(tmp_path):
    d = Deployment(tmp_path)
    with d.server:
        yield d


def test_a_plain_subscriber_and_another_tenant_receive_none_of_a_tenants_tokens(deployment):
    d = deployment
    ctx = Context()
    plain = ctx.socket(zmq.SUB)
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    plain.connect(d.ev["endpoint"])
    # the keys that must see batches catch up from seq 0: on a loaded machine a CurveZMQ handshake may finish
    # after the first store, and a PUB drops what it sends before the subscription is in place
    subs = {who: d.subscriber(who, start_seq=0) for who in ("team-a", "team-b", "*", "router")}
    subs["stranger"] = d.subscriber("stranger")
    try:
        time.sleep(0.5)  # handshakes done where the machine is idle (ZAP answers after 50 ms)
        tokens_a = list(range(5000, 5000 + 2 * CHUNK))
        assert d.store("team-a", tokens_a) == 2
        assert tokens_until(subs["team-a"], tokens_a) == tokens_a  # its own stream: every token, once
        assert subs["team-a"].stats.received + subs["team-a"].stats.replayed >= 1
        assert tokens_until(subs["*"], tokens_a) == tokens_a and tokens_until(subs["router"], tokens_a) == tokens_a
        got = {who: list(subs[who].iter(timeout_seconds=1.0)) for who in ("team-b", "stranger")}
        assert got["team-b"] == [] and got["stranger"] == []
        assert plain.poll(500) == 0  # no CurveZMQ: refused at the handshake, receives nothing

        tokens_b = list(range(9000, 9000 + CHUNK))
        assert d.store("team-b", tokens_b) == 1
        assert tokens_until(subs["team-b"], tokens_b) == tokens_b
        assert list(subs["team-a"].iter(timeout_seconds=0.5)) == []
        assert tokens_until(subs["*"], tokens_b) == tokens_b
    finally:
        for sub in subs.values():
            sub.close()
        ctx.destroy(linger=0)
    assert metric_value(d.server.metrics_text(), "kvtier_auth_refused_total", socket="events") >= 1


def test_replay_is_scoped_like_the_live_stream(deployment):
    d = deployment
    tokens_a = list(range(100, 100 + CHUNK))
    assert d.store("team-a", tokens_a) == 1
    # its batch is in the replay rings before anyone subscribes: what ``a`` gets must come from the replay
    wait_for(lambda: metric_value(d.server.metrics_text(), "kvtier_events_published_total"), 30, "the store's event")
    with d.subscriber("team-b", start_seq=0) as b, d.subscriber("team-a", start_seq=0) as a, \
            d.subscriber("*", start_seq=0) as op:
        assert stored_tokens(list(b.iter(timeout_seconds=1.0))) == []
        assert tokens_until(a, tokens_a) == tokens_a and a.stats.replayed >= 1
        assert a.stats.missed_batches == 0  # its own stream's seqs start at 0: no gap before its first batch
        assert tokens_until(op, tokens_a) == tokens_a


def test_a_subscriber_key_reads_events_but_is_refused_on_the_request_port(deployment):
    d = deployment
    tokens = list(range(300, 300 + CHUNK))
    assert d.store("router", tokens) == 0  # the ZAP handler of the request port does not know the key
    assert d.store("*", tokens) == 1


def test_the_relay_serves_a_plain_zmq_router_over_ipc_with_owner_only_permissions(deployment, tmp_path):
    d = deployment
    out, replay_out = tmp_path / "events.ipc", tmp_path / "replay.ipc"
    with EventRelay(d.ev["endpoint"], d.ev["replay_endpoint"], d.files["router"], f"ipc://{out}",
                    replay_to=f"ipc://{replay_out}").start() as relay:
        for path in (out, replay_out):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with Subscriber(f"ipc://{out}", f"ipc://{replay_out}", "kv-events", start_seq=0) as plain:
            time.sleep(0.5)
            tokens = list(range(700, 700 + 2 * CHUNK))
            assert d.store("team-a", tokens) == 2
            assert tokens_until(plain, tokens) == tokens
        assert relay.stats()["missed_batches"] == 0


def test_the_relay_refuses_a_tcp_output(deployment):
    with pytest.raises(ConfigError, match="must be an ipc:// path"):
        EventRelay(deployment.ev["endpoint"], None, deployment.files["router"], "tcp://127.0.0.1:0")


@pytest.mark.parametrize("outputs", [("ipc://@kvtier-events", None), ("ipc://{tmp}/out", "ipc://@kvtier-replay")])
def test_the_relay_refuses_an_abstract_socket_up_front(deployment, tmp_path, outputs):
    """Issue 38 finding 6: an abstract ``ipc://@name`` has no socket file, so no permissions keep other local users
    out; it is refused with a message saying so, before any socket is made (it used to fail only at the chmod)."""
    out = tmp_path / "relay"
    out.mkdir()
    to, replay_to = (None if o is None else o.format(tmp=out) for o in outputs)
    with pytest.raises(ConfigError, match="abstract socket"):
        EventRelay(deployment.ev["endpoint"], deployment.ev["replay_endpoint"], deployment.files["router"], to,
                   replay_to=replay_to)
    assert not list(out.iterdir())  # nothing was bound
