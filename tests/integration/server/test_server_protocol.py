"""Handshake and typed errors of the kvtier wire protocol, against a real server subprocess."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq
from support.server import CHUNK, LAYOUT, ServerProc, authenticated

from kvtier import protocol as P
from kvtier.client import Client
from kvtier.errors import ProtocolError
from kvtier.layout import KVLayout
from kvtier.proc import host_id
from kvtier.zmq_context import Context


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProc(tmp_path_factory.mktemp("proto")) as srv:
        yield srv


class Raw:
    """A bare DEALER speaking the protocol by hand."""

    def __init__(self, url: str):
        self.ctx = Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        authenticated(self.sock, url).connect(url)

    def ask(self, msg, *frames):
        self.sock.send_multipart([P.encode(msg) if isinstance(msg, msgspec.Struct) else msg, *frames])
        assert self.sock.poll(10_000), "no reply within 10 s"
        parts = self.sock.recv_multipart()
        return P.decode_reply(parts[0]), parts[1:]

    def close(self):
        self.sock.close()
        self.ctx.term()


def hello(**changes) -> P.Hello:
    fields = {"id": 1, "version": P.PROTOCOL_VERSION, "model": "m", "layout": LAYOUT.to_dict(),
              "layout_id": LAYOUT.layout_id, "host_id": host_id()}
    fields.update(changes)
    return P.Hello(**fields)


def test_handshake_states_settings_and_data_plane(server):
    raw = Raw(server.url)
    reply, _ = raw.ask(hello(id=7))
    assert isinstance(reply, P.HelloReply) and reply.id == 7
    assert reply.version == P.PROTOCOL_VERSION
    assert (reply.chunk_size, reply.hash_algorithm, reply.save_unfull_chunk) == (CHUNK, "sha256", False)
    assert reply.block_size == CHUNK  # no --block-size: blocks are chunks
    assert reply.hash_seed == "vllm-none-hash"
    assert reply.shm_name and reply.shm_capacity_bytes == server.status()["l1"]["capacity_bytes"]
    assert reply.lease_seconds == 30.0
    # another host (different host id) gets no shared memory: its bytes travel as frames
    reply, _ = raw.ask(hello(id=8, host_id="elsewhere/boot"))
    assert isinstance(reply, P.HelloReply) and reply.shm_name is None
    raw.close()


def test_version_mismatch_is_refused_with_both_versions(server):
    raw = Raw(server.url)
    reply, _ = raw.ask(hello(version=P.PROTOCOL_VERSION + 1))
    assert isinstance(reply, P.Error) and reply.code == "version_mismatch"
    assert f"version {P.PROTOCOL_VERSION + 1}" in reply.message and str(P.PROTOCOL_VERSION) in reply.message
    raw.close()


def test_layout_mismatch_names_what_differs(server):
    raw = Raw(server.url)
    reply, _ = raw.ask(hello(layout_id="0123456789abcdef"))
    assert isinstance(reply, P.Error) and reply.code == "layout_mismatch"
    assert "0123456789abcdef" in reply.message and LAYOUT.layout_id in reply.message
    bad = dict(LAYOUT.to_dict(), dtype="float64")
    reply, _ = raw.ask(hello(layout=bad))
    assert isinstance(reply, P.Error) and reply.code == "layout_mismatch" and "float64" in reply.message
    huge = KVLayout(num_layers=4096, num_kv_heads=64, head_dim=256)  # one chunk > the 64 MB L1
    reply, _ = raw.ask(hello(layout=huge.to_dict(), layout_id=huge.layout_id))
    assert isinstance(reply, P.Error) and reply.code == "layout_mismatch" and "--l1-size-gb" in reply.message
    raw.close()


def test_client_refuses_config_mismatch_at_construction(server):
    with pytest.raises(ProtocolError, match="chunk_size differs: client expects 256, server uses 16"):
        Client(server.url, model="m", layout=LAYOUT, expect={"chunk_size": 256}, timeout_seconds=10)
    # what a vLLM engine expects: its block size and hashing; the refusal names the server flags to use
    with pytest.raises(ProtocolError) as refused:
        Client(server.url, model="m", layout=LAYOUT, timeout_seconds=10,
               expect={"block_size": 8, "hash_algorithm": "xxhash", "hash_seed": "0"})
    for text in ("block_size differs: client expects 8, server uses 16 (start the server with --block-size 8)",
                 "--hash-algorithm xxhash", "--hash-seed 0"):
        assert text in str(refused.value)
    with Client(server.url, model="m", layout=LAYOUT, expect={"chunk_size": CHUNK}, timeout_seconds=10) as ok:
        assert ok.ping()


def test_requests_before_hello_and_unknown_tickets_get_typed_errors(server):
    raw = Raw(server.url)
    reply, _ = raw.ask(P.Lookup(id=3, tokens=P.pack_tokens(range(32))))
    assert isinstance(reply, P.Error) and (reply.id, reply.code) == (3, "no_session")
    raw.ask(hello())
    reply, _ = raw.ask(P.StoreCommit(id=4, ticket=999))
    assert isinstance(reply, P.Error) and (reply.id, reply.code) == (4, "unknown_ticket")
    reply, _ = raw.ask(P.RetrieveEnd(id=5, ticket=999))
    assert isinstance(reply, P.Error) and (reply.id, reply.code) == (5, "unknown_ticket")
    reply, _ = raw.ask(P.Ping(id=6), b"unexpected payload")
    assert isinstance(reply, P.Error) and (reply.id, reply.code) == (6, "bad_payload")
    reply, _ = raw.ask(P.Lookup(id=9, tokens=P.pack_tokens(range(40))))
    assert isinstance(reply, P.LookupReply) and (reply.id, reply.num_tokens) == (9, 0)
    raw.close()


def test_negative_token_ids_on_the_wire_are_a_bad_request(server):
    # the server checks the ids where it resolves a prompt it has not seen (not again for a memoised one)
    raw = Raw(server.url)
    raw.ask(hello())
    short = np.arange(2 * CHUNK, dtype="<i8")
    short[CHUNK + 3] = -5
    long = np.arange(5000, dtype="<i8")  # past server.hash_offload_min_tokens: the hashing worker's path
    long[-1] = -1
    requests = [P.Lookup(id=1, tokens=short.tobytes()), P.Lookup(id=2, tokens=long.tobytes()),
                P.StoreBegin(id=3, tokens=short.tobytes()), P.RetrieveBegin(id=4, tokens=short.tobytes()),
                P.Prefetch(id=5, tokens=short.tobytes())]
    for msg in requests:
        reply, _ = raw.ask(msg)
        assert isinstance(reply, P.Error) and (reply.id, reply.code) == (msg.id, "bad_request"), reply
        assert "non-negative" in reply.message
    short[CHUNK + 3] = 7  # the same prompt with valid ids is answered
    assert raw.ask(P.Lookup(id=6, tokens=short.tobytes()))[0] == P.LookupReply(id=6, num_tokens=0, num_l1_tokens=0)
    raw.close()


def test_frames_store_with_wrong_sizes_is_refused_and_aborted(server):
    raw = Raw(server.url)
    raw.ask(hello(host_id="elsewhere/boot"))  # frames mode
    tokens = list(range(5000, 5000 + 2 * CHUNK))
    slots, _ = raw.ask(P.StoreBegin(id=1, tokens=P.pack_tokens(tokens), shm=False))
    assert isinstance(slots, P.StoreSlots) and len(slots.slots) == 2
    assert all(s.offset == -1 and s.nbytes == LAYOUT.chunk_bytes(CHUNK) for s in slots.slots)
    reply, _ = raw.ask(P.StoreCommit(id=2, ticket=slots.ticket), b"x" * 10, b"y" * 10)
    assert isinstance(reply, P.Error) and reply.code == "bad_payload" and "frame 0 holds 10 bytes" in reply.message
    # the reservation was aborted: nothing visible, and a new store gets both slots again
    assert raw.ask(P.Lookup(id=3, tokens=P.pack_tokens(tokens)))[0].num_tokens == 0
    again, _ = raw.ask(P.StoreBegin(id=4, tokens=P.pack_tokens(tokens), shm=False))
    assert len(again.slots) == 2
    done, _ = raw.ask(P.StoreCommit(id=5, ticket=again.ticket), *[bytes([i]) * s.nbytes for i, s in enumerate(again.slots)])
    assert isinstance(done, P.StoreDone) and done.num_stored == 2
    data, frames = raw.ask(P.RetrieveBegin(id=6, tokens=P.pack_tokens(tokens), shm=False))
    assert isinstance(data, P.RetrieveData) and data.num_tokens == 2 * CHUNK
    assert frames == [bytes([0]) * len(frames[0]), bytes([1]) * len(frames[1])]
    raw.close()
