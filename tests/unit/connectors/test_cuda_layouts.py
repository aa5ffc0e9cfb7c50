"""``kvtier.connectors.vllm_cuda_layouts`` on CPU tensors: every CUDA attention backend's KV cache in every vLLM
``KVCacheLayout``, fp16 / bf16 / fp8, whole and split kernel blocks, gathered to and scattered from kvtier's canonical
chunk through the device copy path (``connectors.device_copy``, its CPU branch). A chunk stored from one backend and
layout loads into any other of the same packing, and into transformers. ``tests/integration/vllm/
test_cuda_wheels.py`` checks the same copies against vLLM 0.33 / 0.34's own allocation and reads."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors.vllm_cuda_layouts import (
    ATTENTION_BACKENDS,
    KV_CACHE_LAYOUTS,
    PagedKV,
    allocate_paged,
    attention_backend,
    group_backend,
)
from kvtier.errors import InputError
from kvtier.layout import KVLayout

LAYERS, BLOCKS, HEADS, D, LATENT = 3, 7, 2, 8, 12
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8": torch.uint8}
IDS = [5, 0, 3]


def kv_layout(name: str, dtype: str) -> KVLayout:
    latent = ATTENTION_BACKENDS[name].packing == "latent"
    return KVLayout(LAYERS, 1 if latent else HEADS, LATENT if latent else D,
                    "float8_e4m3fn" if dtype == "fp8" else dtype, latent=latent)


def filled(layout, name, kv_cache_layout, dtype, block_size, kernel, seed=0) -> list[torch.Tensor]:
    caches = allocate_paged(layout, ATTENTION_BACKENDS[name], kv_cache_layout, BLOCKS, block_size, kernel,
                            cache_dtype=DTYPES[dtype])
    storage = caches[0].untyped_storage()
    raw = torch.tensor([], dtype=torch.uint8).set_(storage)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return caches


def expected(caches, layout, block_size, kernel) -> torch.Tensor:
    """The chunk of IDS read element by element from the logical ``[B, H, N, C]`` views (C: key then value, or the
    latent vector), manager block ``b`` being kernel blocks ``b * ratio ...``."""
    ratio = block_size // kernel
    out = torch.empty(layout.chunk_shape(len(IDS) * block_size), dtype=torch.uint8 if layout.element_size == 1
                      else caches[0].dtype)
    for layer, cache in enumerate(caches):
        for j, b in enumerate(IDS):
            for t in range(block_size):
                kb, n = b * ratio + t // kernel, t % kernel
                for part in range(layout.kv_parts):
                    out[layer, part, j * block_size + t] = cache[kb, :, n, part * layout.head_dim:(part + 1) * layout.head_dim]
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


CASES = [(name, lay, dtype) for name, b in ATTENTION_BACKENDS.items() for lay in KV_CACHE_LAYOUTS
         for dtype in DTYPES if dtype in b.kv_cache_dtypes]


@pytest.mark.parametrize("name,kv_cache_layout,dtype", CASES)
def test_gather_reads_what_the_backend_keeps_and_scatter_writes_it_back(name, kv_cache_layout, dtype):
    backend = ATTENTION_BACKENDS[name]
    kernel = min([*backend.block_sizes, *backend.block_multiples])
    layout = kv_layout(name, dtype)
    for block_size in (kernel, 2 * kernel):
        caches = filled(layout, name, kv_cache_layout, dtype, block_size, kernel)
        paged = PagedKV(caches, name, layout, block_size)
        assert paged.stacked is not None  # one allocation, layers a constant distance apart: one gather per chunk
        chunk = torch.empty(layout.chunk_shape(len(IDS) * block_size), dtype=getattr(torch, layout.dtype))
        paged.gather_chunk(IDS, chunk)
        want = expected(caches, layout, block_size, kernel)
        assert torch.equal(as_bytes(chunk), as_bytes(want))
        empty = allocate_paged(layout, backend, kv_cache_layout, BLOCKS, block_size, kernel, cache_dtype=DTYPES[dtype])
        PagedKV(empty, name, layout, block_size).scatter_chunk(IDS, chunk, 0, chunk.shape[2])
        assert torch.equal(as_bytes(expected(empty, layout, block_size, kernel)), as_bytes(want))
        untouched = [b for b in range(BLOCKS) if b not in IDS]
        ratio = block_size // kernel
        assert all(not as_bytes(c.unflatten(0, (BLOCKS, ratio))[untouched]).any() for c in empty)


@pytest.mark.parametrize("packing", ["kv", "latent"])
def test_a_chunk_stored_from_one_backend_and_layout_loads_into_every_other(packing):
    names = [n for n, b in ATTENTION_BACKENDS.items() if b.packing == packing]
    layout = kv_layout(names[0], "bfloat16")
    block_size = 128  # a size every backend's kernels take, or split into kernel blocks of
    source = filled(layout, names[0], "LBNHC", "bfloat16", block_size, 16 if packing == "kv" else 64, seed=3)
    chunk = torch.empty(layout.chunk_shape(len(IDS) * block_size), dtype=torch.bfloat16)
    PagedKV(source, names[0], layout, block_size).gather_chunk(IDS, chunk)
    for name in names:
        backend = ATTENTION_BACKENDS[name]
        kernel = min([*backend.block_sizes, *backend.block_multiples])
        for kv_cache_layout in KV_CACHE_LAYOUTS:
            caches = allocate_paged(layout, backend, kv_cache_layout, BLOCKS, block_size, kernel)
            target = PagedKV(caches, name, layout, block_size)
            target.scatter_chunk([5, 6, 1], chunk, 0, chunk.shape[2])  # a run of two blocks, then one
            back = torch.empty_like(chunk)
            target.gather_chunk([5, 6, 1], back)
            assert torch.equal(as_bytes(back), as_bytes(chunk)), (name, kv_cache_layout)


def test_partial_chunks_layers_and_unaligned_ranges():
    layout = kv_layout("FLASHINFER", "bfloat16")
    caches = filled(layout, "FLASHINFER", "LBHNC", "bfloat16", 16, 16, seed=5)
    paged = PagedKV(caches, "FLASHINFER", layout, 16)
    whole = torch.empty(layout.chunk_shape(48), dtype=torch.bfloat16)
    paged.gather_chunk(IDS, whole)
    partial = torch.empty(layout.chunk_shape(21), dtype=torch.bfloat16)  # a stored partial tail: 1 block + 5 tokens
    paged.gather_chunk(IDS, partial)
    assert torch.equal(as_bytes(partial), as_bytes(whole[:, :, :21]))
    layer = torch.empty(layout.chunk_shape(48)[1:], dtype=torch.bfloat16)
    paged.gather_layer(2, IDS, layer)
    assert torch.equal(as_bytes(layer), as_bytes(whole[2]))
    fresh = PagedKV(allocate_paged(layout, ATTENTION_BACKENDS["FLASHINFER"], "LBNHC", BLOCKS, 16), "FLASHINFER", layout, 16)
    fresh.scatter_layer(1, IDS, whole[1])
    fresh.gather_layer(1, IDS, layer)
    assert torch.equal(as_bytes(layer), as_bytes(whole[1]))
    fresh.scatter_chunk([4, 6], whole, 16, 48)  # tokens [16, 48) of the chunk: its last two blocks
    fresh.gather_layer(0, [4, 6], layer[:, :32])
    assert torch.equal(as_bytes(layer[:, :32]), as_bytes(whole[0, :, 16:]))
    with pytest.raises(InputError, match="not whole 16-token blocks"):
        fresh.scatter_chunk([4, 6], whole, 8, 40)
    with pytest.raises(InputError, match="48 tokens need 3 blocks, only 1 given"):
        fresh.scatter_chunk([4], whole, 0, 48)
    with pytest.raises(InputError, match="need 3 blocks"):
        fresh.gather_chunk([4, 6], whole)


def test_layers_in_separate_allocations_are_copied_one_by_one():
    layout = kv_layout("TRITON_ATTN", "float16")
    caches = [c.clone() for c in filled(layout, "TRITON_ATTN", "LBNHC", "float16", 16, 16, seed=7)]
    paged = PagedKV(caches, "TRITON_ATTN", layout, 16)
    assert paged.stacked is None
    chunk = torch.empty(layout.chunk_shape(48), dtype=torch.float16)
    paged.gather_chunk(IDS, chunk)
    assert torch.equal(as_bytes(chunk), as_bytes(expected(caches, layout, 16, 16)))


def test_unknown_backends_layouts_and_packings_are_refused_by_name():
    layout = kv_layout("FLASH_ATTN", "bfloat16")
    with pytest.raises(InputError, match="'ROCM_AITER_FA'.*will not guess"):
        attention_backend("ROCM_AITER_FA", layout)
    with pytest.raises(InputError, match="FLASHMLA keeps latent KV.*keys and values"):
        attention_backend("FLASHMLA", layout)
    nvfp4 = torch.zeros(BLOCKS, 2 * HEADS, 16, D, dtype=torch.uint8)  # FlashInfer nvfp4: K and V heads as head slots
    with pytest.raises(InputError, match="attention backend FLASHINFER.*shape"):
        PagedKV([nvfp4], "FLASHINFER", KVLayout(1, HEADS, D, "float8_e4m3fn"), 16)
    fp16 = allocate_paged(layout, ATTENTION_BACKENDS["FLASH_ATTN"], "LBNHC", BLOCKS, 16, cache_dtype=torch.float16)
    with pytest.raises(InputError, match="holds float16, the kvtier layout says bfloat16"):
        PagedKV(fp16, "FLASH_ATTN", layout, 16)
    with pytest.raises(InputError, match="do not make whole vLLM blocks of 24"):
        PagedKV(allocate_paged(layout, ATTENTION_BACKENDS["FLASH_ATTN"], "LBNHC", BLOCKS, 16), "FLASH_ATTN", layout, 24)
    with pytest.raises(InputError, match="unknown vLLM KV cache layout 'NHD'"):
        allocate_paged(layout, ATTENTION_BACKENDS["FLASH_ATTN"], "NHD", BLOCKS, 16)
    with pytest.raises(InputError, match="use attention backends"):
        group_backend({"a": "FLASH_ATTN", "b": "TRITON_ATTN"}, ["a", "b"])
    assert group_backend({"a": "FLASH_ATTN", "b": "FLASH_ATTN"}, ["a", "b"]) == "FLASH_ATTN"


def test_a_chunk_gathered_from_flash_attention_continues_a_transformers_prefill_exactly():
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=HEADS, head_dim=D, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    tokens = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        full = model(tokens).logits[0, 32:]
        prefix = model(tokens[:, :32], use_cache=True).past_key_values
    layout = KVLayout(LAYERS, HEADS, D, "float32")
    caches = allocate_paged(layout, ATTENTION_BACKENDS["FLASH_ATTN"], "LBNHC", BLOCKS, 16)
    for layer, cache in enumerate(caches):  # where FlashAttention's cache writer puts token t: block ids[t // 16]
        keys, values = cache.transpose(1, 2).split(D, dim=-1)
        for t in range(32):
            keys[[6, 2][t // 16], t % 16] = prefix.layers[layer].keys[0, :, t]
            values[[6, 2][t // 16], t % 16] = prefix.layers[layer].values[0, :, t]
    chunk = torch.empty(layout.chunk_shape(32))
    PagedKV(caches, "FLASH_ATTN", layout, 16).gather_chunk([6, 2], chunk)
    cache = DynamicCache(ddp_cache_data=[(chunk[i, 0].transpose(0, 1)[None], chunk[i, 1].transpose(0, 1)[None])
                                         for i in range(LAYERS)], config=cfg)
    with torch.no_grad():
        suffix = model(tokens[:, 32:], past_key_values=cache).logits[0]
    assert torch.allclose(suffix, full, atol=1e-5)
