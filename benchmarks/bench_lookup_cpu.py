"""Server CPU per lookup vs the transport floor's: what the request path costs, read off /proc, not the wall clock.

A ``kvtier server`` subprocess (CurveZMQ on, as deployed; ``--no-auth`` to leave it out) holds ``--prompts``
prompts of 8 chunks of 256 tokens in L1; one client looks them up back to back ``--lookups`` times. The floor is
the bare pyzmq ROUTER loop of ``bench_lookup_hol.py`` answering the same requests from one DEALER with a
kvtier-sized reply (no kvtier; CurveZMQ as for the server). Both servers run side by side and the client
interleaves its round trips (kvtier, floor, kvtier, ...; the order alternates), so both see the machine in the
same state: on a shared 2-vCPU machine, runs one after the other differed by more than the request path costs.
With ``--src DIR`` a second kvtier server running the package under ``DIR`` (e.g. an older ``git archive``)
joins the rotation: an A/B in one run.

Printed per system: the server's CPU time per lookup (user + system, per thread, from ``/proc/<pid>/task/*/stat``:
its request thread and libzmq's I/O thread), the client's (its calling thread: ``Client.lookup`` against the
floor's bare ``send`` / ``recv``; a round trip's wall time holds both) and the round trip's wall p50 / p99.
CPU time is far less sensitive than latency to other processes on the machine.

Run: ``.venv/bin/python benchmarks/bench_lookup_cpu.py [--lookups 3000] [--no-auth] [--src DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_lookup_hol import LAYOUT, MODEL, kv_for
from lookup_floor import curve_keys, echo_server, floor_lookup, floor_socket

from kvtier_harness.kvtier_server import ServerProcess
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


@contextlib.contextmanager
def kvtier_system(args, pool, src: str | None):
    """(server pid, one lookup) of a filled kvtier server; ``src``: the PYTHONPATH its process runs."""
    old = os.environ.get("PYTHONPATH")
    if src:
        os.environ["PYTHONPATH"] = src
    try:
        srv = ServerProcess(Path(tempfile.mkdtemp()), 256, l1="1GB", extra=("--no-auth",) if args.no_auth else ())
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    with srv, Client(srv.url, model=MODEL, layout=LAYOUT, timeout_seconds=60) as client:
        for tokens in pool:
            client.store(tokens, kv_for(tokens))
        for tokens in pool:
            assert client.lookup(tokens) == len(tokens)
        yield srv.proc.pid, client.lookup


@contextlib.contextmanager
def floor_system(args, pool):
    """(server pid, one lookup) of the floor: ``echo_server`` in a process, a DEALER to it."""
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
        yield server.pid, lambda tokens: floor_lookup(sock, tokens)
    finally:
        stop.set()
        server.join(30)
        sock.close(0)
        zctx.term()


def interleaved(systems: dict, pool, lookups: int) -> dict:
    """name -> (server CPU per lookup by thread, wall seconds per lookup, client CPU us per lookup): ``lookups``
    round trips to each system, one to each in turn, the order rotated every round."""
    names = list(systems)
    before = {n: thread_cpu_seconds(systems[n][0]) for n in names}
    lat = {n: [] for n in names}
    mine = dict.fromkeys(names, 0.0)
    for i in range(lookups):
        tokens = pool[i % len(pool)]
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            c0, t0 = time.thread_time(), time.perf_counter()
            systems[name][1](tokens)
            t1, c1 = time.perf_counter(), time.thread_time()
            lat[name].append(t1 - t0)
            mine[name] += c1 - c0
    return {n: (per_call(before[n], thread_cpu_seconds(systems[n][0]), lookups), np.array(lat[n]),
                mine[n] * 1e6 / lookups) for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lookups", type=int, default=3000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--no-auth", action="store_true", help="the servers and the floor without CurveZMQ")
    ap.add_argument("--src", default=None, help="also a kvtier server running this PYTHONPATH (another tree's src/)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    pool = [[int(t) for t in rng.integers(0, 50_000, 8 * 256)] for _ in range(args.prompts)]
    with contextlib.ExitStack() as stack:
        systems = {"kvtier": stack.enter_context(kvtier_system(args, pool, None))}
        if args.src:
            systems["src"] = stack.enter_context(kvtier_system(args, pool, args.src))
        systems["floor"] = stack.enter_context(floor_system(args, pool))
        runs = interleaved(systems, pool, args.lookups)
    floor_cpu, floor_lat, _ = runs["floor"]
    for name, (cpu, lat, mine) in runs.items():
        threads = ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items()) if k != "total")
        print(f"{name:6s}: server CPU {cpu['total']:.0f} us per lookup ({threads}); client CPU {mine:.0f} us; "
              f"wall p50 {np.percentile(lat, 50) * 1e6:.0f} us, p99 {np.percentile(lat, 99) * 1e6:.0f} us")
    for name, (cpu, lat, _) in runs.items():
        if name != "floor":
            print(f"{name}: server CPU per lookup / floor's per round trip: {cpu['total'] / floor_cpu['total']:.2f}x; "
                  f"back to back, {name} / floor: p50 {np.percentile(lat, 50) / np.percentile(floor_lat, 50):.2f}x, "
                  f"p99 {np.percentile(lat, 99) / np.percentile(floor_lat, 99):.2f}x")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
