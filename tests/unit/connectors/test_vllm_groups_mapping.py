"""KV parts of hybrid models (``kvtier.connectors.vllm_groups``) without vLLM: the layout's ``group``, the window
arithmetic of sliding-window parts, the chunk-size check, and chunk keys that never mix groups in a real cache.

The same logic is checked against vLLM's own ``KVCacheConfig`` and ``KVCacheManager`` in
``tests/integration/vllm/test_vllm_groups.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.cache import KVCache
from kvtier.config import build_config
from kvtier.connectors.vllm_groups import FULL, SLIDING, KVGroups, KVPart
from kvtier.errors import ConfigError, InputError
from kvtier.layout import KVLayout

# Gemma-3-270M on vLLM CPU: five sliding-window groups (window 512) and one full-attention group, block size 128
SLIDING_LAYOUT = KVLayout(15, 1, 256, group="sliding_window/512/" + ",".join(
    str(g + 6 * k) for g in range(5) for k in range(3)))
FULL_LAYOUT = KVLayout(3, 1, 256, group="full_attention//5,11,17")


def _names(*indexes):
    return tuple(f"model.layers.{i}.self_attn.attn" for i in indexes)


def gemma3_groups(retained: int = 0) -> KVGroups:
    full = KVPart(FULL, None, 0, 128, ((5, _names(5, 11, 17)),), FULL_LAYOUT)
    sliding = KVPart(SLIDING, 512, retained, 128, tuple((g, _names(g, g + 6, g + 12)) for g in range(5)),
                     SLIDING_LAYOUT)
    return KVGroups((full, sliding), 6, 128)


def test_layout_group_is_part_of_the_id_and_optional_in_the_dict():
    plain = KVLayout(18, 1, 256)
    assert plain.layout_id == "ba9c7eca92673725"  # the id before groups existed: old keys stay valid
    assert KVLayout(30, 3, 64).layout_id == "0b78d52e1bebb6db"
    assert "group" not in plain.to_dict() and KVLayout.from_dict(plain.to_dict()) == plain
    ids = {plain.layout_id, SLIDING_LAYOUT.layout_id, FULL_LAYOUT.layout_id,
           KVLayout(15, 1, 256, group="sliding_window/1024/" + SLIDING_LAYOUT.group.split("/")[2]).layout_id,
           KVLayout(3, 1, 256, group="full_attention//5,17,11").layout_id}
    assert len(ids) == 5  # the window and the order of the layers are part of it
    assert KVLayout.from_dict(SLIDING_LAYOUT.to_dict()) == SLIDING_LAYOUT
    with pytest.raises(InputError, match="group must be a str"):
        KVLayout(1, 1, 4, group=3)


def test_sliding_window_skips_what_vllm_frees():
    _, sliding = gemma3_groups().parts
    # vLLM: skipped tokens = max(0, n - 512 + 1); whole blocks of 128 of them are the null block
    assert [sliding.skipped_blocks(n) for n in (0, 511, 638, 639, 640, 1024, 2000)] == [0, 0, 0, 1, 1, 4, 11]
    retained = gemma3_groups(retained=200).parts[1]
    assert retained.skipped_blocks(1024) == 2  # tokens kept below the window for spec decoding


def test_load_spans_full_prefix_and_sliding_window():
    full, sliding = gemma3_groups().parts
    assert full.load_span(0, 1792) == (0, 1792)
    assert sliding.load_span(0, 1792) == (1280, 1792)  # blocks 10..13: the window before 1792
    assert sliding.load_span(1536, 1792) == (1536, 1792)  # vLLM's own hit already covers part of the window
    assert sliding.load_span(0, 256) == (0, 256)  # the window reaches the start
    assert sliding.load_span(1792, 1792) == (1792, 1792)  # nothing to load


def test_store_spans_only_chunks_still_held():
    full, sliding = gemma3_groups().parts
    assert full.store_span(0, 2000, 256) == (0, 1792)  # one step: every block is still there
    assert sliding.store_span(0, 2000, 256) == (0, 1792)
    # chunked prefill: before this step 1024 tokens were computed, so vLLM freed blocks 0..3 (tokens < 512)
    assert full.store_span(1024, 1536, 256) == (0, 1536)
    assert sliding.store_span(1024, 1536, 256) == (512, 1536)
    assert sliding.store_span(1152, 1536, 256) == (768, 1536)  # block 4 freed too: chunk 512..768 is gone


def test_block_ids_per_group_and_refusal_of_null_blocks():
    full, sliding = gemma3_groups().parts
    tables = [[0, 0, 0, 0] + [100 * g + i for i in range(4, 14)] for g in range(5)] + [list(range(600, 614))]
    assert full.block_ids(tables, 0, 1792) == [list(range(600, 614))]
    assert sliding.block_ids(tables, 1280, 1792) == [[100 * g + i for i in range(10, 14)] for g in range(5)]
    with pytest.raises(InputError, match="KV cache group 0 has no KV blocks for tokens \\[256, 768\\)"):
        sliding.block_ids(tables, 256, 768)
    with pytest.raises(InputError, match="group 5"):
        full.block_ids(tables, 0, 2048)  # beyond the table
    assert [(g, s.start, s.stop) for g, s in sliding.layer_slices()] == [(g, 3 * g, 3 * g + 3) for g in range(5)]
    assert sliding.layer_names[:4] == list(_names(0, 6, 12, 1))


def test_load_end_is_the_shortest_part_hit_before_the_last_prompt_token():
    groups = gemma3_groups()
    assert groups.load_end(2000, [1792, 1792]) == 1792
    assert groups.load_end(2000, [1792, 1024]) == 1024
    assert groups.load_end(1792, [1792, 1792]) == 1664  # vLLM computes at least the last prompt token
    assert groups.load_end(100, [256, 256]) == 0
    with pytest.raises(InputError):
        groups.load_end(2000, [1792])


def test_chunk_size_check_lists_sizes_that_work():
    groups = gemma3_groups()
    groups.check_chunk_size(256)
    for bad in (0, 64, 192):
        with pytest.raises(ConfigError) as err:
            groups.check_chunk_size(bad)
        assert f"chunk_size {bad} is not a multiple" in str(err.value)
        assert "group 5: 128, group 0: 128" in str(err.value) and "use one of 128, 256, 384, 512" in str(err.value)


def test_chunk_keys_of_two_parts_never_mix(tmp_path):
    cfg = build_config({"chunk_size": 16, "l1_size_gb": "16MiB",
                        "l2_adapters": [{"type": "local_disk", "path": str(tmp_path)}]})
    full_layout = KVLayout(2, 1, 8, group="full_attention//1,3")
    sliding_layout = KVLayout(2, 1, 8, group="sliding_window/64/0,2")  # same shape, other layers
    tokens = list(range(500, 564))
    full = KVCache(cfg, "m", full_layout)
    sliding = KVCache(cfg, "m", sliding_layout, tiers=full.tiers)
    kv = np.random.default_rng(0).standard_normal(full_layout.chunk_shape(64)).astype(np.float32)
    assert full.store(tokens, kv) == 4 and full.flush(10)
    assert full.lookup(tokens) == 64 and sliding.lookup(tokens) == 0  # same tokens, same shape, other group
    with sliding.retrieve_chunks(tokens) as got:
        assert got.num_tokens == 0 and not got.chunks
    full.close()
    # from disk, in a new cache: still only the part that stored them
    fresh_sliding = KVCache(cfg, "m", sliding_layout)
    assert fresh_sliding.lookup(tokens) == 0
    fresh_full = KVCache(cfg, "m", full_layout, tiers=fresh_sliding.tiers)
    assert fresh_full.lookup(tokens) == 64
    fresh_sliding.close()
