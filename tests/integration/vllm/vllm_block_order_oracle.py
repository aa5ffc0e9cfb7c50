"""Run with the vLLM environment's python (``test_vllm_block_order.py`` does): vLLM 0.32's own
``cpu_attn_reshape_and_cache`` writes KV into paged caches for several dtypes, block sizes and head sizes (the
instruction set the engine would pick on this machine), and kvtier's copies (``kvtier.connectors.vllm_layout``)
must read exactly that KV back in kvtier's order and write blocks exactly as vLLM's kernel does. Prints one line
``ORACLE <json>``: a row per case."""

from __future__ import annotations

import json

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvtier.connectors.vllm_layout import block_views, engine_block_order, gather_chunk, scatter_chunk

HEADS, NUM_BLOCKS = 2, 6


def case(dtype: torch.dtype, block_size: int, head_dim: int) -> dict:
    isa = _get_attn_isa(dtype, block_size, head_dim)
    order = engine_block_order(dtype, block_size, head_dim)
    tokens = 3 * block_size
    g = torch.Generator().manual_seed(block_size + head_dim)
    kv = torch.randn(2, 2, tokens, HEADS, head_dim, generator=g).to(dtype)  # (layers, K/V, tokens, heads, dim)
    ids = [4, 1, 3]
    slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in ids])
    caches = []
    for layer in range(2):  # vLLM's kernel writes the blocks
        cache = torch.zeros(NUM_BLOCKS, HEADS, block_size, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = cache.view(NUM_BLOCKS, HEADS, 2 * block_size, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(kv[layer, 0].contiguous(), kv[layer, 1].contiguous(), key_cache, value_cache,
                                       slots, isa)
        caches.append(cache)
    out = torch.empty_like(kv)
    gather_chunk(block_views(caches, order), ids, out)
    layer_out = torch.empty(2, tokens - 5, HEADS, head_dim, dtype=dtype)
    block_views(caches, order).gather_layer(1, ids, layer_out)
    written = [torch.zeros_like(c) for c in caches]
    scatter_chunk(block_views(written, order), ids, kv, 0, tokens)
    layerwise = torch.zeros_like(caches[0])
    block_views([layerwise], order).scatter_layer(0, ids, kv[0])
    return {"dtype": str(dtype), "block_size": block_size, "head_dim": head_dim, "isa": isa,
            "kinds": [order.kind(0), order.kind(1)],
            "gather_chunk": torch.equal(out, kv), "gather_layer": torch.equal(layer_out, kv[1, :, :tokens - 5]),
            "scatter_chunk": all(torch.equal(w, c) for w, c in zip(written, caches)),
            "scatter_layer": torch.equal(layerwise, caches[0]),
            "untransformed_gather_differs": not torch.equal(_plain_gather(caches, ids), kv)}


def _plain_gather(caches, ids) -> torch.Tensor:
    """What the connector read before block orders: every part taken as [block_size, head_dim]."""
    out = torch.empty(len(caches), 2, len(ids) * caches[0].shape[2], caches[0].shape[1], caches[0].shape[3] // 2,
                      dtype=caches[0].dtype)
    gather_chunk(block_views(caches), ids, out)
    return out


def main() -> None:
    rows = [case(dtype, block_size, head_dim) for dtype in (torch.float32, torch.bfloat16)
            for block_size in (16, 128) for head_dim in (64, 80)]
    print("ORACLE " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
