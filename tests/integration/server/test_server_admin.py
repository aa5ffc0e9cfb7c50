"""Admin mutations over ZMQ and HTTP, and what /status shows (issue 9, §4). Real server subprocesses."""

from __future__ import annotations

import httpx
import pytest
import torch
from support.server import CHUNK, LAYOUT, ServerProc

from kvtier.client import Client
from kvtier.errors import ProtocolError
from kvtier.keys import namespace_of

TOKEN = "the-admin-token"
SALT = "pepper-salt-4711"


def stored(client: Client, seed: int) -> list[int]:
    tokens = list(range(seed * 100, seed * 100 + CHUNK))
    assert client.store(tokens, torch.randn(LAYOUT.chunk_shape(CHUNK))) == 1
    return tokens


def test_with_an_admin_token_every_clear_needs_it(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_ADMIN_TOKEN", raising=False)
    with ServerProc(tmp_path, token=TOKEN) as server, \
            Client(server.url, model="m", layout=LAYOUT, namespace=namespace_of(None, SALT)) as client:
        tokens = stored(client, 1)
        for token in (None, "wrong"):
            with pytest.raises(ProtocolError, match="refused Clear: missing or wrong admin token"):
                client.clear(admin_token=token)
        assert client.lookup(tokens) == CHUNK  # the ZMQ Clear wiped nothing
        form = httpx.post(server.admin + "/clear", data={"medium": "CPU"}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert form.status_code == 415 and client.lookup(tokens) == CHUNK  # never a form, even with the token
        wrong = httpx.post(server.admin + "/clear", json={}, headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401 and client.lookup(tokens) == CHUNK
        assert httpx.post(server.admin + "/clear").status_code == 401  # who asks first, then what is asked
        auth = {"Authorization": f"bearer {TOKEN}"}  # the scheme in any case
        for kwargs, says in (({"json": {"medium": "CPU", "x": 1}}, "unknown fields ['x']"),
                             ({"json": {"medium": "CPU"}, "params": {"medium": "STORAGE"}}, "give it once")):
            bad = httpx.post(server.admin + "/clear", headers=auth, **kwargs)
            assert bad.status_code == 400 and says in bad.json()["error"] and client.lookup(tokens) == CHUNK
        status = httpx.get(server.admin + "/status").text
        assert SALT not in status and TOKEN not in status  # a namespace is a digest: no cache_salt in clear
        assert namespace_of(None, SALT) in status
        assert client.clear(medium="CPU", admin_token=TOKEN) == 1 and client.lookup(tokens) == 0
        stored(client, 2)
        done = httpx.post(server.admin + "/clear", json={"medium": "CPU"}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert done.status_code == 200 and done.json() == {"cleared": True, "medium": "CPU", "num_l1_chunks": 1}
        monkeypatch.setenv("KVTIER_ADMIN_TOKEN", TOKEN)  # the client's default token
        stored(client, 3)
        assert client.clear() == 1


def test_without_an_admin_token_mutations_are_refused(tmp_path):
    with ServerProc(tmp_path) as server, Client(server.url, model="m", layout=LAYOUT) as client:
        tokens = stored(client, 1)
        with pytest.raises(ProtocolError, match="no admin token is configured"):
            client.clear()
        for kwargs in ({"data": {"medium": "CPU"}}, {"json": {}}, {"headers": {"X-KVTier-Admin": "1"}}):
            refused = httpx.post(server.admin + "/clear", **kwargs)
            assert refused.status_code in (403, 415), refused.text
        assert client.lookup(tokens) == CHUNK


def test_unauthenticated_admin_must_be_enabled_and_still_refuses_cross_site_posts(tmp_path):
    with ServerProc(tmp_path, extra=("--allow-unauthenticated-admin",)) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        tokens = stored(client, 1)
        # what a page on another site can make a browser send without asking: a form, or text/plain
        cross_site = [{"data": {"medium": "CPU"}}, {"content": b"medium=CPU", "headers": {"Content-Type": "text/plain"}},
                      {"files": {"f": b"x"}}]
        for kwargs in cross_site:
            assert httpx.post(server.admin + "/clear", **kwargs).status_code == 415
        assert httpx.post(server.admin + "/clear").status_code == 400  # no JSON body, no X-KVTier-Admin header
        assert client.lookup(tokens) == CHUNK
        done = httpx.post(server.admin + "/clear?medium=CPU", headers={"X-KVTier-Admin": "1"})
        assert done.status_code == 200 and client.lookup(tokens) == 0
        stored(client, 2)
        assert client.clear() == 1


def test_a_rebound_dns_name_reads_nothing_but_health_and_metrics(tmp_path):
    """Issue 38 finding 5: a web page that resolves its own domain to this host (DNS rebinding) must not read which
    prompts are cached or what /status shows; the Host header is checked against IP addresses, localhost and
    ``server.admin_allowed_hosts``."""
    with ServerProc(tmp_path, config={"server": {"admin_allowed_hosts": ["KVTier.internal."]}}) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        tokens = stored(client, 2)
        port = server.admin.rsplit(":", 1)[1]
        lookup = {"model": "m", "tokens": tokens}
        for host in (f"attacker.example:{port}", "attacker.example", f"localhost.attacker.example:{port}"):
            headers = {"Host": host}
            for response in (httpx.get(server.admin + "/status", headers=headers),
                             httpx.get(server.admin + "/cache/sessions", headers=headers),
                             httpx.post(server.admin + "/cache/lookup", json=lookup, headers=headers)):
                assert response.status_code == 421, (host, response.request.url)
                assert "server.admin_allowed_hosts" in response.json()["error"] and str(tokens[0]) not in response.text
            assert httpx.get(server.admin + "/healthz", headers=headers).status_code == 200
            assert httpx.get(server.admin + "/metrics", headers=headers).status_code == 200
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", f"kvtier.internal:{port}"):
            response = httpx.post(server.admin + "/cache/lookup", json=lookup, headers={"Host": host})
            assert response.status_code == 200 and response.json()["num_tokens"] == CHUNK, host
            assert httpx.get(server.admin + "/status", headers={"Host": host}).status_code == 200
