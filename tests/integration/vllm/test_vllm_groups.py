"""kvtier's view of vLLM's KV cache groups (``kvtier.connectors.vllm_groups``) against vLLM 0.32's own objects.

Runs ``vllm_groups_oracle.py`` with the vLLM environment's python (real ``KVCacheConfig`` objects built by vLLM's
``get_kv_cache_configs``, vLLM's real scheduler-side ``KVCacheManager``; no engine start) and checks: which layers
form which part, the parts' layouts and layout ids (keys never mix groups), the chunk-size check at startup, and
that the blocks kvtier would load and store for sliding-window and full-attention groups are exactly the blocks vLLM
allocates and still holds (a load from a connector, a local prefix hit plus a load, chunked prefill).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from kvtier_harness.vllm import require_vllm

from kvtier.layout import KVLayout

ORACLE = Path(__file__).with_name("vllm_groups_oracle.py")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    proc = subprocess.run([require_vllm(), str(ORACLE), str(tmp_path_factory.mktemp("groups"))], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ORACLE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("ORACLE "):])


def _layers(names):
    return [int(n.split(".")[2]) for n in names]


def test_two_group_model_parts_layouts_and_keys(oracle):
    case = oracle["cases"]["two_groups"]
    assert [(kind, bs, _layers(names)) for kind, bs, names in case["vllm_groups"]] == [
        ("SlidingWindowSpec", 16, [0, 2]), ("FullAttentionSpec", 16, [1, 3])]
    groups = case["groups"]
    assert groups["num_groups"] == 2 and groups["hybrid"] and groups["block_size"] == 16
    full, sliding = groups["parts"]
    assert (full["kind"], full["window"], full["group_ids"], _layers(full["layers"])) == ("full_attention", None, [1],
                                                                                         [1, 3])
    assert (sliding["kind"], sliding["window"], sliding["group_ids"], _layers(sliding["layers"])) == (
        "sliding_window", 64, [0], [0, 2])
    assert full["layout"] == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "float32", "tp_size": 1,
                              "tp_rank": 0, "group": "full_attention//1,3"}
    assert sliding["layout"]["group"] == "sliding_window/64/0,2"
    # every part's id is its layout's, and no two parts (nor the whole model's plain layout) share one
    ids = {p["layout_id"] for p in groups["parts"]}
    assert ids == {KVLayout.from_dict(p["layout"]).layout_id for p in groups["parts"]}
    assert len(ids | {KVLayout(2, 2, 32).layout_id, KVLayout(4, 2, 32).layout_id}) == 4


def test_gemma3_like_groups_merge_into_one_sliding_part(oracle):
    case = oracle["cases"]["gemma3_like"]
    assert [(kind, _layers(names)) for kind, _, names in case["vllm_groups"]] == [
        ("SlidingWindowSpec", [g, g + 6]) for g in range(5)] + [("FullAttentionSpec", [5, 11])]
    full, sliding = case["groups"]["parts"]
    assert full["group_ids"] == [5] and full["layout"]["num_layers"] == 2
    assert sliding["group_ids"] == [0, 1, 2, 3, 4] and sliding["layout"]["num_layers"] == 10
    # group after group along the layer axis: each group's layers are one contiguous slice
    assert _layers(sliding["layers"]) == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10]
    assert sliding["slices"] == [[g, 2 * g, 2 * g + 2] for g in range(5)]
    assert sliding["layout"]["group"] == "sliding_window/64/0,6,1,7,2,8,3,9,4,10"


def test_hybrid_manager_off_is_one_plain_part_with_the_keys_of_before(oracle):
    case = oracle["cases"]["hybrid_off"]
    assert [(kind, len(names)) for kind, _, names in case["vllm_groups"]] == [("FullAttentionSpec", 12)]
    (part,) = case["groups"]["parts"]
    assert not case["groups"]["hybrid"] and part["kind"] == "full_attention" and "group" not in part["layout"]
    assert part["layout_id"] == KVLayout(12, 2, 32).layout_id  # the id a single-group model always had
    assert _layers(part["layers"]) == list(range(12))


def test_chunk_size_must_be_a_multiple_of_every_groups_block_size(oracle):
    case = oracle["cases"]["mixed_block_sizes"]
    # vLLM gives the sliding layers (half the page per token) twice the block size to unify page sizes
    assert [(kind, bs) for kind, bs, _ in case["vllm_groups"]] == [("SlidingWindowSpec", 32), ("FullAttentionSpec", 16)]
    assert case["groups"]["block_size"] == 32
    checks = case["chunk_sizes"]
    assert checks["32"] == checks["64"] == checks["256"] == "ok"
    for bad in ("16", "48"):
        assert f"chunk_size {bad} is not a multiple of every KV cache group's block size" in checks[bad]
        assert "group 1: 16, group 0: 32" in checks[bad] and "use one of 32, 64, 96, 128" in checks[bad]
    assert oracle["cases"]["two_groups"]["chunk_sizes"]["48"] == "ok"  # one block size (16): 48 works there


def test_loads_write_exactly_the_blocks_vllm_allocates(oracle):
    for name in ("two_groups", "gemma3_like"):
        load = oracle["cases"][name]["load"]
        assert load["local_hit"] == 0 and load["end"] == 192
        full, sliding = load["parts"]
        assert full["span"] == [0, 192]
        assert sliding["span"] == [128, 192]  # window 64 before 192: blocks 8..11; blocks 0..7 are the null block
        local = oracle["cases"][name]["local_then_load"]
        assert local["local_hit"] == 288 and local["end"] == 352
        assert [p["span"] for p in local["parts"]] == [[288, 352], [288, 352]]
        for part in load["parts"] + local["parts"]:
            assert part["nulls_match"] and part["load_blocks_fresh"] and part["load_blocks_cover"], (name, part)


def test_stores_read_only_blocks_the_request_still_holds(oracle):
    for name in ("two_groups", "gemma3_like"):
        chunked = oracle["cases"][name]["chunked"]
        spans = [[p["span"] for p in step["parts"]] for step in chunked["steps"]]
        # 48-token steps, 32-token chunks, window 64: the sliding part's stored range starts at the first chunk
        # whose blocks vLLM has not freed before the step
        assert spans[2] == [[0, 128], [32, 128]] and spans[5] == [[0, 288], [192, 288]]
        for step in chunked["steps"]:
            for part in step["parts"]:
                assert part["chunks_held"] and part["nulls_match"], (name, step)
        assert chunked["stored"] == [288, 288]


def test_unsupported_group_kinds_are_refused_by_name(oracle):
    message = oracle["unsupported"]
    assert "ChunkedLocalAttentionSpec" in message and "serve this model without kvtier" in message
