"""``scripts/gpu-check.sh`` on a machine without CUDA (its CPU branch, as CI runs it): every vLLM CUDA attention
backend x KV cache layout x dtype is stored through a real ``kvtier server`` from one layout and loaded into another,
bit-exact, with the same code the GPU run takes (``benchmarks/gpu_check.py``); the timings need a GPU and are skipped
there, which the output says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvtier.connectors.vllm_cuda_layouts import ATTENTION_BACKENDS, KV_CACHE_LAYOUTS

REPO = Path(__file__).resolve().parents[3]


def test_the_gpu_check_stores_and_loads_every_layout_bit_exact_on_cpu():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--quick"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = list(ATTENTION_BACKENDS)
    pairs = [(n, [m for m in names if ATTENTION_BACKENDS[m].packing == ATTENTION_BACKENDS[n].packing]) for n in names]
    # bf16 for every pair, fp8 where the backend and the one it loads into both take it
    fp8 = sum(all("fp8" in ATTENTION_BACKENDS[x].kv_cache_dtypes for x in (n, same[(same.index(n) + 1) % len(same)]))
              for n, same in pairs)
    cases = len(KV_CACHE_LAYOUTS) * (len(names) + fp8)
    assert re.search(rf"bit-exact: {cases} of {cases} ", proc.stdout), proc.stdout
    assert "no CUDA: timings skipped" in proc.stdout
