"""Trust benchmark (issue 9 §2, §3): late writers, hostile clients, and what the checks cost.

(a) soak: ``--clients`` client processes for ``--duration`` seconds storing and retrieving through a ``kvtier
    server`` (shared memory, lease 1 s, an L1 of ``--l1-chunks`` chunks so slots are reused all the time, a
    local-disk L2). Every chunk's bytes encode its own document and index, and every retrieved chunk is checked.
    One client writes slowly and is SIGSTOPped past its lease again and again (inside its copy); another is
    SIGKILLed and restarted. Then the server is stopped (L2 writes finished), a new one is started on the same
    L2, and every document is read back from L2 and checked. Figures: wrong bytes returned, wrong bytes in L2
    (both must be 0), and how many stalls, kills, expired leases and quarantine releases happened.
(b) flood: 2 honest clients (the server's own key) time lookups of a stored 2,048-token prompt, first alone for
    ``--baseline-seconds`` (the same-run baseline), then while 4 hostile processes holding a tenant's key
    (another principal) loop over the §3 cases (stores never committed, retrieves never ended, frames retrieves
    never read, prompts of ``--hostile-prompt-tokens`` tokens, a new connection and Hello per new model name).
    Figures: honest lookup p50/p99 (target p99 <= 2 ms) and its ratio to the baseline's, honest lookups that came
    back short (evicted chunks), the server's peak RSS against L1 + 300 MB.
(c) checks: lookup (memoised 8,192-token prompt) and shared-memory retrieve of 8 chunks against two servers in
    the same run, one with the per-client bounds (default) and one with ``server.client_limits: false``,
    alternating; ratio with / without (target >= 0.95).

Run: ``.venv/bin/python benchmarks/bench_trust.py --duration 10`` (short); for the record ``--duration 60``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from kvtier_harness.kvtier_server import ServerProcess
from kvtier_harness.metrics import parse
from kvtier import protocol as P
from kvtier.client import Client
from kvtier.layout import KVLayout
from kvtier.proc import host_id
from kvtier.zmq_context import Context

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64)  # 4 KiB per token, fp32
CHUNK = 64
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)  # 256 KiB
MODEL = "trust-bench"


def start_server(workdir: Path, l1_bytes: int, config: dict, lease_seconds: float = 1.0) -> ServerProcess:
    """A ``kvtier server`` with this benchmark's chunk size, an L1 of ``l1_bytes`` and ``config`` (a tree)."""
    return ServerProcess(workdir, CHUNK, f"{l1_bytes}B", config=config, startup_timeout_seconds=120,
                        extra=("--lease-seconds", str(lease_seconds), "--log-level", "ERROR"))


def kvtier_series(server: ServerProcess) -> dict[str, float]:
    """The server's ``kvtier_*`` samples keyed as exposed (``name{label="value"}``), for the JSON summary."""
    return {name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""): value
            for (name, labels), value in parse(server.metrics_text()).items() if name.startswith("kvtier_")}


def tokens_of(doc: int, num_chunks: int) -> list[int]:
    return [doc * 7919 % 40_000 + i for i in range(num_chunks * CHUNK)]


def pattern(doc: int, index: int) -> float:
    return float(doc * 1000 + index)


def fill_for(doc: int, slow: bool = False):
    def fill(start: int, dst: np.ndarray) -> None:
        value = pattern(doc, start // CHUNK)
        if not slow:
            dst[...] = value
            return
        flat = dst.reshape(-1)
        for i in range(0, flat.size, flat.size // 16):  # a slow copy: most of this client's time is in here
            flat[i:i + flat.size // 16] = value
            time.sleep(0.01)
    return fill


def check(client: Client, doc: int, num_chunks: int) -> tuple[int, int]:
    """(chunks checked, wrong bytes) of one retrieve."""
    wrong = checked = 0
    with client.retrieve_chunks(tokens_of(doc, num_chunks)) as got:
        copies = [(start, np.array(view)) for start, view in got.chunks]
    if not got.ok:
        return 0, 0  # the lease ran out: the client discards the copy
    for start, arr in copies:
        checked += 1
        wrong += int(np.count_nonzero(arr != pattern(doc, start // CHUNK))) * arr.itemsize
    return checked, wrong


def worker(url: str, seed: int, duration_seconds: float, num_docs: int, slow: bool, queue) -> None:
    rng = random.Random(seed)
    client = Client(url, model=MODEL, layout=LAYOUT, timeout_seconds=30)
    stats = {"stores": 0, "retrieves": 0, "checked": 0, "wrong_bytes": 0}
    deadline = time.monotonic() + duration_seconds
    try:
        while time.monotonic() < deadline:
            doc, num_chunks = rng.randrange(num_docs), 1 + rng.randrange(4)
            if slow or rng.random() < 0.4:
                client.store_chunks(tokens_of(doc, num_chunks), fill_for(doc, slow))
                stats["stores"] += 1
            else:
                checked, wrong = check(client, doc, num_chunks)
                stats["retrieves"] += 1
                stats["checked"] += checked
                stats["wrong_bytes"] += wrong
    finally:
        queue.put(("done", seed, stats))
        client.close()


def soak(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-trust-"))
    l2 = {"l2_adapters": [{"type": "local_disk", "path": str(workdir / "l2")}], "l2_write_queue_size": 256}
    server = start_server(workdir, args.l1_chunks * CHUNK_BYTES + 4096, l2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    honest = args.clients - 2

    def start(seed: int, slow: bool):
        proc = ctx.Process(target=worker, args=(server.url, seed, args.duration, args.docs, slow, queue))
        proc.start()
        return proc

    procs = [start(i, False) for i in range(honest)]
    staller = start(100, True)
    victim = start(200, False)
    stalls = kills = 0
    deadline = time.monotonic() + args.duration
    next_kill = time.monotonic() + 3
    while time.monotonic() < deadline - 2:
        time.sleep(0.5)
        if staller.is_alive():  # stopped past its 1 s lease, most likely inside its slow copy
            os.kill(staller.pid, signal.SIGSTOP)
            time.sleep(1.6)
            os.kill(staller.pid, signal.SIGCONT)
            stalls += 1
        if time.monotonic() > next_kill:
            os.kill(victim.pid, signal.SIGKILL)
            victim.join()
            kills += 1
            victim = start(200 + kills, False)
            next_kill = time.monotonic() + 3
    results = {}
    while len(results) < honest + 1:  # the killed client's copies were checked too; its counts died with it
        _, seed, stats = queue.get(timeout=args.duration + 120)
        results[seed] = stats
    for proc in [*procs, staller]:
        proc.join(60)
    victim.kill()
    victim.join()
    checked = sum(r["checked"] for r in results.values())
    wrong = sum(r["wrong_bytes"] for r in results.values())
    metrics = kvtier_series(server)
    server.stop()
    # every document, read back from L2 by a fresh server
    fresh = start_server(workdir, 8 * args.docs * CHUNK_BYTES, l2)
    l2_checked = l2_wrong = 0
    with Client(fresh.url, model=MODEL, layout=LAYOUT, timeout_seconds=60) as client:
        for doc in range(args.docs):
            c, w = check(client, doc, 4)
            l2_checked += c
            l2_wrong += w
    fresh.stop()
    return {"duration_seconds": args.duration, "clients": args.clients, "stalls": stalls, "kills": kills,
            "stores": sum(r["stores"] for r in results.values()),
            "retrieves": sum(r["retrieves"] for r in results.values()),
            "chunks_checked": checked, "wrong_bytes_returned": wrong,
            "l2_chunks_checked": l2_checked, "wrong_bytes_in_l2": l2_wrong,
            "leases_expired": {k: v for k, v in metrics.items() if k.startswith("kvtier_lease_expired_total")},
            "quarantine_released": {k: v for k, v in metrics.items() if k.startswith("kvtier_quarantine_released")},
            "changed_after_commit": metrics.get("kvtier_changed_after_commit_total", 0)}


# ---- (b) flood ----------------------------------------------------------------------------------
def hostile(url: str, seed: int, duration_seconds: float, prompt_tokens: int, secret_file: str) -> None:
    import zmq

    from kvtier.auth.curve import apply_client
    from kvtier.auth.secret_file import read_credentials

    rng = random.Random(seed)
    ctx = Context()

    def connect(model: str, shm: bool):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.LINGER, 0)
        apply_client(sock, read_credentials(secret_file))
        sock.connect(url)
        sock.send(P.encode(P.Hello(id=1, version=P.PROTOCOL_VERSION, model=model, layout=LAYOUT.to_dict(),
                                   layout_id=LAYOUT.layout_id, host_id=host_id(), pid=os.getpid(), want_shm=shm)))
        sock.poll(5000)
        return sock

    socks = [connect(MODEL, True), connect(MODEL, False)]
    deadline = time.monotonic() + duration_seconds
    i = 0
    while time.monotonic() < deadline:
        i += 1
        case = i % 5
        stored = P.pack_tokens(tokens_of(0, 8))
        if case == 0:  # reserve, never commit
            socks[0].send(P.encode(P.StoreBegin(id=i, tokens=P.pack_tokens(tokens_of(10_000 + i, 4)))))
        elif case == 1:  # pin, never end
            socks[0].send(P.encode(P.RetrieveBegin(id=i, tokens=stored)))
        elif case == 2:  # frames, never read
            socks[1].send(P.encode(P.RetrieveBegin(id=i, tokens=stored, shm=False)))
        elif case == 3:  # a long prompt, never seen before
            base = rng.randrange(1 << 40)
            socks[0].send(P.encode(P.Lookup(id=i, tokens=(np.arange(prompt_tokens, dtype="<i8") + base).tobytes())))
        else:  # a new model name, then gone
            sock = connect(f"model-{seed}-{i}", False)
            sock.close()
        for sock in socks:  # read only what is at hand, now and then
            if rng.random() < 0.1:
                while sock.poll(0):
                    sock.recv_multipart()
        time.sleep(0.002)
    for sock in socks:
        sock.close()
    ctx.term()


def flood(args) -> dict:
    from kvtier.auth.secret_file import add_tenant, tenant_credentials, write_private

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-flood-"))
    l1_bytes = 256 << 20
    # the hostile processes hold a tenant's key (another principal than the honest engines: the server's own)
    secrets, bad = workdir / "secrets.yaml", workdir / "hostile.yaml"
    write_private(bad, tenant_credentials(add_tenant(secrets, "hostile"), "hostile"))
    server = start_server(workdir, l1_bytes, {"server": {"max_prompt_tokens": args.hostile_prompt_tokens,
                                                         "hash_offload_min_tokens": args.hash_offload_min_tokens,
                                                         "auth_secret_file": str(secrets)}}, lease_seconds=2)
    seed_client = Client(server.url, model=MODEL, layout=LAYOUT, secret_file=secrets)
    assert seed_client.store_chunks(tokens_of(0, 8), fill_for(0)) == 8
    honest_toks = tokens_of(1, 32)
    assert seed_client.store_chunks(honest_toks, fill_for(1)) == 32
    latencies: list[float] = []
    misses = [0]

    def honest_loop(duration_seconds: float):
        client = Client(server.url, model=MODEL, layout=LAYOUT, secret_file=secrets)
        deadline = time.monotonic() + duration_seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            if client.lookup(honest_toks) != 32 * CHUNK:
                misses[0] += 1  # its chunks were evicted: the hostile clients' reservations took L1
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.005)
        client.close()

    def honest(duration_seconds: float) -> list[float]:
        latencies.clear()
        threads = [threading.Thread(target=honest_loop, args=(duration_seconds,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sorted(latencies)

    base = honest(args.baseline_seconds)  # the same server and clients, no flood: what this machine gives
    ctx = mp.get_context("spawn")
    bad = [ctx.Process(target=hostile, args=(server.url, s, args.duration, args.hostile_prompt_tokens, str(bad)))
           for s in range(4)]
    for proc in bad:
        proc.start()
    peak = [0]
    stop = threading.Event()
    ps = psutil.Process(server.proc.pid)

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], ps.memory_info().rss)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    time.sleep(1.0)  # let the flood start
    misses[0] = 0
    lat = honest(args.duration - 2.0)
    for proc in bad:
        proc.join(60)
    stop.set()
    sampler.join()
    metrics = kvtier_series(server)
    seed_client.close()
    server.stop()
    p99, base_p99 = lat[int(len(lat) * 0.99)], base[int(len(base) * 0.99)]
    return {"duration_seconds": args.duration, "hostile_prompt_tokens": args.hostile_prompt_tokens,
            "hash_offload_min_tokens": args.hash_offload_min_tokens,
            "honest_lookups": len(lat), "honest_lookups_short": misses[0],
            "lookup_p50_milliseconds": 1e3 * lat[len(lat) // 2], "lookup_p99_milliseconds": 1e3 * p99,
            "baseline_lookups": len(base), "baseline_p50_milliseconds": 1e3 * base[len(base) // 2],
            "baseline_p99_milliseconds": 1e3 * base_p99, "p99_ratio_flood_vs_baseline": p99 / base_p99,
            "load_average": os.getloadavg(), "server_peak_rss_bytes": peak[0],
            "rss_bound_bytes": l1_bytes + 300 * 10**6, "rss_within_bound": peak[0] <= l1_bytes + 300 * 10**6,
            "limits_hit": {k: v for k, v in metrics.items() if k.startswith(("kvtier_client_limit_exceeded_total",
                                                                              "kvtier_replies_dropped_total"))}}


# ---- (c) cost of the checks ---------------------------------------------------------------------
def checks(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-checks-"))
    l1 = 256 * CHUNK_BYTES + 4096
    servers = {"with": start_server(workdir, l1, {}, lease_seconds=30),
               "without": start_server(workdir, l1, {"server": {"client_limits": False}}, lease_seconds=30)}
    clients = {k: Client(s.url, model=MODEL, layout=LAYOUT) for k, s in servers.items()}
    lookup_toks, retr_toks = tokens_of(3, 128), tokens_of(4, 8)
    for c in clients.values():
        assert c.store_chunks(lookup_toks[:32 * CHUNK], fill_for(3)) == 32
        assert c.store_chunks(retr_toks, fill_for(4)) == 8
    times = {k: {"lookup": [], "retrieve": []} for k in clients}
    for _ in range(args.rounds):
        for name, client in clients.items():
            for _ in range(50):
                t0 = time.perf_counter()
                client.lookup(lookup_toks)
                times[name]["lookup"].append(time.perf_counter() - t0)
            for _ in range(10):
                t0 = time.perf_counter()
                out, n = client.retrieve(retr_toks)
                times[name]["retrieve"].append(time.perf_counter() - t0)
                assert n == 8 * CHUNK
    for c in clients.values():
        c.close()
    for s in servers.values():
        s.stop()
    med = {k: {op: statistics.median(v) for op, v in ops.items()} for k, ops in times.items()}
    return {"lookup_median_milliseconds": {k: 1e3 * m["lookup"] for k, m in med.items()},
            "retrieve_median_milliseconds": {k: 1e3 * m["retrieve"] for k, m in med.items()},
            "ratio_lookup_with_vs_without": med["without"]["lookup"] / med["with"]["lookup"],
            "ratio_retrieve_with_vs_without": med["without"]["retrieve"] / med["with"]["retrieve"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["soak", "flood", "checks"], action="append")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of soak and of flood (60 for the record)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--l1-chunks", type=int, default=24)
    ap.add_argument("--hostile-prompt-tokens", type=int, default=65536)
    ap.add_argument("--hash-offload-min-tokens", type=int, default=4096,
                    help="server.hash_offload_min_tokens (a huge value: every prompt hashed on the request thread)")
    ap.add_argument("--baseline-seconds", type=float, default=10.0, help="seconds of honest lookups before the flood")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    parts = args.only or ["soak", "flood", "checks"]
    out = {}
    for name in parts:
        out[name] = globals()[name](args)
        print(json.dumps({name: out[name]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
