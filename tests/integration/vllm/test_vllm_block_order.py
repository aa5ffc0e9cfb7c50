"""kvtier's copies between vLLM CPU's paged blocks and its chunks, against vLLM 0.32's own cache writer.

Runs ``vllm_block_order_oracle.py`` with the vLLM environment's python (vLLM's ``cpu_attn_reshape_and_cache``
writes the blocks, no engine start) and checks, for float32 and bf16 KV, 16- and 128-token blocks and head sizes 64
and 80 (the instruction sets the engine picks on this machine: ``vec`` / ``vec16``, and ``amx`` for bf16 on AMX
machines): kvtier reads the KV vLLM wrote in its canonical order (keys included, which vLLM's kernels keep
transposed or packed), and writes blocks byte for byte as vLLM's kernel does.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from kvtier_harness.vllm import require_vllm

ORACLE = Path(__file__).with_name("vllm_block_order_oracle.py")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(VLLM_NO_USAGE_STATS="1")
    proc = subprocess.run([require_vllm(), str(ORACLE)], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ORACLE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("ORACLE "):])


def test_every_case_reads_and_writes_vllm_blocks_exactly(rows):
    assert len(rows) == 8
    for row in rows:
        for check in ("gather_chunk", "gather_layer", "scatter_chunk", "scatter_layer"):
            assert row[check], row


def test_vllm_keeps_keys_out_of_token_order(rows):
    """The reason for block orders: on every instruction set here the keys are not ``[block_size, head_dim]``,
    so reading the blocks as such (what the connector did before) gives other KV than vLLM wrote."""
    for row in rows:
        assert row["kinds"][0] != "tokens" and row["untransformed_gather_differs"], row
    float32 = [r for r in rows if r["dtype"] == "torch.float32"]
    assert all(r["kinds"] == ["transposed", "tokens"] for r in float32)
