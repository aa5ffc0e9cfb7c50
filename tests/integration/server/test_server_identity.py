"""Identity through a real ``kvtier server``: two deployments with different weights under the same served name
never hit each other's chunks (L1 or L2); per-block extra keys travel on the wire and decide the hashes
(another image, another hash); bad extra keys are refused with ``bad_request``; /status shows no salt."""

from __future__ import annotations

import json

import pytest
import torch
import zmq
from support.server import CHUNK, LAYOUT, ServerProc, authenticated

from kvtier.extra_keys import block_extra_keys
from kvtier.identity import model_identity
from kvtier.keys import namespace_of
from kvtier.demo.models import tiny_model
from kvtier import protocol as P
from kvtier.client import Client
from kvtier.proc import host_id
from kvtier.zmq_context import Context


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("identity")
    # the tests clear L1 (a mutation): this test server allows it without an admin token
    extra = ("--allow-unauthenticated-admin", "--l2-adapter", json.dumps({"type": "local_disk", "path": str(path / "l2")}))
    with ServerProc(path, extra=extra) as srv:
        yield srv


def kv(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape(n), generator=torch.Generator().manual_seed(seed))


def test_two_deployments_of_different_weights_under_one_served_name_never_share(server, tmp_path):
    """Before: both engines keyed chunks by the served name ("default") and read each other's KV."""
    folders = []
    for i in range(2):  # same architecture, same config, same file sizes: only the weights differ
        tiny_model(seed=i).save_pretrained(tmp_path / f"deploy-{i}" / "default")
        folders.append(tmp_path / f"deploy-{i}" / "default")
    ids = [model_identity(f) for f in folders]
    assert ids[0] != ids[1] and all(i.startswith("default@") for i in ids)
    tokens = list(range(7000, 7000 + 2 * CHUNK))
    with Client(server.url, model=ids[0], layout=LAYOUT) as a, Client(server.url, model=ids[1], layout=LAYOUT) as b:
        assert a.store(tokens, kv(2 * CHUNK)) == 2
        assert a.flush(30)
        assert a.lookup(tokens) == 2 * CHUNK and b.lookup(tokens) == 0
        assert b.retrieve(tokens)[1] == 0
        a.clear("CPU")  # only L2 holds them now: still no cross-deployment hit
        assert b.lookup(tokens) == 0 and b.retrieve(tokens)[1] == 0
        got, n = a.retrieve(tokens)
        assert n == 2 * CHUNK and torch.equal(got, kv(2 * CHUNK))


def test_extra_keys_on_the_wire_decide_the_hashes(server):
    """The same image placeholder tokens with another image are another prefix; without the keys, a miss."""
    tokens = list(range(9000, 9000 + 2 * CHUNK))
    image_a = block_extra_keys(len(tokens), CHUNK, mm_items=[("image-a-hash", 3, 20)])
    image_b = block_extra_keys(len(tokens), CHUNK, mm_items=[("image-b-hash", 3, 20)])
    with Client(server.url, model="mm", layout=LAYOUT) as client:
        assert client.store(tokens, kv(2 * CHUNK, 1), extra_keys=image_a) == 2
        assert client.lookup(tokens, extra_keys=image_a) == 2 * CHUNK
        assert client.lookup(tokens, extra_keys=image_b) == 0
        assert client.lookup(tokens) == 0
        got, n = client.retrieve(tokens, extra_keys=[list(e) if e else e for e in image_a])  # lists as well as tuples
        assert n == 2 * CHUNK and torch.equal(got, kv(2 * CHUNK, 1))
        with client.retrieve_chunks(tokens, extra_keys=image_b) as none:
            assert none.num_tokens == 0


def ask(url: str, *msgs):
    ctx = Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    authenticated(sock, url).connect(url)
    try:
        replies = []
        for msg in msgs:
            sock.send(P.encode(msg))
            assert sock.poll(10_000), "no reply within 10 s"
            replies.append(P.decode_reply(sock.recv_multipart()[0]))
        return replies
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("extra_keys, message", [
    ([[1.5], None], "float"),
    ([None], "need exactly one per block"),
    ([[True], None], "bool"),
    ([[], None], "non-empty"),
    ([[["x" * 5000]], None], "at most 4096"),
    ([[[[[["deep"]]]]], None], "nested deeper"),
    ([[("mm", {"x": 1}, 0)], None], "dict"),
    ([{"a": 1}, None], "list/tuple"),
], ids=["float", "length", "bool", "empty", "long", "deep", "map-in-key", "map"])
def test_bad_extra_keys_are_refused_with_a_clear_bad_request(server, extra_keys, message):
    hello = P.Hello(id=1, version=P.PROTOCOL_VERSION, model="m", layout=LAYOUT.to_dict(), layout_id=LAYOUT.layout_id,
                    host_id=host_id())
    tokens = P.pack_tokens(range(2 * CHUNK))
    replies = ask(server.url, hello, P.Lookup(id=2, tokens=tokens, extra_keys=extra_keys),
                  P.StoreBegin(id=3, tokens=tokens, extra_keys=extra_keys),
                  P.RetrieveBegin(id=4, tokens=tokens, extra_keys=extra_keys), P.Ping(id=5))
    for reply in replies[1:4]:
        assert isinstance(reply, P.Error) and reply.code == "bad_request", reply
        assert "extra_keys" in reply.message and message in reply.message, reply.message
    assert isinstance(replies[4], P.Ok)  # the session survives


def test_status_shows_namespaces_never_salts(server):
    namespace = namespace_of("sql@0123456789abcdef", "tenant-secret-salt")
    with Client(server.url, model="m", layout=LAYOUT, namespace=namespace) as client:
        assert client.ping()
        text = json.dumps(server.status())
    assert namespace in text and "tenant-secret-salt" not in text
