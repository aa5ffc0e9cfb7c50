"""kvtier simulate against real runs (issue 19 §3): the same workload through a real server per policy and L1 size,
each run traced, then every trace simulated at the size and policy it ran at; and the simulator's speed on 1M requests.

Workload (the shape of benchmarks/multi_round_qa.py, no model): ``--users`` users, ``--rounds`` rounds each. A
prompt is a system prompt every user shares, the user's own context, then every earlier question and answer, then
this round's question (seeded random token ids). Each turn does what the vLLM connector does through
``kvtier.client.Client``: lookup (``lookup_tiers``), retrieve what was found (``retrieve_chunks``), store the prompt
(``store_chunks``; the bytes are not filled: only what the cache holds matters). Rounds run one after another; the
users of a round run on ``--concurrency`` threads, in a shuffled order, so the server sees interleaved clients.

Per (policy, L1 size): a real ``kvtier server`` (``--l2-size-mb``: also a local-disk L2 of that size) with
``--trace-file``; the real hit rate is what the server answered the lookups (leading tokens held, L1 and L2, over the
tokens looked up, as the client saw it and as ``kvtier_lookup_hit_tokens_total`` counts it); the simulated one
is ``kvtier.trace.simulate`` over that run's trace at the same size and policy. Also: the trace of the first run
simulated at every other configuration (record once, size everything). Target: |real - simulated| <= 2 percentage
points for every policy.

Speed: the first run's trace (or ``--speed-from``'s) tiled (digests re-salted per copy, so copies are other users) to
``--speed-requests`` requests (plus the ``end`` records of their leases) and simulated once per policy at the middle
L1 size; printed as requests/s and seconds against the 60 s target, next to the time to only read and parse the same
file (the baseline in the same run).

Recording cost: the round trip of a lookup of 8,192 held tokens with the trace on vs off (two servers, alternating;
medians of ``--overhead-lookups``).

    .venv/bin/python benchmarks/bench_simulate.py [--users 16 --rounds 6 --concurrency 2]
        [--l1-size-mb 16,32,64 --policies LRU,ARC,S3FIFO --l2-size-mb 0] [--speed-requests 1000000]
        [--save-trace benchmarks/results/traces/multi_user.trace] [--chart docs/img/simulate_hit_rate.png] [--json]
        [--overhead-lookups 2000]
    .venv/bin/python benchmarks/bench_simulate.py --speed-from benchmarks/results/traces/multi_user.trace   # speed + overhead only
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from kvtier_harness.kvtier_server import ServerProcess
from kvtier_harness.metrics import metric_value
from kvtier.client import Client
from kvtier.layout import KVLayout
from kvtier.trace.format import encode_line, read_trace
from kvtier.trace.simulate import SimConfig, simulate

CHUNK = 256
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")  # 2048 bytes per token
MB = 1_000_000
VOCAB = 49152


def workload(users: int, rounds: int, system_tokens: int, context_tokens: int, turn_tokens: int,
             seed: int = 0) -> list[list[tuple[int, list[int]]]]:
    """Per round, the (user, prompt tokens) of every user, in the order they are sent."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(system_tokens)]
    history = {u: system + [rng.randrange(VOCAB) for _ in range(context_tokens)] for u in range(users)}
    out = []
    for _ in range(rounds):
        turn = []
        for u in rng.sample(range(users), users):
            question = [rng.randrange(VOCAB) for _ in range(turn_tokens)]
            turn.append((u, history[u] + question))
            history[u] = history[u] + question + [rng.randrange(VOCAB) for _ in range(turn_tokens)]  # + the answer
        out.append(turn)
    return out


def no_fill(start, dst) -> None:
    """The KV bytes are left as they are: hit rates depend on what is held, not on its values."""


def real_run(tmp: Path, plan, policy: str, l1_bytes: int, l2_bytes: int, concurrency: int) -> dict:
    trace = tmp / f"{policy}-{l1_bytes}-{l2_bytes}.trace"
    frac = {"max_reserved_fraction_per_client": 1.0, "max_reserved_fraction_per_principal": 1.0,
            "max_reserved_fraction_all_clients": 1.0}
    l2 = {"type": "local_disk", "path": str(tmp / f"disk-{policy}-{l1_bytes}"), "size_gb": f"{l2_bytes}B"} \
        if l2_bytes else None
    server = ServerProcess(tmp, CHUNK, f"{l1_bytes}B", l2=l2, config={"server": frac},
                           extra=("--eviction-policy", policy, "--trace-file", str(trace)))
    clients: list[Client] = []
    local = threading.local()
    totals = {"looked": 0, "l1": 0, "all": 0}

    def turn(tokens) -> tuple[int, int, int]:
        client = getattr(local, "client", None)
        if client is None:  # one client (one connection) per thread, as one per engine process
            client = local.client = Client(server.url, model="bench-simulate", layout=LAYOUT)
            clients.append(client)
        hits = client.lookup_tiers(tokens)
        if hits.num_tokens:
            with client.retrieve_chunks(tokens):
                pass
        client.store_chunks(tokens, no_fill)
        if l2:
            client.flush()  # the next lookup sees this store in L2 too, as the simulator's write-through does
        return len(tokens), hits.num_l1_tokens, hits.num_tokens

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for round_ in plan:
                for looked, l1, total in pool.map(turn, [tokens for _, tokens in round_]):
                    totals["looked"] += looked
                    totals["l1"] += l1
                    totals["all"] += total
        text = server.metrics_text()
    finally:
        for client in clients:
            client.close()
        server.stop()
    metric = {"cpu": metric_value(text, "kvtier_lookup_hit_tokens_total", medium="CPU"),
              "tokens": metric_value(text, "kvtier_lookup_tokens_total")}
    return {"policy": policy, "l1_bytes": l1_bytes, "l2_bytes": l2_bytes, "trace": trace,
            "seconds": time.perf_counter() - started,
            "real_l1": totals["l1"] / totals["looked"], "real": totals["all"] / totals["looked"],
            "metric_l1": metric["cpu"] / metric["tokens"], "trace_bytes": trace.stat().st_size}


def tile(src: Path, dst: Path, requests: int) -> int:
    """Write ``src``'s records, repeated with digests re-salted per copy (other users), tickets renumbered and times
    shifted, until ``requests`` requests (lookups, retrieves, prefetches, stores; the ``end`` records of their leases
    come on top). Returns the records written."""
    header, recs = read_trace(src)
    base = [r for _, r in recs]
    span = base[-1].t + 1.0
    tickets = max(r.ticket for r in base) + 1
    done = written = copy = 0
    with open(dst, "wb") as fh:
        fh.write(encode_line(header))
        while done < requests:
            salt = (copy * 0x9E3779B97F4A7C15) & (2**64 - 1)
            lines = []
            for r in base:
                if r.op != "end":
                    if done == requests:
                        continue  # only the ends of leases already begun
                    done += 1
                lines.append(encode_line(msgspec.structs.replace(
                    r, chunks=[c ^ salt for c in r.chunks], t=r.t + copy * span, session=f"{r.session}/{copy}",
                    ticket=r.ticket + copy * tickets if r.ticket else 0)))
            fh.write(b"".join(lines))
            written += len(lines)
            copy += 1
    return written


def speed(tmp: Path, src: Path, requests: int, policies: list[str], l1_bytes: int) -> dict:
    big = tmp / "tiled.trace"
    records = tile(src, big, requests)
    started = time.perf_counter()
    _, recs = read_trace(big)
    assert sum(1 for _ in recs) == records
    parse_seconds = time.perf_counter() - started
    out = {"requests": requests, "records": records, "trace_bytes": big.stat().st_size,
           "parse_seconds": parse_seconds, "policies": {}}
    for policy in policies:
        sim = simulate(big, [SimConfig(l1_bytes, policy)])
        out["policies"][policy] = {"seconds": sim.seconds, "requests_per_second": requests / sim.seconds,
                                   "hit_rate": sim.results[0][1].hit_rate}
    big.unlink()
    return out


def overhead(tmp: Path, lookups: int) -> dict:
    """Lookup round trip (8,192 tokens, all held) with the trace on vs off: two servers, lookups alternating between
    them so that load from other processes falls on both; medians."""
    plan = workload(1, 1, 0, 8192, 0)[0][0][1]
    servers, clients = [], []
    try:
        for on in (False, True):
            extra = ("--eviction-policy", "LRU", *(("--trace-file", str(tmp / "overhead.trace")) if on else ()))
            servers.append(ServerProcess(tmp, CHUNK, "64MB", extra=extra))
            clients.append(Client(servers[-1].url, model="bench-simulate", layout=LAYOUT))
            clients[-1].store_chunks(plan, no_fill)
        times: list[list[float]] = [[], []]
        for _ in range(lookups):
            for i, client in enumerate(clients):
                started = time.perf_counter()
                client.lookup(plan)
                times[i].append(time.perf_counter() - started)
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.stop()
    off, on = statistics.median(times[0]), statistics.median(times[1])
    return {"lookups": lookups, "off_seconds": off, "on_seconds": on, "ratio": on / off}


def chart(path: Path, trace: Path, runs: list[dict], policies: list[str], sizes_mb: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = min(sizes_mb) / 2, max(sizes_mb) * 2
    grid = [lo * (hi / lo) ** (i / 15) for i in range(16)]
    sim = simulate(trace, [SimConfig(round(s * MB), p) for p in policies for s in grid])
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, policy in enumerate(policies):
        colour = f"C{i}"
        pts = [(cfg.l1_size_bytes / MB, 100 * out.hit_rate) for cfg, out, _ in sim.results if cfg.policy == policy]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, label=f"{policy} simulated")
        real = [(r["l1_bytes"] / MB, 100 * r["real"]) for r in runs if r["policy"] == policy and not r["l2_bytes"]]
        ax.plot([p[0] for p in real], [p[1] for p in real], "o", color=colour, label=f"{policy} real server")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("L1 size (MB)")
    ax.set_ylabel("hit rate (% of looked-up tokens)")
    ax.set_ylim(0, 100)
    ax.set_title("kvtier simulate vs real runs (multi-user trace)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=768)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--turn-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--l1-size-mb", default="16,32,64")
    ap.add_argument("--l2-size-mb", default="0", help="local-disk L2 size per run (0: none)")
    ap.add_argument("--policies", default="LRU,ARC,S3FIFO")
    ap.add_argument("--speed-requests", type=int, default=1_000_000)
    ap.add_argument("--save-trace", type=Path, default=None, help="copy the first run's trace here")
    ap.add_argument("--speed-from", type=Path, default=None,
                    help="no real runs: the speed part over this trace (e.g. benchmarks/results/traces/multi_user.trace) and the "
                         "recording overhead")
    ap.add_argument("--chart", type=Path, default=None)
    ap.add_argument("--overhead-lookups", type=int, default=2000,
                    help="lookups per server for the recording overhead (trace on vs off); 0: skip")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [float(s) for s in args.l1_size_mb.split(",")]
    policies = args.policies.split(",")
    l2_bytes = round(float(args.l2_size_mb) * MB)
    plan = workload(args.users, args.rounds, args.system_tokens, args.context_tokens, args.turn_tokens)
    turns = sum(len(r) for r in plan)
    with tempfile.TemporaryDirectory(prefix="bench-simulate-") as tmp_name:
        tmp = Path(tmp_name)
        if args.speed_from:  # no real runs: the speed part over that trace, and the recording overhead
            status = report_speed(speed(tmp, args.speed_from, args.speed_requests, policies,
                                        round(sizes[len(sizes) // 2] * MB)), args.json) if args.speed_requests else 0
            if args.overhead_lookups:
                report_overhead(overhead(tmp, args.overhead_lookups))
            return status
        runs = [real_run(tmp, plan, p, round(s * MB), l2_bytes, args.concurrency) for p in policies for s in sizes]
        first = runs[0]["trace"]
        cross = simulate(first, [SimConfig(r["l1_bytes"], r["policy"], r["l2_bytes"] or None) for r in runs])
        for run, (_, out, _) in zip(runs, cross.results):
            own = simulate(run["trace"], [SimConfig(run["l1_bytes"], run["policy"], run["l2_bytes"] or None)])
            run["simulated"] = own.results[0][1].hit_rate
            run["traced"] = own.traced.hit_rate
            run["simulated_from_first"] = out.hit_rate
        if args.save_trace:
            args.save_trace.parent.mkdir(parents=True, exist_ok=True)
            args.save_trace.write_bytes(first.read_bytes())
        if args.chart:
            args.chart.parent.mkdir(parents=True, exist_ok=True)
            chart(args.chart, first, runs, policies, sizes)
        fast = speed(tmp, first, args.speed_requests, policies, round(sizes[len(sizes) // 2] * MB)) \
            if args.speed_requests else None
        cost = overhead(tmp, args.overhead_lookups) if args.overhead_lookups else None
    worst = max(abs(r["real"] - r["simulated"]) for r in runs)
    worst_cross = max(abs(r["real"] - r["simulated_from_first"]) for r in runs)
    if args.json:
        print(json.dumps({"turns": turns, "runs": [{k: (str(v) if isinstance(v, Path) else v) for k, v in r.items()}
                                                   for r in runs], "speed": fast, "overhead": cost, "worst_pp": 100 * worst,
                          "worst_cross_pp": 100 * worst_cross}, indent=2))
    else:
        print(f"workload: {args.users} users x {args.rounds} rounds = {turns} turns (lookup, retrieve when something is held, store), "
              f"concurrency {args.concurrency}, chunk {CHUNK} tokens, {LAYOUT.bytes_per_token} bytes/token")
        print("policy  L1 MB  L2 MB   real  (L1 only, /metrics)   simulated  diff pp   from run 1  diff pp   run s")
        for r in runs:
            print(f"{r['policy']:7} {r['l1_bytes'] / MB:6.1f} {r['l2_bytes'] / MB:6.1f} {100 * r['real']:6.2f}% "
                  f"({100 * r['real_l1']:6.2f}%, {100 * r['metric_l1']:6.2f}%)   {100 * r['simulated']:7.2f}% "
                  f"{100 * (r['simulated'] - r['real']):+7.2f}   {100 * r['simulated_from_first']:8.2f}% "
                  f"{100 * (r['simulated_from_first'] - r['real']):+7.2f}  {r['seconds']:6.1f}")
        print(f"worst |real - simulated|: {100 * worst:.2f} pp (same trace), {100 * worst_cross:.2f} pp "
              f"(run 1's trace at every configuration); target <= 2 pp")
        print(f"trace of run 1: {runs[0]['trace_bytes']:,} bytes")
        if fast:
            report_speed(fast, False)
        if cost:
            report_overhead(cost)
    ok = worst <= 0.02 and (fast is None or all(f["seconds"] <= 60 for f in fast["policies"].values()))
    return 0 if ok else 1


def report_overhead(cost: dict) -> None:
    print(f"recording: lookup of 8,192 held tokens, median of {cost['lookups']}: trace off "
          f"{1e3 * cost['off_seconds']:.3f} ms, on {1e3 * cost['on_seconds']:.3f} ms: {cost['ratio']:.2f}x")


def report_speed(fast: dict, as_json: bool) -> int:
    """Print the speed part; 0 when every policy met the 60 s target."""
    if as_json:
        print(json.dumps(fast, indent=2))
    else:
        print(f"speed: {fast['requests']:,} requests ({fast['records']:,} records with the ends of their leases, "
              f"{fast['trace_bytes'] / MB:.0f} MB of trace), read + parse only {fast['parse_seconds']:.1f} s")
        for policy, f in fast["policies"].items():
            print(f"  {policy:7} {f['seconds']:6.1f} s  {f['requests_per_second']:9,.0f} requests/s  "
                  f"{f['seconds'] / 60:.2f}x the 60 s target  {f['seconds'] / fast['parse_seconds']:.1f}x parse "
                  f"(hit rate {100 * f['hit_rate']:.1f}%)")
    return 0 if all(f["seconds"] <= 60 for f in fast["policies"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
