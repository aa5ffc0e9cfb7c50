"""Server CPU per lookup vs the transport floor's: what the request path costs, read off /proc, not the wall clock.

A ``kvtier server`` subprocess (CurveZMQ on, as deployed; ``--no-auth`` to leave it out) holds ``--prompts``
prompts of 8 chunks of 256 tokens in L1; one client looks them up back to back ``--lookups`` times. The figure is
the CPU time (user + system, per thread, from ``/proc/<pid>/task/*/stat``) the server spent per lookup: its request
thread and libzmq's I/O thread. The floor in the same run is the bare pyzmq ROUTER loop of ``bench_lookup_hol.py``
answering the same requests from one DEALER with a kvtier-sized reply (no kvtier; CurveZMQ as for the server). CPU time is
far less sensitive than latency to other processes on the machine, so it shows what a change to the request path
saves even on a loaded machine (wall-clock p50 / p99 are printed too, for reference).

Run: ``.venv/bin/python benchmarks/bench_lookup_cpu.py [--lookups 3000] [--no-auth]``; with ``--src DIR``
the server runs the kvtier package under ``DIR`` (e.g. an older ``git archive``) for an A/B in one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_lookup_hol import LAYOUT, MODEL, curve_keys, echo_server, floor_lookup, floor_socket, kv_for

from harness.kvtier_server import ServerProcess
from kvtier.client import Client
from kvtier.zmq_context import Context


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """Thread name -> user + system CPU seconds of process ``pid`` (threads of one name summed)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def per_call(before: dict, after: dict, n: int) -> dict[str, float]:
    """Microseconds of CPU per call, by thread name, and ``total``."""
    diff = {k: (after[k] - before.get(k, 0.0)) * 1e6 / n for k in after}
    return {**{k: v for k, v in diff.items() if v > 0}, "total": sum(diff.values())}


def measure_kvtier(args, pool) -> tuple[dict, np.ndarray]:
    env_src = {"PYTHONPATH": args.src} if args.src else {}
    old = {k: os.environ.get(k) for k in env_src}
    os.environ.update(env_src)
    try:
        with ServerProcess(Path(tempfile.mkdtemp()), 256, l1="1GB", extra=("--no-auth",) if args.no_auth else ()) as srv, \
                Client(srv.url, model=MODEL, layout=LAYOUT, timeout_seconds=60) as client:
            for tokens in pool:
                client.store(tokens, kv_for(tokens))
            for tokens in pool:
                assert client.lookup(tokens) == len(tokens)
            before, lat = thread_cpu_seconds(srv.proc.pid), []
            for i in range(args.lookups):
                t0 = time.perf_counter()
                client.lookup(pool[i % len(pool)])
                lat.append(time.perf_counter() - t0)
            return per_call(before, thread_cpu_seconds(srv.proc.pid), args.lookups), np.array(lat)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def measure_floor(args, pool) -> tuple[dict, np.ndarray]:
    ctx = mp.get_context("spawn")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    stop = ctx.Event()
    keys = curve_keys(not args.no_auth)
    server = ctx.Process(target=echo_server, args=(url, stop, keys))
    server.start()
    zctx = Context()
    sock = floor_socket(zctx, url, keys)
    try:
        floor_lookup(sock, pool[0])
        before, lat = thread_cpu_seconds(server.pid), []
        for i in range(args.lookups):
            t0 = time.perf_counter()
            floor_lookup(sock, pool[i % len(pool)])
            lat.append(time.perf_counter() - t0)
        return per_call(before, thread_cpu_seconds(server.pid), args.lookups), np.array(lat)
    finally:
        stop.set()
        server.join(30)
        sock.close(0)
        zctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lookups", type=int, default=3000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--no-auth", action="store_true", help="the server and the floor without CurveZMQ")
    ap.add_argument("--src", default=None, help="PYTHONPATH for the server (another kvtier tree's src/)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    pool = [[int(t) for t in rng.integers(0, 50_000, 8 * 256)] for _ in range(args.prompts)]
    runs = {"kvtier": measure_kvtier(args, pool), "floor": measure_floor(args, pool)}
    for name, (cpu, lat) in runs.items():
        threads = ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items()) if k != "total")
        print(f"{name:6s}: server CPU {cpu['total']:.0f} us per lookup ({threads}); wall p50 "
              f"{np.percentile(lat, 50) * 1e6:.0f} us, p99 {np.percentile(lat, 99) * 1e6:.0f} us")
    (kv_cpu, kv_lat), (floor_cpu, floor_lat) = runs["kvtier"], runs["floor"]
    print(f"server CPU per lookup / floor's per round trip: {kv_cpu['total'] / floor_cpu['total']:.2f}x; back to back, "
          f"kvtier / floor: p50 {np.percentile(kv_lat, 50) / np.percentile(floor_lat, 50):.2f}x, p99 "
          f"{np.percentile(kv_lat, 99) / np.percentile(floor_lat, 99):.2f}x; "
          f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")

if __name__ == "__main__":
    main()
