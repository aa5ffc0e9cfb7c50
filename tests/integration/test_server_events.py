"""``kvtier server --enable-kv-events``: a client's stores reach a subscriber as vLLM-format events,
with engine-aligned hashes, from L1 (CPU) and L2 (STORAGE); the CLI subscriber prints them."""

import subprocess
import sys

import torch

from kvtier.events import BlockIndex, BlockStored, Subscriber
from kvtier.hashing import event_id, prefix_hashes
from kvtier.client import Client
from support.server import CHUNK, LAYOUT, ServerProc, free_port


def test_server_publishes_events_a_router_can_index(tmp_path):
    pub, replay = free_port(), free_port()
    extra = ("--enable-kv-events", "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
             "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}", "--block-size", "8",
             "--l2-adapter", f'{{"type": "local_disk", "path": "{tmp_path / "disk"}"}}')
    with ServerProc(tmp_path, extra=extra) as server, \
            Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic="kv-events") as sub:
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
        cli = subprocess.Popen([sys.executable, "-m", "kvtier", "events", "subscribe", "--endpoint",
                                f"tcp://127.0.0.1:{pub}", "--topic", "kv-events", "--max-batches", "1",
                                "--timeout-seconds", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        client = Client(server.url, model="m", layout=LAYOUT)
        tokens = list(range(CHUNK))
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
            raise AssertionError("subscriber printed nothing")
        client.close()
    assert cli.returncode == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("Received event batch at ")
    assert lines[1].startswith("- BlockStored(block_hashes=[") and "medium='CPU'" in lines[1]
    assert "parent_block_hash=None" in lines[1] and f"block_size={CHUNK}" in lines[1]
