"""The management API over a real server (issue 19 §2): lookup per tier, pin under pressure, TTL, delete of a session
from every tier with its BlockRemoved events at a real subscriber, the token and CSRF rules, tenants and namespaces,
limits and malformed bodies. Real ``kvtier server`` subprocesses, a local-disk L2 in a tmp folder."""

from __future__ import annotations

import httpx
import torch
from support.server import CHUNK, CHUNK_BYTES, LAYOUT, ServerProc, free_port, wait_for

from kvtier.auth.secret_file import add_tenant, secret_file_for, tenant_credentials, write_private
from kvtier.client import Client
from kvtier.events import BlockIndex, BlockRemoved, Subscriber
from kvtier.hashing import event_id, prefix_hashes
from kvtier.hints import RetentionHint

TOKEN = "manage-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def tokens_of(i: int, num_chunks: int) -> list[int]:
    return list(range(i * 100_000, i * 100_000 + num_chunks * CHUNK))


def store(client: Client, tokens: list[int], hint: RetentionHint | None = None) -> int:
    return client.store(tokens, torch.randn(LAYOUT.chunk_shape(len(tokens))), hint=hint)


def call(server, op: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.admin}/cache/{op}", json=body, headers=headers, timeout=30)


def events_server(tmp_path, **kwargs):
    pub, replay = free_port(), free_port()
    extra = ("--enable-kv-events", "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
             "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}")
    server = ServerProc(tmp_path, l1=f"{16 * CHUNK_BYTES}B", token=TOKEN, extra=extra,
                        config={"l2_adapters": [{"type": "local_disk", "path": str(tmp_path / "disk")}]}, **kwargs)
    return server, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"


def test_lookup_pin_ttl_and_a_session_delete_that_leaves_nothing_in_any_tier(tmp_path):
    server, pub, replay = events_server(tmp_path)
    with server, Subscriber(pub, replay, topic="kv-events", secret_file=secret_file_for(server.url)[0], start_seq=0) as sub, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        session, plain = tokens_of(1, 3), tokens_of(2, 3)
        assert store(client, session, RetentionHint(session_id="agent-7")) == 3
        assert store(client, plain) == 3
        assert client.flush(30)
        target = {"model": "m"}

        seen = call(server, "lookup", {**target, "tokens": session}).json()
        assert seen["num_tokens"] == seen["num_l1_tokens"] == 3 * CHUNK and seen["l2_adapters"] == ["local_disk"]
        assert [c["hash"] for c in seen["chunks"]] == [h.hex() for h in prefix_hashes(session, CHUNK)]
        assert all(c["l1"] and c["l2"] == ["local_disk"] and c["retention"]["session_id"] == "agent-7"
                   for c in seen["chunks"])
        rows = httpx.get(f"{server.admin}/cache/sessions", headers=AUTH).json()["sessions"]
        assert rows == [{"session_id": "agent-7", "model": "m", "namespace": "", "num_chunks": 3,
                         "bytes": 3 * CHUNK_BYTES, "num_pinned": 0, "num_l2_chunks": 3, "tenant": None}]

        pinned = call(server, "pin", {**target, "tokens": plain})
        assert pinned.status_code == 200 and pinned.json()["pinned"] == 3, pinned.text
        for i in range(10, 40):  # 30 chunks of other prompts through a 16-chunk L1
            store(client, tokens_of(i, 1))
            assert client.flush(30)  # the L2 writer's pins on unwritten chunks would leave only protected ones
        assert client.lookup_tiers(plain).num_l1_tokens == 3 * CHUNK  # the pin held
        assert client.lookup_tiers(session).num_l1_tokens == 3 * CHUNK  # a live session too
        assert call(server, "lookup", {**target, "tokens": plain}).json()["chunks"][0]["retention"]["pinned"]

        ttl = call(server, "ttl", {**target, "tokens": plain, "ttl_seconds": 0.2})
        assert ttl.status_code == 200 and ttl.json()["set"] == 3, ttl.text
        wait_for(lambda: all(c["retention"]["expires_in_seconds"] == 0 for c in
                             call(server, "lookup", {**target, "tokens": plain}).json()["chunks"]), what="the TTL")
        for i in range(40, 60):  # the TTL passed: ordinary chunks again, evicted by the next stream
            store(client, tokens_of(i, 1))
            assert client.flush(30)
        assert client.lookup_tiers(plain).num_l1_tokens == 0

        assert client.flush(30)
        gone = call(server, "delete", {**target, "session_id": "agent-7"})
        assert gone.status_code == 200, gone.text
        assert gone.json() == {"num_chunks": 3, "deleted": {"CPU": 3, "local_disk": 3}, "remaining": 0}
        assert client.lookup(session) == 0
        after = call(server, "lookup", {**target, "tokens": session}).json()["chunks"]
        assert not any(c["l1"] or c["l2"] for c in after)
        assert httpx.get(f"{server.admin}/cache/sessions", headers=AUTH).json()["sessions"] == []

        marker = tokens_of(99, 1)  # stored after the delete: once it is announced, the removals are in too
        store(client, marker)
        assert client.flush(30)
        marker_id = event_id(prefix_hashes(marker, CHUNK)[-1])
        index, removed = BlockIndex(), {"CPU": set(), "STORAGE": set()}
        while not index.contains(marker_id, "STORAGE"):
            got = sub.recv(timeout_seconds=10)
            assert got is not None, "no event batch within 10 s"
            index.apply(got[1])
            for event in got[1].events:
                if isinstance(event, BlockRemoved):
                    removed[event.medium].update(event.block_hashes)
        ids = {event_id(h) for h in prefix_hashes(session, CHUNK)}
        assert ids <= removed["CPU"] and ids <= removed["STORAGE"]
        assert not any(index.contains(h) for h in ids)


def test_token_csrf_and_malformed_bodies_are_refused(tmp_path):
    with ServerProc(tmp_path, token=TOKEN, config={"server": {"max_prompt_tokens": 4 * CHUNK}}) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        prompt = tokens_of(1, 2)
        assert store(client, prompt) == 2
        body = {"model": "m", "tokens": prompt}
        assert call(server, "lookup", body, headers={}).status_code == 401  # a read needs the token too
        assert call(server, "pin", body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{server.admin}/cache/sessions").status_code == 401
        assert call(server, "lookup", body, headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
        for kwargs in ({"data": {"model": "m"}}, {"content": b'{"model": "m"}', "headers": {"Content-Type": "text/plain"}},
                       {"content": b'{"model": "m"}'}):
            headers = {**AUTH, **kwargs.pop("headers", {})}
            assert httpx.post(f"{server.admin}/cache/delete", headers=headers, **kwargs).status_code == 415
        assert client.lookup(prompt) == 2 * CHUNK  # nothing was deleted
        refusals = [({"model": "m", "tokens": prompt, "colour": 1}, "colour"),
                    ({"model": "m", "tokens": ["a"]}, "$.tokens[0]"),
                    ({"model": "m", "tokens": [-1] * CHUNK}, "non-negative"),
                    ({"tokens": prompt}, "model"),
                    ({"model": "m"}, "'tokens'"),
                    ({"model": "m", "tokens": prompt, "text": "hi"}, "exactly one"),
                    ({"model": "m", "text": "hi"}, "'tokenizer'"),
                    ({"model": "m", "tokens": tokens_of(2, 5)}, "server.max_prompt_tokens (64)")]
        for bad, named in refusals:
            got = call(server, "lookup", bad)
            assert got.status_code == 400 and named in got.json()["error"], (bad, got.text)
        for bad, named in [({"model": "m", "tokens": prompt, "ttl_seconds": 0}, "ttl_seconds"),
                           ({"model": "m", "tokens": prompt, "ttl_seconds": 5, "priority": 9}, "priority"),
                           ({"model": "m", "tokens": prompt}, "ttl_seconds"),
                           ({"model": "m", "session_id": ""}, "session_id")]:
            got = call(server, "ttl", bad)
            assert got.status_code == 400 and named in got.json()["error"], (bad, got.text)
        not_json = httpx.post(f"{server.admin}/cache/lookup", content=b"{", headers={**AUTH, "Content-Type": "application/json"})
        assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]
        assert call(server, "lookup", {"model": "other", "tokens": prompt}).status_code == 404
        assert call(server, "lookup", {"model": "m", "namespace": "never-opened", "tokens": prompt}).status_code == 404


def test_tenants_are_scoped_as_their_clients_are(tmp_path):
    with ServerProc(tmp_path, token=TOKEN) as server:
        secret, _ = secret_file_for(server.url)
        creds = add_tenant(secret, "team-a")
        write_private(tmp_path / "team-a.yaml", tenant_credentials(creds, "team-a"))
        with Client(server.url, model="m", layout=LAYOUT, secret_file=tmp_path / "team-a.yaml") as tenant:
            prompt = tokens_of(1, 2)
            assert store(tenant, prompt, RetentionHint(session_id="s")) == 2
            mine = call(server, "lookup", {"model": "m", "tenant": "team-a", "tokens": prompt}).json()
            assert mine["num_l1_tokens"] == 2 * CHUNK
            # the same prompt outside the tenant's namespace: no client opened it there
            assert call(server, "lookup", {"model": "m", "tokens": prompt}).status_code == 404
            assert call(server, "lookup", {"model": "m", "tenant": "team-b", "tokens": prompt}).status_code == 404
            rows = httpx.get(f"{server.admin}/cache/sessions", headers=AUTH).json()["sessions"]
            assert [(r["session_id"], r["tenant"], r["num_chunks"]) for r in rows] == [("s", "team-a", 2)]
            scoped = {"model": "m", "tenant": "team-a", "session_id": "s"}
            assert call(server, "pin", scoped).json()["pinned"] == 2
            assert call(server, "unpin", scoped).json()["unpinned"] == 2
            hints = [c["retention"] for c in call(server, "lookup", {"model": "m", "tenant": "team-a",
                                                                      "tokens": prompt}).json()["chunks"]]
            assert all(not h["pinned"] and h["session_id"] == "s" for h in hints)  # still the session's
            assert call(server, "pin", {"model": "m", "session_id": "s"}).status_code == 404  # not the tenant's
            gone = call(server, "delete", {"model": "m", "tenant": "team-a", "tokens": prompt}).json()
            assert gone["deleted"]["CPU"] == 2 and gone["remaining"] == 0 and tenant.lookup(prompt) == 0


def test_without_a_token_reads_of_no_tenant_pass_and_mutations_are_refused(tmp_path):
    with ServerProc(tmp_path) as server, Client(server.url, model="m", layout=LAYOUT) as client:
        prompt = tokens_of(1, 1)
        assert store(client, prompt, RetentionHint(session_id="s")) == 1
        assert call(server, "lookup", {"model": "m", "tokens": prompt}, headers={}).json()["num_tokens"] == CHUNK
        for op in ("pin", "unpin", "delete"):
            assert call(server, op, {"model": "m", "tokens": prompt}, headers={}).status_code == 403
        assert call(server, "ttl", {"model": "m", "tokens": prompt, "ttl_seconds": 9}, headers={}).status_code == 403
        # a tenant's namespace needs the admin token, named either way
        for body in ({"model": "m", "tenant": "x", "tokens": prompt},
                     {"model": "m", "namespace": "tenant:x/", "tokens": prompt}):
            assert call(server, "lookup", body, headers={}).status_code in (403, 404)
        assert call(server, "lookup", {"model": "m", "namespace": "tenant:x/", "tokens": prompt},
                    headers={}).status_code == 403
        assert [r["session_id"] for r in httpx.get(f"{server.admin}/cache/sessions").json()["sessions"]] == ["s"]
        assert client.lookup(prompt) == CHUNK
