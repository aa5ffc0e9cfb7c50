"""Run by ``test_vllm_groups.py`` with the vLLM environment's python (no engine is started).

Builds real ``KVCacheConfig`` objects with vLLM 0.32's own functions (``get_kv_cache_configs`` over per-layer
``FullAttentionSpec`` / ``SlidingWindowSpec``, the way the engine core does) for a two-group model, a Gemma-3-like
5:1 model, the same with the hybrid KV cache manager off, and a model whose groups get different block sizes;
reads them with ``kvtier.connectors.vllm_groups``; then drives vLLM's real scheduler-side ``KVCacheManager`` (loads
from a connector, a local prefix hit plus a load, chunked prefill) and compares the per-group block tables vLLM
builds with what kvtier's parts predict. Prints one JSON object of findings; the test asserts on it.

    .venv-vllm/bin/python tests/integration/vllm/vllm_groups_oracle.py SCRATCH_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import Gemma3TextConfig
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from vllm.v1.request import Request

from kvtier.connectors.vllm_groups import KVGroups
from kvtier.errors import ConfigError, InputError
from kvtier.layout import KVLayout

WINDOW, BLOCK = 64, 16
MAX_LEN = 1024


def vllm_config(folder: Path, hybrid: bool) -> VllmConfig:
    config = VllmConfig(model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True, max_model_len=MAX_LEN,
                                                 dtype="float32"),
                        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True))
    config.cache_config.kv_cache_layout = "LBHNC"  # vLLM CPU's; the engine core resolves it at startup
    config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    return config


def specs(pattern: str, head_sizes=(32, 32), chunked: bool = False) -> dict:
    """Per-layer specs as vLLM's attention layers report them: ``pattern`` has one letter per layer, ``s`` for
    sliding window and ``f`` for full attention (``head_sizes`` = (sliding, full))."""
    out = {}
    for i, kind in enumerate(pattern):
        name = f"model.layers.{i}.self_attn.attn"
        if kind == "f":
            out[name] = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=head_sizes[1], dtype=torch.float32)
        elif chunked:
            out[name] = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=head_sizes[0],
                                                  dtype=torch.float32, attention_chunk_size=WINDOW)
        else:
            out[name] = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=head_sizes[0],
                                          dtype=torch.float32, sliding_window=WINDOW)
    return out


def describe(groups: KVGroups) -> dict:
    return {"num_groups": groups.num_groups, "block_size": groups.block_size, "hybrid": groups.hybrid,
            "parts": [{"kind": p.kind, "window": p.window, "block_size": p.block_size, "group_ids": list(p.group_ids),
                       "layers": p.layer_names, "layout": p.layout.to_dict(), "layout_id": p.layout.layout_id,
                       "slices": [[g, s.start, s.stop] for g, s in p.layer_slices()]} for p in groups.parts]}


def chunk_checks(groups: KVGroups) -> dict:
    out = {}
    for size in (16, 32, 48, 64, 256):
        try:
            groups.check_chunk_size(size)
            out[str(size)] = "ok"
        except ConfigError as exc:
            out[str(size)] = str(exc)
    return out


def manager_for(kv_cache_config, config: VllmConfig) -> KVCacheManager:
    scheduler_bs, hash_bs = kv_cache_utils.resolve_kv_cache_block_sizes(kv_cache_config, config)
    return KVCacheManager(kv_cache_config, max_model_len=MAX_LEN, scheduler_block_size=scheduler_bs,
                          hash_block_size=hash_bs, enable_caching=True)


def request(name: str, tokens: list[int], hash_block_size: int) -> Request:
    hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, get_hash_fn_by_name("sha256"))
    return Request(name, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)


def tables(manager: KVCacheManager, req: Request) -> list[list[int]]:
    return [list(ids) for ids in manager.get_block_ids(req.request_id)]


def check_load(groups: KVGroups, manager: KVCacheManager, req: Request, end: int) -> dict:
    """Admit ``req`` as the scheduler does when the connector offers tokens up to ``end``; compare vLLM's block
    tables with the parts' ``load_span`` / ``skipped_blocks``."""
    computed, local = manager.get_computed_blocks(req)[:2]
    before = {bid for table in computed.get_block_ids() for bid in table}
    blocks = manager.allocate_slots(req, len(req.prompt_token_ids) - end, num_new_computed_tokens=local,
                                    new_computed_blocks=computed, num_external_computed_tokens=end - local)
    assert blocks is not None
    got = tables(manager, req)
    out = {"local_hit": local, "end": end, "parts": []}
    for part in groups.parts:
        lo, hi = part.load_span(local, end)
        ids = part.block_ids(got, lo, hi) if lo < hi else [[] for _ in part.group_ids]
        skipped = part.skipped_blocks(end)
        out["parts"].append({
            "span": [lo, hi],
            # the first `skipped` entries are vLLM's null block, every later one a real block
            "nulls_match": all(table[:skipped] == [0] * skipped and 0 not in table[skipped:]
                               for table in (got[g] for g in part.group_ids)),
            # the blocks to write are exactly the ones allocated for the load (not the local hit's, not later)
            "load_blocks_fresh": all(not (set(row) & before) for row in ids),
            "load_blocks_cover": all(row == got[g][lo // part.block_size:hi // part.block_size]
                                     for row, g in zip(ids, part.group_ids)),
        })
    req.num_computed_tokens = len(req.prompt_token_ids)
    return out


def check_chunked_prefill(groups: KVGroups, manager: KVCacheManager, req: Request, step: int, chunk: int) -> dict:
    """Schedule ``req`` ``step`` tokens at a time as the scheduler does; after each step compare which blocks vLLM
    still gives the request with what ``store_span`` says may be stored."""
    n, steps = len(req.prompt_token_ids), []
    stored = [0] * len(groups.parts)
    while req.num_computed_tokens < n:
        before = req.num_computed_tokens
        todo = min(step, n - before)
        assert manager.allocate_slots(req, todo) is not None  # frees what left the window, as in schedule()
        got = tables(manager, req)
        after = before + todo
        row = {"before": before, "after": after, "parts": []}
        for i, part in enumerate(groups.parts):
            lo, hi = part.store_span(before, after, chunk)
            ok = True
            for start in range(max(lo, stored[i]), hi, chunk):  # the chunks this step may store
                try:
                    part.block_ids(got, start, start + chunk)
                except InputError:
                    ok = False
            skipped = part.skipped_blocks(before)
            row["parts"].append({"span": [lo, hi], "chunks_held": ok,
                                 "nulls_match": all(got[g][:skipped] == [0] * skipped and 0 not in got[g][skipped:]
                                                    for g in part.group_ids)})
            stored[i] = max(stored[i], hi)
        steps.append(row)
        req.num_computed_tokens = after
    return {"steps": steps, "stored": stored}


def main() -> None:
    scratch = Path(sys.argv[1])
    folder = scratch / "gemma3-tiny"  # a real Gemma-3 text config (no weights: no engine starts here)
    Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
                     max_position_embeddings=MAX_LEN).save_pretrained(folder)
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
    base = KVLayout(12, 2, 32, "float32")
    cases = {
        "two_groups": ("sfsf", True, (32, 32)),
        "gemma3_like": ("sssssfsssssf", True, (32, 32)),
        "hybrid_off": ("sssssfsssssf", False, (32, 32)),
        "mixed_block_sizes": ("sfsf", True, (32, 64)),
    }
    result = {"cases": {}}
    for name, (pattern, hybrid, heads) in cases.items():
        config = vllm_config(folder, hybrid)
        layer_specs = specs(pattern, heads)
        (kv_cache_config,) = kv_cache_utils.get_kv_cache_configs(config, [layer_specs], [64 << 20])
        groups = KVGroups.from_vllm(kv_cache_config, base)
        found = {"vllm_groups": [[type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, g.layer_names]
                                 for g in kv_cache_config.kv_cache_groups],
                 "groups": describe(groups), "chunk_sizes": chunk_checks(groups)}
        if name in ("two_groups", "gemma3_like"):
            chunk = 2 * groups.block_size
            manager = manager_for(kv_cache_config, config)
            hash_bs = manager.block_pool.hash_block_size
            tokens = [(i * 7919) % 500 + 3 for i in range(300)]
            found["load"] = check_load(groups, manager, request("load", tokens, hash_bs), 192)
            first = request("first", list(tokens), hash_bs)
            found["chunked"] = check_chunked_prefill(groups, manager, first, 48, chunk)
            manager.free(first)
            # vLLM's own prefix cache now holds the first request's prompt (a sliding-window group keeps only the
            # window before the prompt's end: prefix_cache_retention_interval=0): a longer request with the same
            # start gets a local hit of 288 tokens, and the connector loads from there up to 352
            second = request("second", tokens + [7] * 100, hash_bs)
            found["local_then_load"] = check_load(groups, manager, second, 352)
        result["cases"][name] = found
    try:
        (cfg,) = kv_cache_utils.get_kv_cache_configs(vllm_config(folder, True), [specs("sfsf", chunked=True)], [64 << 20])
        KVGroups.from_vllm(cfg, base)
        result["unsupported"] = "accepted"
    except ConfigError as exc:
        result["unsupported"] = str(exc)
    print("ORACLE " + json.dumps(result))


if __name__ == "__main__":
    main()
