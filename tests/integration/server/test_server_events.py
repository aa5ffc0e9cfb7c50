"""``kvtier server --enable-kv-events``: a client's stores reach a subscriber as vLLM-format events,
with engine-aligned hashes, from L1 (CPU) and L2 (STORAGE); the CLI subscriber prints them."""

import json
import subprocess
import sys

import torch

from kvtier.events import BlockIndex, BlockStored, Subscriber
from kvtier.hashing import event_id, prefix_hashes
from kvtier.client import Client
from kvtier.auth.secret_file import secret_file_for
from support.server import CHUNK, LAYOUT, ServerProc, free_port


def test_server_publishes_events_a_router_can_index(tmp_path):
    pub, replay = free_port(), free_port()
    extra = ("--enable-kv-events", "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
             "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}", "--block-size", "8",
             "--l2-adapter", f'{{"type": "local_disk", "path": "{tmp_path / "disk"}"}}')
    with ServerProc(tmp_path, extra=extra) as server, \
            Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic="kv-events",
                       secret_file=secret_file_for(server.url)[0], start_seq=0) as sub:
        client = Client(server.url, model="m", layout=LAYOUT)
        tokens = list(range(1, 2 * CHUNK + 1))
        # the subscriber may join after the first batches: replay from seq 0 covers that
        assert client.store(tokens, torch.randn(LAYOUT.chunk_shape(len(tokens)))) == 2
        client.flush()
        index, stored = BlockIndex(), []
        while not (index.contains(event_id(prefix_hashes(tokens, 8)[-1]), "STORAGE")
                   and index.contains(event_id(prefix_hashes(tokens, 8)[-1]), "CPU")):
            got = sub.recv(timeout_seconds=10)
            assert got is not None, "no event batch within 10 s"
            index.apply(got[1])
            stored += [e for e in got[1].events if isinstance(e, BlockStored)]
        engine_ids = [event_id(h) for h in prefix_hashes(tokens, 8)]  # what vLLM with block_size 8 publishes
        for medium in ("CPU", "STORAGE"):
            assert [h for e in stored if e.medium == medium for h in e.block_hashes] == engine_ids
        assert all(e.block_size == 8 for e in stored)
        client.close()
    assert server.proc.returncode == 0


def test_cli_subscriber_prints_the_seed_format(tmp_path):
    pub = free_port()
    extra = ("--enable-kv-events", "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}")
    with ServerProc(tmp_path, extra=extra) as server:
        # the server authenticates its event stream (kv_events.auth follows the request port's authentication)
        cli = subprocess.Popen([sys.executable, "-m", "kvtier", "events", "subscribe", "--endpoint",
                                f"tcp://127.0.0.1:{pub}", "--topic", "kv-events", "--max-batches", "1",
                                "--timeout-seconds", "30", "--auth-secret-file", str(secret_file_for(server.url)[0])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        tokens = list(range(CHUNK))
        with Client(server.url, model="m", layout=LAYOUT) as client:
            # PUB/SUB joins asynchronously: keep storing new prompts until the subscriber has its batch
            for i in range(200):
                client.store([i + 1000] + tokens[1:], torch.zeros(LAYOUT.chunk_shape(CHUNK)))
                try:
                    out, err = cli.communicate(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    continue
            else:
                cli.kill()
                raise AssertionError(f"subscriber printed nothing: {cli.communicate()[1]}")
    assert cli.returncode == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("Received event batch at ")
    assert lines[1].startswith("- BlockStored(block_hashes=[") and "medium='CPU'" in lines[1]
    assert "parent_block_hash=None" in lines[1] and f"block_size={CHUNK}" in lines[1]


def test_clearing_l2_behind_queued_writes_leaves_no_storage_block_in_a_routers_view(tmp_path):
    """Clear(STORAGE) runs after the writes queued before it: their records are deleted by it, so a router must
    not keep them (they used to be announced after the clear's BlockRemoved, and deleted without an event)."""
    pub, replay = free_port(), free_port()
    slow = {"type": "faulty", "latency_seconds": 0.02, "ops": ["put"],
            "inner": {"type": "local_disk", "path": str(tmp_path / "disk")}}
    extra = ("--enable-kv-events", "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
             "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}", "--l2-adapter", json.dumps(slow))
    with ServerProc(tmp_path, token="tok", extra=extra, config={"l2_write_queue_size": 256}) as server, \
            Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic="kv-events",
                       secret_file=secret_file_for(server.url)[0], start_seq=0) as sub, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        prompts = [list(range(10_000 * i, 10_000 * i + 2 * CHUNK)) for i in range(1, 41)]
        for tokens in prompts:  # 80 L2 writes of 20 ms each are still queued when the clear comes
            assert client.store(tokens, torch.zeros(LAYOUT.chunk_shape(len(tokens)))) == 2
        client.clear("STORAGE", admin_token="tok")
        assert client.flush(60)
        last = list(range(7, 7 + CHUNK))  # a marker stored after everything else: its events come last
        assert client.store(last, torch.zeros(LAYOUT.chunk_shape(CHUNK))) == 1 and client.flush(60)
        marker = event_id(prefix_hashes(last, CHUNK)[-1])
        index = BlockIndex()
        while not index.contains(marker, "STORAGE"):
            got = sub.recv(timeout_seconds=10)
            assert got is not None, "no event batch within 10 s"
            index.apply(got[1])
        held = [h for tokens in prompts for h in (event_id(x) for x in prefix_hashes(tokens, CHUNK))]
        assert not [h for h in held if index.contains(h, "STORAGE")]  # L2 holds none of them
        assert all(index.contains(h, "CPU") for h in held)  # L1 still does
        assert all(client.lookup_tiers(tokens).num_l1_tokens == len(tokens) for tokens in prompts)
