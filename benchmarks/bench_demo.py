"""Demo TTFT: cold prefill vs warm reuse (same process) vs reuse from a second process.

Runs the ``kvtier demo`` flow (SmolLM2-135M-Instruct over a >= 2,000-token document) once per cache mode
and prints each TTFT and its ratio to the cold TTFT measured in the same run (the baseline: a full
prefill of the same prompt). Modes: ``off`` = in-process KVCache, the second process reads the local disk
tier; ``auto`` = a kvtier server started for the run, the second process reads its shared L1.
Targets (issue 2): warm <= 0.2x cold, cross-process <= 0.25x cold.

    .venv/bin/python benchmarks/bench_demo.py [--modes off,auto] [--rounds 4] [--document FILE]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kvtier.demo.run import run_demo

TARGETS = {"warm_ttft_seconds": 0.2, "cross_process_ttft_seconds": 0.25}


def report(mode: str, result: dict) -> None:
    s = result["summary"]
    cold = s["cold_ttft_seconds"]
    print(f"== cache mode {mode}: {result['document']}, prompt {s['num_prompt_tokens']} tokens, warm hit "
          f"{s['num_hit_tokens']} tokens, warm answer identical to cold: {s['outputs_identical']}")
    for row in result["rounds"]:
        print(f"  round {row['round']:>2} {row['where']:<19} prompt {row['num_prompt_tokens']:>5} "
              f"hit {row['num_hit_tokens']:>5}  TTFT {row['ttft_seconds']:7.3f} s  (lookup {row['lookup_seconds']:.3f}, "
              f"retrieve {row['retrieve_seconds']:.3f}, prefill {row['prefill_seconds']:.3f})")
    print(f"  cold TTFT (baseline)    {cold:7.3f} s")
    miss_lookup = result["rounds"][0]["lookup_seconds"]  # round 1 is cold: its lookup finds nothing
    print(f"  lookup with no hit      {miss_lookup * 1e3:7.3f} ms = {miss_lookup / cold * 100:.3f}% of cold TTFT "
          f"(target <= 2%): {'ok' if miss_lookup / cold <= 0.02 else 'MISSED'}")
    for key, target in TARGETS.items():
        ratio = s[key] / cold
        print(f"  {key:<23} {s[key]:7.3f} s = {ratio:.3f}x cold ({cold / s[key]:.1f}x faster), "
              f"target <= {target}x: {'ok' if ratio <= target else 'MISSED'}")
    print("  json:", json.dumps(s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="off,auto", help="comma-separated: off, auto, or a server URL")
    parser.add_argument("--rounds", type=int, default=4, help="rounds in the first process (warm = median of 2..N)")
    parser.add_argument("--document", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-document-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default torch's); the same for baseline and kvtier rounds")
    args = parser.parse_args()
    print(f"torch threads: {args.threads or torch.get_num_threads()}, load average: {os.getloadavg()}")
    for mode in args.modes.split(","):
        opts = {"document": args.document, "rounds": args.rounds, "chunk_size": None, "l1_size_gb": "1",
                "disk_path": None, "server": mode, "max_new_tokens": args.max_new_tokens,
                "max_document_tokens": args.max_document_tokens, "threads": args.threads, "events": False,
                "progress": False}
        report(mode, run_demo(opts))


if __name__ == "__main__":
    main()
