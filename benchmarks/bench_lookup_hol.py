"""Head-of-line blocking benchmark: lookup latency while one L2 adapter answers every call late.

Two ``kvtier server`` subprocesses are measured one after the other in the same run, identical but for the L2
adapter: a local_disk adapter wrapped by the fault-injecting adapter (``kvtier.l2.faulty``) with
``latency_seconds`` 0 (the baseline) and ``--delay-seconds`` (default 0.1) on every call (put, get, contains, delete).
L1 holds about a quarter of the ``--prompts`` prompts (``--chunks`` chunks of 256 tokens each), so most
prompts live only in L2. For ``--duration`` seconds, ``--clients`` client processes look up a random prompt
(an L1 hit, an L2-only hit answered from the adapter's index, or, one time in eight, a prompt never stored),
while one more process keeps the L2 busy the way engines do: it retrieves random prompts (an L2-only one is
promoted through the slow adapter) and stores new ones (written through it); ``--no-l2-load``: that process
does nothing, so the lookups run alone, as the floor's. Only the lookups are timed (wall clock around
``Client.lookup``, round trip included).

With ``--l2 redis`` the wrapped adapter is a Redis (``--redis-url``, a fresh key prefix, deleted afterwards)
instead of local_disk: an L2 other servers may write to, so every lookup its index answers short (the prompts
never stored) waits for an L2 probe on the promotion pool (``server.lookup_probe_timeout_seconds``). Those lookups
are slow by design (their own probe); the figure that shows head-of-line blocking is the p99 of the *other*
lookups, printed separately (``hits`` vs ``misses``).

Two load models, each with its own same-run baseline (``--modes``, default both):
  paced      each client is an engine's scheduler, which looks up once per new request: Poisson arrivals at
             ``--rate-per-client`` lookups/s (default 20, a busy engine admitting 20 new requests a second),
             and the L2 process retrieves + stores at the same rate (an engine loads and saves about once per
             request). This is the figure issue 12's target is about.
  saturated  every client looks up back to back (``--interval-seconds`` apart, default 0.01) and the L2 process
             runs back to back: the server's capacity, and on a small machine a CPU-contention test (ten busy
             processes on the cores), not a model of engines.
Before the promotion pool, every lookup queued behind the promotion being served, 100 ms or more. Figures:
lookup p50 and p99 for each server, the promotions and L2 writes done meanwhile, the offered lookup rate, and
the ratio delayed / baseline of p99 (target: p99 <= 1 ms with the delay).

Transport floor (same run, each mode): the same client processes at the same pacing, drawing prompts the same way
(the same seeds: a pool prompt, or one time in eight a fresh one), build the same ``Lookup`` from the token list
(``P.pack_tokens`` + ``P.encode``, as ``Client.lookup`` does) and send it over loopback TCP from a pyzmq DEALER to a
bare pyzmq ROUTER loop in Python that answers each with the encoded ``LookupReply`` kvtier sends (no kvtier);
the client decodes it. Both sockets use CurveZMQ as the kvtier servers do (``--no-auth``: neither). So the floor
is what this request/reply costs on this machine in Python, and the kvtier figure over it is the kvtier client's
bookkeeping plus the server's work (``--no-floor`` skips it). ``--loaded-floor`` measures it once more while the L2
process drives a kvtier server of its own: the L2 traffic then shares the machine's cores with the floor's round
trips but not the lookups' server, so kvtier over that floor is what the lookups' server adds, and the loaded floor
over the plain one is what a small machine's cores add.

Run: ``.venv/bin/python benchmarks/bench_lookup_hol.py`` (defaults: 8 clients, 0.1 s, 20 s per server, both modes).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import random
import socket
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import redis

from kvtier_harness.kvtier_server import ServerProcess
from kvtier_harness.metrics import metric_sum
from kvtier.client import Client
from kvtier.layout import KVLayout
from kvtier.zmq_context import Context
from lookup_floor import CHUNK, curve_keys, echo_server, floor_lookup, floor_socket

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)  # lookup cost does not depend on the KV size
MODEL = "bench-hol"


def prompts(count: int, chunks: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 50_000, chunks * CHUNK).tolist() for _ in range(count)]


def kv_for(tokens: list[int]) -> np.ndarray:
    return np.full(LAYOUT.chunk_shape(len(tokens)), tokens[0] % 97, dtype=LAYOUT.numpy_dtype())


def start_server(work: str, delay_seconds: float, l1_bytes: int, inner: dict | None = None,
                 auth: bool = True) -> ServerProcess:
    """A ``kvtier server`` whose L2 (``inner``, default local disk) answers every call after ``delay_seconds``;
    CurveZMQ on unless ``auth`` is False."""
    inner = inner or {"type": "local_disk", "path": f"{work}/l2-{time.monotonic_ns()}"}
    spec = {"type": "faulty", "latency_seconds": delay_seconds, "inner": inner}
    return ServerProcess(Path(work), CHUNK, f"{l1_bytes}B", l2=spec,
                         extra=("--log-level", "ERROR", *(() if auth else ("--no-auth",))), startup_timeout_seconds=120)


def counter(server: ServerProcess, name: str) -> float:
    return metric_sum(server.metrics_text(), name)


def pause(rng, rate: float, interval_seconds: float, due: float) -> float:
    """Sleep until the next arrival; returns its time. ``rate`` > 0: Poisson arrivals (``due`` advances by an
    exponential gap, so a slow call does not lower the offered rate); otherwise a fixed ``interval_seconds`` pause."""
    if rate <= 0:
        time.sleep(interval_seconds)
        return time.monotonic()
    due += rng.exponential(1 / rate)
    time.sleep(max(0.0, due - time.monotonic()))
    return due


def paced(rng, duration: float, rate: float, interval: float):
    """Yield once per call for ``duration`` seconds, at ``pause``'s arrivals, after a random phase (engines are not
    in phase). Turns this process's garbage collector off: a collection here is not the server's latency."""
    end = time.monotonic() + duration
    gc.disable()
    due = time.monotonic() + (rng.uniform(0, 1 / rate) if rate > 0 else 0)
    time.sleep(max(0.0, due - time.monotonic()))
    while time.monotonic() < end:
        yield
        due = pause(rng, rate, interval, due)


def lookup_loop(url: str, pool: list[list[int]], duration: float, rate: float, interval: float, seed: int,
                start, out) -> None:
    rng = np.random.default_rng(seed)
    lat, kinds = {"hit": [], "miss": []}, {"hit": 0, "miss": 0}
    with Client(url, model=MODEL, layout=LAYOUT, timeout_seconds=30) as client:
        client.ping()
        start.wait()  # every process imported and connected: start-up is not part of the load
        for _ in paced(rng, duration, rate, interval):
            fresh = rng.random() < 1 / 8  # never stored: a miss past every index, probed in the background
            tokens = rng.integers(0, 50_000, len(pool[0])).tolist() if fresh else pool[rng.integers(len(pool))]
            t0 = time.perf_counter()
            n = client.lookup(tokens)
            lat["hit" if n else "miss"].append(time.perf_counter() - t0)
            kinds["hit" if n else "miss"] += 1
    out.put((lat, kinds))


def l2_loop(url: str, pool: list[list[int]], duration: float, rate: float, seed: int, start, out,
            busy: bool = True) -> None:
    """The engines' loads and saves (``busy`` False, ``--no-l2-load``: none, only the lookups)."""
    rng = random.Random(seed)
    gaps = np.random.default_rng(seed)
    done = {"retrieves": 0, "stores": 0}
    if not busy:
        start.wait()
        out.put(done)
        return
    with Client(url, model=MODEL, layout=LAYOUT, timeout_seconds=30) as client:
        client.ping()
        start.wait()
        end = time.monotonic() + duration
        due = time.monotonic()
        while time.monotonic() < end:
            if rate > 0:  # an engine's loads and saves, about one each per request
                due = pause(gaps, rate, 0.0, due)
            client.retrieve(rng.choice(pool))  # mostly L2-only: promoted through the slow adapter
            fresh = gaps.integers(0, 50_000, len(pool[0])).tolist()  # cheap: this process shares the CPUs
            client.store(fresh, kv_for(fresh))  # written through it, and evicts older prompts from L1
            done["retrieves"] += 1
            done["stores"] += 1
    out.put(done)


def echo_loop(url: str, keys: dict | None, pool: list[list[int]], duration: float, rate: float, interval: float,
              seed: int, start, out) -> None:
    rng = np.random.default_rng(seed)
    ctx = Context()
    sock = floor_socket(ctx, url, keys)
    floor_lookup(sock, pool[0])
    start.wait()
    lat = []
    for _ in paced(rng, duration, rate, interval):
        fresh = rng.random() < 1 / 8  # prompts drawn as lookup_loop draws them
        tokens = rng.integers(0, 50_000, len(pool[0])).tolist() if fresh else pool[rng.integers(len(pool))]
        t0 = time.perf_counter()
        floor_lookup(sock, tokens)
        lat.append(time.perf_counter() - t0)
    sock.close(0)
    ctx.term()
    out.put(lat)


def floor(rate: float, args, pool, work: str | None = None) -> dict:
    """The transport floor: p50 / p99 of bare pyzmq round trips of the same requests (module docstring). With
    ``work`` (``--loaded-floor``), the L2 process meanwhile drives a kvtier server of its own (no delay), so the
    floor's round trips share the machine with the same L2 traffic as the measured lookups."""
    if work is None:
        return _floor(rate, args, pool, None)
    loaded, inner = start_filled(work, 0.0, args, pool)
    try:
        return _floor(rate, args, pool, loaded)
    finally:
        stop_filled(loaded, inner, args)


def _floor(rate: float, args, pool, loaded: ServerProcess | None) -> dict:
    ctx = mp.get_context("spawn")
    with socket.socket() as probe:  # a free loopback TCP port, as the kvtier server's
        probe.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    stop, out, l2_out, start = ctx.Event(), ctx.Queue(), ctx.Queue(), ctx.Barrier(args.clients + 1)
    keys = curve_keys(not args.no_auth)
    server = ctx.Process(target=echo_server, args=(url, stop, keys))
    server.start()
    procs = [ctx.Process(target=echo_loop, args=(url, keys, pool, args.duration, rate, args.interval_seconds, i, start,
                                                 out))
             for i in range(args.clients)]
    if loaded is None:
        procs.append(ctx.Process(target=start.wait))  # the L2 process's place in the barrier
    else:
        procs.append(ctx.Process(target=l2_loop, args=(loaded.url, pool, args.duration, rate, 99, start, l2_out)))
    for p in procs:
        p.start()
    lat = np.array([x for _ in range(args.clients) for x in out.get(timeout=args.duration + 300)])
    if loaded is not None:
        l2_out.get(timeout=args.duration + 300)
    stop.set()
    for p in [*procs, server]:
        p.join(60)
    return {"lookups": len(lat), "p50_milliseconds": float(np.percentile(lat, 50) * 1e3),
            "p99_milliseconds": float(np.percentile(lat, 99) * 1e3)}


def start_filled(work: str, delay_seconds: float, args, pool) -> tuple[ServerProcess, dict | None]:
    """A server (``start_server``) holding every prompt of ``pool`` in L2 and the most recent quarter in L1; returns
    it and its wrapped adapter's spec (a Redis one under a fresh prefix, for ``stop_filled``; None: local disk)."""
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK)
    l1_bytes = max(len(pool) * args.chunks * chunk_bytes // 4, 4 * args.chunks * chunk_bytes)
    inner = {"type": "redis", "url": args.redis_url, "prefix": f"bench-hol-{uuid.uuid4().hex}/"} \
        if args.l2 == "redis" else None
    server = start_server(work, delay_seconds, l1_bytes, inner, auth=not args.no_auth)
    try:
        with Client(server.url, model=MODEL, layout=LAYOUT, timeout_seconds=60) as setup:
            for tokens in pool:  # every prompt in L2 (one at a time: a full write queue drops writes)
                setup.store(tokens, kv_for(tokens))  # L1 keeps the most recent quarter
                assert setup.flush(300), "L2 writes did not finish"
    except BaseException:
        stop_filled(server, inner, args)
        raise
    return server, inner


def stop_filled(server: ServerProcess, inner: dict | None, args) -> None:
    """Stop a ``start_filled`` server and delete what it wrote to Redis."""
    server.stop(60)
    if inner is not None:
        with redis.Redis.from_url(args.redis_url) as r:
            for key in r.scan_iter(match=inner["prefix"] + "*", count=1000):
                r.delete(key)


def measure(work: str, delay_seconds: float, rate: float, args, pool) -> dict:
    server, inner = start_filled(work, delay_seconds, args, pool)
    url = server.url
    try:
        ctx = mp.get_context("spawn")
        out, l2_out, start = ctx.Queue(), ctx.Queue(), ctx.Barrier(args.clients + 1)
        promoted_before = counter(server, "kvtier_l2_promoted_chunks_total")
        procs = [ctx.Process(target=lookup_loop, args=(url, pool, args.duration, rate, args.interval_seconds, i, start,
                                                          out))
                 for i in range(args.clients)]
        procs.append(ctx.Process(target=l2_loop, args=(url, pool, args.duration, rate, 99, start, l2_out,
                                                     not args.no_l2_load)))
        for p in procs:
            p.start()
        results = [out.get(timeout=args.duration + 300) for _ in range(args.clients)]
        l2_done = l2_out.get(timeout=args.duration + 300)
        for p in procs:
            p.join(60)
        promoted = counter(server, "kvtier_l2_promoted_chunks_total") - promoted_before
        probes = counter(server, "kvtier_lookup_probes_total")
    finally:
        stop_filled(server, inner, args)
    lat = np.array([x for r in results for kind in ("hit", "miss") for x in r[0][kind]])
    hit_lat = np.array([x for r in results for x in r[0]["hit"]])
    miss_lat = np.array([x for r in results for x in r[0]["miss"]] or [0.0])
    hits = sum(r[1]["hit"] for r in results)
    misses = sum(r[1]["miss"] for r in results)
    return {"delay_seconds": delay_seconds, "lookups": len(lat), "lookups_per_second": len(lat) / args.duration,
            "hits": hits, "misses": misses, "promoted": promoted,
            "l2_loop": l2_done, "probes": probes,
            "p50_milliseconds": float(np.percentile(lat, 50) * 1e3), "p99_milliseconds": float(np.percentile(lat, 99) * 1e3),
            "max_milliseconds": float(lat.max() * 1e3), "hit_p99_milliseconds": float(np.percentile(hit_lat, 99) * 1e3),
            "miss_p99_milliseconds": float(np.percentile(miss_lat, 99) * 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--delay-seconds", type=float, default=0.1)
    ap.add_argument("--l2", choices=("local_disk", "redis"), default="local_disk",
                    help="the adapter the delay wraps; redis: an L2 other servers write to (lookups are probed)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of client load per server")
    ap.add_argument("--modes", default="paced,saturated", help="comma-separated: paced, saturated")
    ap.add_argument("--rate-per-client", type=float, default=20.0,
                    help="paced: lookups per second per client (Poisson), and the L2 process's retrieves + stores")
    ap.add_argument("--interval-seconds", type=float, default=0.01, help="saturated: pause between a client's lookups")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 256 tokens per prompt")
    ap.add_argument("--no-floor", action="store_true", help="skip the transport floor (bare pyzmq round trips)")
    ap.add_argument("--no-auth", action="store_true", help="servers and floor without CurveZMQ (default: both with it)")
    ap.add_argument("--loaded-floor", action="store_true",
                    help="also measure the floor while the L2 process drives a kvtier server of its own: the share of "
                         "the figure that is the machine's, not the lookups' server's")
    ap.add_argument("--no-l2-load", action="store_true",
                    help="no retrieves and stores meanwhile: the lookups alone, as the floor's clients")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if set(modes) - {"paced", "saturated"} or args.rate_per_client <= 0:
        ap.error("--modes takes paced and/or saturated; --rate-per-client must be positive")
    pool = prompts(args.prompts, args.chunks)
    results, floors, loaded_floors = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="kvtier-hol-") as work:
        for mode in modes:
            rate = args.rate_per_client if mode == "paced" else 0.0
            results[mode] = [measure(work, 0.0, rate, args, pool), measure(work, args.delay_seconds, rate, args, pool)]
            floors[mode] = None if args.no_floor else floor(rate, args, pool)
            loaded_floors[mode] = floor(rate, args, pool, work) if args.loaded_floor and not args.no_l2_load else None
    for mode, rows in results.items():
        offered = (f"Poisson {args.rate_per_client:g}/s per client" if mode == "paced"
                   else f"back to back, {args.interval_seconds:g} s apart")
        print(f"{mode} ({args.clients} clients, {offered}):")
        for r in rows:
            print(f"  L2 delay {r['delay_seconds'] * 1e3:5.0f} ms: {r['lookups']} lookups ({r['lookups_per_second']:.0f}/s; "
                  f"{r['hits']} hits, {r['misses']} misses) p50 {r['p50_milliseconds']:.3f} ms, p99 "
                  f"{r['p99_milliseconds']:.3f} ms (hits {r['hit_p99_milliseconds']:.3f} ms, misses "
                  f"{r['miss_p99_milliseconds']:.3f} ms), max {r['max_milliseconds']:.1f} ms; meanwhile "
                  f"{r['l2_loop']['retrieves']} retrieves promoted {r['promoted']:.0f} chunks and "
                  f"{r['l2_loop']['stores']} prompts were stored; {r['probes']:.0f} lookups waited for an L2 probe")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for mode, (base, slow) in results.items():
        print(f"{mode}: ratio p99 delayed / baseline: {slow['p99_milliseconds'] / base['p99_milliseconds']:.2f}x; "
              f"p99 with a {args.delay_seconds * 1e3:g} ms adapter: {slow['p99_milliseconds']:.3f} ms (target <= 1 ms); hits alone "
              f"{slow['hit_p99_milliseconds']:.3f} vs {base['hit_p99_milliseconds']:.3f} ms (L2 {args.l2})")
        if floors[mode]:
            f = floors[mode]
            print(f"{mode}: transport floor (bare pyzmq round trips of the same requests, same clients and pacing, "
                  f"CurveZMQ {'off' if args.no_auth else 'on'} as for the servers, {f['lookups']} round trips): p50 "
                  f"{f['p50_milliseconds']:.3f} ms, p99 {f['p99_milliseconds']:.3f} ms; kvtier p99 / floor p99: "
                  f"{base['p99_milliseconds'] / f['p99_milliseconds']:.2f}x (no delay), "
                  f"{slow['p99_milliseconds'] / f['p99_milliseconds']:.2f}x (slow adapter); p50: "
                  f"{base['p50_milliseconds'] / f['p50_milliseconds']:.2f}x, {slow['p50_milliseconds'] / f['p50_milliseconds']:.2f}x")
        if loaded_floors[mode]:
            f = loaded_floors[mode]
            print(f"{mode}: transport floor under the same L2 traffic (driving a kvtier server of its own meanwhile, "
                  f"{f['lookups']} round trips): p50 {f['p50_milliseconds']:.3f} ms, p99 {f['p99_milliseconds']:.3f} ms; "
                  f"kvtier p99 / loaded floor p99: {base['p99_milliseconds'] / f['p99_milliseconds']:.2f}x (no delay), "
                  f"{slow['p99_milliseconds'] / f['p99_milliseconds']:.2f}x (slow adapter)")


if __name__ == "__main__":
    main()
