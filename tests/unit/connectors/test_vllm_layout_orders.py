"""``kvtier.connectors.vllm_layout``'s block orders on synthetic orders (no vLLM needed): a transposed and an
arbitrary permutation of each block part; ``tests/integration/vllm/test_vllm_block_order.py`` checks the orders of
vLLM's own kernels."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors.vllm_layout import BlockOrder, LayerBlocks, block_views, gather_chunk, scatter_chunk
from kvtier.errors import InputError

BS, HEADS, D = 8, 2, 4


def orders() -> dict[str, BlockOrder]:
    transposed = (torch.arange(D) * BS + torch.arange(BS)[:, None]).reshape(-1)
    shuffled = torch.randperm(BS * D, generator=torch.Generator().manual_seed(0))
    return {"tokens": BlockOrder(None, None, BS, D), "transposed": BlockOrder(transposed, None, BS, D),
            "permuted": BlockOrder(shuffled, transposed, BS, D)}


@pytest.mark.parametrize("name", ["tokens", "transposed", "permuted"])
def test_a_block_part_lives_where_its_order_says(name):
    order = orders()[name]
    assert order.kind(0) == name
    cache = torch.zeros(3, HEADS, BS, 2 * D)
    kv = torch.randn(1, 2, 2 * BS, HEADS, D)
    scatter_chunk(block_views([cache], order), [2, 0], kv, 0, 2 * BS)
    raw = cache.view(3, HEADS, 2, BS * D)
    for part, perm in enumerate((order.keys, order.values)):
        for j, block in enumerate((2, 0)):
            canonical = kv[0, part, j * BS:(j + 1) * BS].transpose(0, 1).reshape(HEADS, -1)  # (heads, t*D + d)
            where = torch.arange(BS * D) if perm is None else perm
            assert torch.equal(raw[block, :, part][:, where], canonical)
    assert not raw[1].any()  # a block not asked for stays untouched
    back = torch.empty_like(kv)
    gather_chunk(block_views([cache], order), [2, 0], back)
    assert torch.equal(back, kv)


def test_an_order_for_other_blocks_is_refused():
    with pytest.raises(InputError, match="block order"):
        LayerBlocks(torch.zeros(2, HEADS, 2 * BS, 2 * D), orders()["transposed"])
