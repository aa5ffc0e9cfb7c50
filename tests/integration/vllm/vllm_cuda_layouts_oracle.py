"""Run with the vLLM environment's python and ``PYTHONPATH=<.cache/vllm-wheels/VERSION>:<kvtier src>``
(``test_cuda_wheels.py`` does): the CUDA wheel's own ``vllm.v1.kv_cache_interface`` (it imports on CPU) allocates
each attention backend's KV cache in each ``KVCacheLayout`` for fp16, bf16 and fp8 and two block splits, and the
backend's own expression (``argv[1]``, JSON ``{backend: expression}`` read from its source by the test) reads keys
and values out of it; each backend class (``argv[2]``: ``{backend: class path}``) is imported where it imports on
CPU. kvtier must allocate the same tensors (``allocate_paged``), gather exactly what vLLM reads, and scatter exactly
where vLLM reads, leaving every other block alone. Prints one line ``ORACLE <json>``: a row per case, and the
classes.
"""

from __future__ import annotations

import importlib
import json
import sys
import types

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
    group_kernel_blocks,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.connectors.vllm_cuda_layouts import ATTENTION_BACKENDS, PagedKV, allocate_paged
from kvtier.layout import KVLayout

LAYERS, BLOCKS, HEADS, HEAD_DIM, LATENT_DIM = 3, 6, 2, 16, 24
DTYPES = {"float16": (torch.float16, "float16"), "bfloat16": (torch.bfloat16, "bfloat16"),
          "fp8": (torch.uint8, "float8_e4m3fn")}
IDS = [4, 1, 3]


def vllm_caches(spec, layout: KVCacheLayout, kernel: int) -> list[torch.Tensor]:
    """vLLM's per-layer views of one zeroed buffer (what ``allocate_kv_cache`` hands the connector)."""
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout, kernel)
    ratio = spec.block_size // kernel
    tensor = KVCacheTensor(size=LAYERS * BLOCKS * spec.page_size_bytes, layers=[f"l{i}" for i in range(LAYERS)],
                           layer_stride=strides[0], block_stride=strides[1] * ratio)
    buf = torch.zeros(tensor.size, dtype=torch.int8)
    return create_kv_cache_views(buf, spec, BLOCKS, layout, tensor, kernel_block_size=kernel)


def read(expression: str, cache: torch.Tensor, head_size: int) -> list[torch.Tensor]:
    """What the backend reads from one layer: ``[keys, values]`` (each ``[kernel blocks, N, H, D]``) or
    ``[latent]`` (``[kernel blocks, N, D]``), through its own expression."""
    got = eval(expression, {"kv_cache": cache, "self": types.SimpleNamespace(head_size=head_size)})
    return list(got) if isinstance(got, tuple) else [got.unsqueeze(2)]


def canonical(parts: list[torch.Tensor], ratio: int) -> torch.Tensor:
    """``(kv_parts, tokens of IDS, H, D)`` from what the backend reads (vLLM groups kernel blocks per block)."""
    out = []
    for part in parts:
        grouped = group_kernel_blocks(part, BLOCKS)
        if ratio == 1:
            grouped = grouped.unsqueeze(1)
        out.append(grouped[IDS].flatten(0, 2))
    return torch.stack(out)


def case(name: str, expression: str, layout: KVCacheLayout, dtype: str, block_size: int, kernel: int) -> dict:
    torch_dtype, kv_dtype = DTYPES[dtype]
    backend = ATTENTION_BACKENDS[name]
    latent = backend.packing == "latent"
    head_size = LATENT_DIM if latent else HEAD_DIM
    if latent:
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=torch_dtype,
                                cache_dtype_str=None if dtype != "fp8" else "fp8")
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=head_size, dtype=torch_dtype)
    row = {"backend": name, "layout": layout.name, "dtype": dtype, "block_size": block_size, "kernel": kernel}
    try:
        theirs = vllm_caches(spec, layout, kernel)
    except ValueError as exc:  # vLLM splits blocks into kernel blocks only in some layouts
        return {**row, "vllm_refused": str(exc)}
    kv_layout = KVLayout(LAYERS, 1 if latent else HEADS, head_size, kv_dtype, latent=latent)
    ours = allocate_paged(kv_layout, backend, layout.name, BLOCKS, block_size, kernel, cache_dtype=torch_dtype)
    same_alloc = all((tuple(a.shape), a.stride(), a.storage_offset(), a.dtype) ==
                     (tuple(b.shape), b.stride(), b.storage_offset(), b.dtype) for a, b in zip(theirs, ours))
    g = torch.Generator().manual_seed(block_size * 7 + kernel)
    base = theirs[0].untyped_storage()
    raw = torch.tensor([], dtype=torch.uint8).set_(base)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    ratio = block_size // kernel
    want = torch.stack([canonical(read(expression, c, head_size), ratio) for c in theirs])
    out = torch.empty(kv_layout.chunk_shape(len(IDS) * block_size), dtype=getattr(torch, kv_dtype))
    PagedKV(theirs, name, kv_layout, block_size).gather_chunk(IDS, out)
    fresh = vllm_caches(spec, layout, kernel)
    written = PagedKV(fresh, name, kv_layout, block_size)
    written.scatter_chunk(IDS, out, 0, out.shape[2])
    back = torch.stack([canonical(read(expression, c, head_size), ratio) for c in fresh])
    others = [b for b in range(BLOCKS) if b not in IDS]
    untouched = all(not group_kernel_blocks(c, BLOCKS)[others].view(torch.uint8).any() for c in fresh)
    return {**row, "same_alloc": same_alloc, "gather": torch.equal(out.view(torch.uint8), want.view(torch.uint8)),
            "scatter": torch.equal(back.view(torch.uint8), want.view(torch.uint8)), "untouched": untouched,
            "stacked": written.stacked is not None, "nonzero": bool(want.view(torch.uint8).any())}


def imported(class_path: str) -> dict:
    """What the backend class itself says, where it imports on this CPU machine (else why not)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return {"name": cls.get_name(), "kv_cache_dtypes": list(cls.supported_kv_cache_dtypes), "mla": cls.is_mla()}
    except Exception as exc:  # a CUDA-only dependency (flashinfer, a CUDA torch): the test reads its source
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def main() -> None:
    expressions, class_paths = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    classes = {name: imported(path) for name, path in class_paths.items()}
    rows = []
    for name, expression in expressions.items():
        backend = ATTENTION_BACKENDS[name]
        dtypes = [d for d in DTYPES if d in backend.kv_cache_dtypes]
        kernel = min([*backend.block_sizes, *backend.block_multiples])
        for layout in KVCacheLayout:
            for dtype in dtypes:
                for block_size in (kernel, 2 * kernel):
                    rows.append(case(name, expression, layout, dtype, block_size, kernel))
    print("ORACLE " + json.dumps({"rows": rows, "classes": classes}), flush=True)


if __name__ == "__main__":
    main()
