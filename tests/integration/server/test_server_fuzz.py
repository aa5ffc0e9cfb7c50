"""Fuzz the request socket with random and malformed messages: the server must stay up and answer every
message with exactly one reply (a typed ``Error`` for anything not well-formed).

``KVTIER_FUZZ_MESSAGES`` sets how many (default 100,000)."""

from __future__ import annotations

import os
import random

import msgspec
import pytest
import torch
import zmq
from support.server import CHUNK, LAYOUT, ServerProc, authenticated

from kvtier import protocol as P
from kvtier.client import Client
from kvtier.zmq_context import Context

NUM_MESSAGES = int(os.environ.get("KVTIER_FUZZ_MESSAGES", "100000"))
BATCH = 200  # pipelined, under the principal's queue bound (256): replies then come in order
enc = msgspec.msgpack.encode


def _valid(rng: random.Random, rid: int) -> bytes:
    tokens = [rng.randrange(50_000) for _ in range(rng.choice((0, 5, CHUNK, 3 * CHUNK)))]
    return P.encode(rng.choice([P.Lookup(id=rid, tokens=P.pack_tokens(tokens)), P.Ping(id=rid), P.Stats(id=rid),
                                P.RetrieveBegin(id=rid, tokens=P.pack_tokens(tokens), shm=False),
                                P.RetrieveEnd(id=rid, ticket=rng.randrange(1 << 40)),
                                P.StoreCommit(id=rid, ticket=rng.randrange(1 << 40), ok=rng.random() < 0.5)]))


def make_message(rng: random.Random, rid: int) -> tuple[list[bytes], int | None, bool]:
    """(frames, expected reply id or None if unknowable, must the reply be an Error?)"""
    kind = rng.randrange(12)
    if kind == 0:  # random bytes
        return [rng.randbytes(rng.randrange(0, 300))], None, True
    if kind == 1:  # truncated msgpack of a valid request
        full = _valid(rng, rid)
        return [full[: rng.randrange(0, len(full))]], None, True
    if kind == 2:  # wrong field types
        body = rng.choice([{"t": "lookup", "id": rid, "tokens": "not a list"},
                           {"t": "lookup", "id": rid, "tokens": [1, -5, 3]},
                           {"t": "lookup", "id": rid, "tokens": [1.5]},
                           {"t": "lookup", "id": rid, "tokens": b"\x01\x02\x03"},  # not a multiple of 8 bytes
                           {"t": "retrieve_begin", "id": rid, "tokens": (-7).to_bytes(8, "little", signed=True)},
                           {"t": "store_begin", "id": rid, "tokens": [1], "shm": "yes"},
                           {"t": "store_commit", "id": rid, "ticket": "abc"},
                           {"t": "hello", "id": rid, "version": "1", "model": 3},
                           {"t": "ping", "id": rid, "surprise": True}])
        return [enc(body)], rid, True
    if kind == 3:  # unknown request type
        return [enc({"t": rng.choice(["explode", "LOOKUP", "", "store"]), "id": rid})], rid, True
    if kind == 4:  # huge declared sizes with little data behind them
        head = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\x7f\xff\xff\xff", b"\xdb\xff\xff\xff\xf0"])
        inner = b"\x82\xa1t\xa6lookup\xa6tokens" + head  # {"t": "lookup", "tokens": <huge>}
        return [rng.choice([head, inner]) + rng.randbytes(rng.randrange(0, 64))], None, True
    if kind == 5:  # valid msgpack that is not a request map
        return [enc(rng.choice([None, 7, -1, "hello", [1, 2, 3], [], {}, {"id": rid}, 1.5]))], None, True
    if kind == 6:  # a well-formed request carrying unexpected payload frames
        return [P.encode(P.Ping(id=rid)), rng.randbytes(rng.randrange(0, 100))], rid, True
    if kind == 7:  # several random frames
        return [rng.randbytes(rng.randrange(0, 50)) for _ in range(rng.randrange(2, 6))], None, True
    if kind == 8:  # deep nesting
        return [b"\x91" * rng.randrange(100, 5000) + b"\xc0"], None, True
    if kind == 9:  # an id out of range
        return [enc({"t": "ping", "id": rng.choice([-1, 2**63, "7"])})], None, True
    if kind == 10:  # a bad KV layout in a handshake
        return [P.encode(P.Hello(id=rid, version=P.PROTOCOL_VERSION, model="m", layout={"num_layers": -1},
                                 layout_id="x", host_id="elsewhere"))], rid, True
    return [_valid(rng, rid)], rid, False  # well-formed: its own reply type or a typed error


@pytest.mark.timeout(1800)
def test_server_survives_random_and_malformed_messages(tmp_path):
    rng = random.Random(20261129)
    with ServerProc(tmp_path, l1="16MB") as server:
        ctx = Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        authenticated(sock, server.url).connect(server.url)
        sock.send(P.encode(P.Hello(id=0, version=P.PROTOCOL_VERSION, model="m", layout=LAYOUT.to_dict(),
                                   layout_id=LAYOUT.layout_id, host_id="elsewhere")))
        assert sock.poll(30_000) and isinstance(P.decode_reply(sock.recv()), P.HelloReply)
        errors = typed = 0
        rid = 1
        for start in range(0, NUM_MESSAGES, BATCH):
            sent = []
            for _ in range(min(BATCH, NUM_MESSAGES - start)):
                frames, expect_id, must_fail = make_message(rng, rid)
                rid += 1
                sock.send_multipart(frames)
                sent.append((expect_id, must_fail, frames))
            for expect_id, must_fail, frames in sent:
                assert sock.poll(60_000), f"no reply to {frames!r:.200}"
                parts = sock.recv_multipart()
                reply = P.decode_reply(parts[0])  # every reply is a valid, typed message
                if expect_id is not None:
                    assert reply.id == expect_id
                if isinstance(reply, P.Error):
                    errors += 1
                    assert reply.code in P.ERROR_CODES and reply.message
                    assert reply.code != "internal", reply.message  # internal = a server bug
                else:
                    assert not must_fail, (frames, reply)
                    typed += 1
        assert not sock.poll(200)  # exactly one reply each: nothing left over
        assert errors + typed == NUM_MESSAGES and errors > NUM_MESSAGES // 2
        sock.close()
        ctx.term()
        # the server is healthy and serves a normal client afterwards
        assert server.proc.poll() is None
        with Client(server.url, model="m", layout=LAYOUT) as client:
            tokens = list(range(CHUNK * 2))
            kv = torch.randn(LAYOUT.chunk_shape(len(tokens)))
            assert client.store(tokens, kv) == 2
            out, n = client.retrieve(tokens)
            assert n == 2 * CHUNK and torch.equal(out, kv)
        assert server.status()["leases"] == {"store": 0, "retrieve": 0}


def test_oversized_header_is_refused_not_decoded(tmp_path):
    with ServerProc(tmp_path) as server:
        ctx = Context()
        sock = ctx.socket(zmq.DEALER)
        authenticated(sock, server.url).connect(server.url)
        sock.send(b"\x90" * (P.MAX_HEADER_BYTES + 1))
        assert sock.poll(60_000)
        reply = P.decode_reply(sock.recv())
        assert isinstance(reply, P.Error) and reply.code == "too_large"
        sock.close(linger=0)
        ctx.term()
