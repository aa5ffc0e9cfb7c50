"""Server memory under one hostile tenant, against the server's own bounds (issue 38's figure).

A ``kvtier server`` subprocess (CurveZMQ on, KV events with replay, two tenants) is filled once by the operator
(every L1 page touched), then measured (the baseline). Tenant A then does, ``--count`` times each:
  * a ``Hello`` with a model id at ``server.max_model_id_bytes`` and a namespace at ``max_namespace_bytes``,
    then ``Bye`` (plus 10 with a 20 MB model id, refused);
  * a store of 64 chunks under ``priority=3`` (its hints bounded by ``l1_retention_max_share_per_principal``;
    its events fill its stream's replay ring, ``--ring-mib``);
  * a replay request from a connection of its own that never reads (bounded by
    ``kv_events.max_replays_per_principal`` and ``max_replay_bytes_per_principal``).
Tenant B then stores a session's chunks under a hint, the operator churns twice L1 through, and B's chunks must
still be there. Printed: the server's anonymous memory (``RssAnon``, /proc) before and after, the growth the
configured bounds allow (the replay rings of the operator's and A's streams, A's replay bytes, the known caches,
the lookup memo), and growth / (bounds + 50 MiB): at most 1.0 is the figure.

Run: ``.venv/bin/python benchmarks/bench_hostile_tenant.py [--count 1000]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import zmq

from kvtier_harness.kvtier_server import ServerProcess
from kvtier_harness.service_proc import free_port
from kvtier.auth.curve import apply_client
from kvtier.auth.secret_file import add_tenant, default_secret_file, read_credentials, tenant_credentials, write_private
from kvtier.client import Client
from kvtier.errors import ProtocolError
from kvtier.hints import RetentionHint
from kvtier.layout import KVLayout
from kvtier.zmq_context import Context

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64)  # 4 KiB per token
CHUNK = 16  # tokens: 64 KiB per chunk
MIB = 1 << 20
SLACK_BYTES = 50 * MIB


def rss_anon_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc status")


def kv(num_tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape(num_tokens), generator=torch.Generator().manual_seed(seed))


def tokens_of(i: int, num_chunks: int = 1) -> list[int]:
    return list(range(i * 2_000, i * 2_000 + num_chunks * CHUNK))


def tenant_file(server: ServerProcess, name: str, folder: Path) -> str:
    creds = add_tenant(default_secret_file(server.port), name)
    path = folder / f"{name}.cred"
    write_private(path, tenant_credentials(creds, name))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=1000, help="hostile Hellos, stores and replay requesters")
    parser.add_argument("--l1-mb", type=int, default=256)
    parser.add_argument("--ring-mib", type=int, default=8, help="kv_events.buffer_max_bytes of each stream")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-hostile-"))
    os.environ["XDG_RUNTIME_DIR"] = str(work)
    config = {"enable_kv_events": True, "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}",
                                                      "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
                                                      "buffer_max_bytes": args.ring_mib * MIB}}
    server = ServerProcess(work, CHUNK, f"{args.l1_mb}MB", config=config)
    ctx = Context()
    requesters: list[zmq.Socket] = []
    try:
        a_file, b_file = tenant_file(server, "team-a", work), tenant_file(server, "team-b", work)
        num_l1_chunks = args.l1_mb * MIB // LAYOUT.chunk_bytes(CHUNK)
        with Client(server.url, model="m", layout=LAYOUT) as operator:
            for i in range(num_l1_chunks + 8):  # every L1 page touched: the shared arena is not what we measure
                operator.store(tokens_of(100_000 + i), kv(CHUNK, i))
        time.sleep(1.0)
        before = rss_anon_bytes(server.proc.pid)
        started = time.monotonic()

        big = "m" * (20 * 1000 * 1000)
        refused_big = 0
        for _ in range(10):
            try:
                Client(server.url, model=big, layout=LAYOUT, secret_file=a_file).close()
            except ProtocolError:
                refused_big += 1
        phases = {}
        for i in range(args.count):
            Client(server.url, model=f"{i:06d}" + "m" * 1018, namespace="n" * 1024, layout=LAYOUT,
                   secret_file=a_file).close()
        phases["Hellos"] = rss_anon_bytes(server.proc.pid)
        flood = kv(64 * CHUNK, 3)
        with Client(server.url, model="m", layout=LAYOUT, secret_file=a_file) as a:
            for i in range(args.count):
                a.store(tokens_of(200_000 + i, 64), flood, hint=RetentionHint(priority=3))
        phases["hinted stores"] = rss_anon_bytes(server.proc.pid)
        creds = read_credentials(a_file)
        replay = config["kv_events"]["replay_endpoint"]
        for _ in range(args.count):
            sock = ctx.socket(zmq.DEALER)
            apply_client(sock, creds)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(replay)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            requesters.append(sock)
        time.sleep(2.0)  # the replays start and stall
        hostile_seconds = time.monotonic() - started
        phases["replay requesters"] = rss_anon_bytes(server.proc.pid)

        session = tokens_of(300_000, 8)
        with Client(server.url, model="m", layout=LAYOUT, secret_file=b_file) as b, \
                Client(server.url, model="m", layout=LAYOUT) as operator:
            stored_b = b.store(session, kv(8 * CHUNK, 7), hint=RetentionHint(priority=1, session_id="b-agent"))
            for i in range(2 * num_l1_chunks):
                operator.store(tokens_of(400_000 + i), kv(CHUNK, i))
            honoured = b.lookup(session) == 8 * CHUNK and stored_b == 8
        time.sleep(1.0)
        after = rss_anon_bytes(server.proc.pid)
        status = server.status()
    finally:
        for sock in requesters:
            sock.close(linger=0)
        ctx.destroy(linger=0)
        server.stop()

    cfg = status["config"]
    ev, srv = cfg["kv_events"], cfg["server"]
    bounds = {"replay rings (operator + team-a)": 2 * ev["buffer_max_bytes"],
              "team-a replay bytes in flight": ev["max_replay_bytes_per_principal"],
              "known caches": srv["known_caches_max_bytes"], "lookup memo": cfg["lookup_memo_max_bytes"]}
    allowed = sum(bounds.values())
    growth = after - before
    print(f"hostile tenant: {args.count} Hellos (model id {srv['max_model_id_bytes']} B, namespace "
          f"{srv['max_namespace_bytes']} B), {args.count} hinted stores, {args.count} replay requesters that never "
          f"read; {refused_big}/10 Hellos with a 20 MB model id refused; {hostile_seconds:.1f} s")
    print(f"server RssAnon: before {before / MIB:.1f} MiB, after {after / MIB:.1f} MiB, growth {growth / MIB:.1f} MiB")
    for name, nbytes in phases.items():
        print(f"  after the {name}: {nbytes / MIB:.1f} MiB")
    for name, nbytes in bounds.items():
        print(f"  bound {name}: {nbytes / MIB:.1f} MiB")
    print(f"growth / (bounds {allowed / MIB:.1f} MiB + 50 MiB) = {growth / (allowed + SLACK_BYTES):.2f} (figure: <= 1.0)")
    print(f"another tenant's hinted session survived 2x L1 of churn: {honoured}")


if __name__ == "__main__":
    main()
