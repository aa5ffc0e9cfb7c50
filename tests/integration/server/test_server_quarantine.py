"""Shared memory and late writers (issue 9 §2): a real client process stopped (SIGSTOP) inside its copy past its
lease never changes another client's chunk, in L1 or in L2; its slot is quarantined until it is done or gone;
bytes changed after commit are never written to L2 nor served again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import zmq
from support import stalling_client
from support.server import CHUNK, CHUNK_BYTES, LAYOUT, ServerProc, authenticated, metric_value, wait_for

from kvtier import protocol as P
from kvtier.client import Client
from kvtier.client.dataplane import attach_arena
from kvtier.proc import host_id
from kvtier.zmq_context import Context


def kv_for(tokens, seed):
    return torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(seed))


def start_stalled(url: str, tokens: list[int], byte: int) -> subprocess.Popen:
    """The stalling client, stopped half-way through its first slot."""
    proc = subprocess.Popen([sys.executable, stalling_client.__file__, url, json.dumps(LAYOUT.to_dict()),
                             json.dumps(tokens), str(byte)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "STOPPING"
    wait_for(lambda: _state(proc.pid) == "T", what="the client to stop")
    return proc


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def quarantine(server) -> dict:
    return server.status()["quarantine"]


def l2_config(path) -> dict:
    return {"l2_adapters": [{"type": "local_disk", "path": str(path)}]}


def test_a_writer_stopped_past_its_lease_never_changes_another_clients_chunk(tmp_path):
    config = {**l2_config(tmp_path / "l2"), "server": {"max_reserved_fraction_per_client": 1.0}}
    mine = list(range(100, 100 + CHUNK))
    theirs = list(range(5000, 5000 + CHUNK))
    kv = kv_for(theirs, 1)
    # L1 holds two chunks: once the stalled client's lease expires, its slot is the only other one
    with ServerProc(tmp_path, l1="4200B", lease_seconds=1, config=config) as server:
        stalled = start_stalled(server.url, mine, 0xAB)
        try:
            wait_for(lambda: server.status()["leases"]["store"] == 0, what="the stalled store lease to expire")
            assert quarantine(server) == {"slots": 1, "bytes": CHUNK_BYTES}
            with Client(server.url, model="m", layout=LAYOUT) as other:
                assert other.store(theirs, kv) == 1
                os.kill(stalled.pid, signal.SIGCONT)  # the stalled writer finishes its copy
                assert stalled.stdout.readline().split() == ["STORED", "0"]  # its late commit: lease_expired
                out, n = other.retrieve(theirs)
                assert n == CHUNK and torch.equal(out, kv)  # never the stalled writer's bytes
                assert other.lookup(mine) == 0
                assert other.flush(30)
            assert quarantine(server) == {"slots": 0, "bytes": 0}  # freed by the late commit
            assert metric_value(server.metrics_text(), "kvtier_quarantine_released_total", reason="late_commit") == 1
            stalled.communicate("exit\n", timeout=30)
        finally:
            stalled.kill()
    with ServerProc(tmp_path, l1="4200B", config=config) as server, Client(server.url, model="m", layout=LAYOUT) as c:
        out, n = c.retrieve(theirs)  # from L2 after the restart
        assert n == CHUNK and torch.equal(out, kv)


def test_a_quarantined_slot_is_freed_when_its_process_is_gone(tmp_path):
    with ServerProc(tmp_path, l1="4200B", lease_seconds=1,
                    config={"server": {"max_reserved_fraction_per_client": 1.0}}) as server:
        stalled = start_stalled(server.url, list(range(CHUNK)), 0xCD)
        wait_for(lambda: server.status()["leases"]["store"] == 0, what="the store lease to expire")
        assert quarantine(server)["bytes"] == CHUNK_BYTES
        assert server.status()["l1"]["used_bytes"] == CHUNK_BYTES  # still allocated: never handed out
        os.kill(stalled.pid, signal.SIGKILL)
        stalled.wait()
        wait_for(lambda: quarantine(server)["bytes"] == 0, what="the dead writer's slot to be freed")
        assert metric_value(server.metrics_text(), "kvtier_quarantine_released_total", reason="process_gone") == 1
        with Client(server.url, model="m", layout=LAYOUT) as other:
            tokens = list(range(900, 900 + 2 * CHUNK))
            assert other.store(tokens, kv_for(tokens, 2)) == 2  # both slots usable again


def test_bytes_changed_after_commit_are_never_written_to_l2_nor_served(tmp_path):
    slow_l2 = {"type": "faulty", "inner": {"type": "local_disk", "path": str(tmp_path / "l2")},
               "latency_seconds": 3.0, "ops": ["put"]}
    config = {"l2_adapters": [slow_l2]}
    first = list(range(CHUNK))
    late = list(range(7000, 7000 + CHUNK))
    with ServerProc(tmp_path, l1="64KB", config=config) as server, \
            Client(server.url, model="m", layout=LAYOUT) as honest:
        ctx = Context()
        sock = authenticated(ctx.socket(zmq.DEALER), server.url)
        sock.connect(server.url)

        def ask(msg):
            sock.send(P.encode(msg))
            return P.decode_reply(sock.recv())

        try:
            # connected and attached first: only the store, its copy, its commit and the change below must come
            # while the writer is busy (the late chunk then waits in the queue, and is read after the change)
            hello = ask(P.Hello(id=1, version=P.PROTOCOL_VERSION, model="m", layout=LAYOUT.to_dict(),
                                layout_id=LAYOUT.layout_id, host_id=host_id(), pid=os.getpid()))
            arena = attach_arena(hello.shm_name, hello.shm_capacity_bytes)
            assert honest.store(first, kv_for(first, 3)) == 1  # keeps the L2 writer busy for 3 s
            slots = ask(P.StoreBegin(id=2, tokens=P.pack_tokens(late)))
            slot = slots.slots[0]
            view = arena.view(slot.offset, slot.nbytes)
            view[:] = b"\x01" * slot.nbytes
            assert isinstance(ask(P.StoreCommit(id=3, ticket=slots.ticket)), P.StoreDone)
            view[:] = b"\x02" * slot.nbytes  # a buggy or hostile writer, after its commit
            del view
            arena.close()
            ask(P.Bye(id=4))
        finally:
            sock.close(linger=0)
            ctx.term()
        assert honest.flush(30)
        text = server.metrics_text()
        assert metric_value(text, "kvtier_changed_after_commit_total") == 1
        assert honest.lookup(late) == 0  # dropped from L1 once seen
        out, n = honest.retrieve(late)
        assert n == 0
    with ServerProc(tmp_path, l1="64KB", config=l2_config(tmp_path / "l2")) as server, \
            Client(server.url, model="m", layout=LAYOUT) as client:
        assert client.lookup(first) == CHUNK
        assert client.lookup(late) == 0  # never written to L2
        out, n = client.retrieve(late)
        assert n == 0 and not np.any(out.numpy())
