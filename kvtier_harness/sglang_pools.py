"""SGLang's real storage parts on CPU tensors, for the SGLang tests' driver and the SGLang benchmark.

Imported only by code running in the SGLang environment (``.venv-sglang``, ``scripts/setup-sglang.sh``); everything
here is SGLang 0.5.23's own: ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` over CPU "device" buffers (no GPU:
``pin_memory`` off), ``HiCacheStorageConfig``, ``StorageBackendFactory`` (its ``dynamic`` path from a JSON extra
config, as ``--hicache-storage-backend-extra-config``) and ``get_hash_str`` (SGLang's page keys).
"""

from __future__ import annotations

import json

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64  # noqa: F401 (for the callers)

CPU = torch.device("cpu")
# What a test pool may book: SGLang checks a host pool against the machine's free memory less a 10 GiB reserve
# (pool_host/base.py), which a 24 GiB test machine running vLLM tests beside these does not always have; the test
# pools are a few MB, so they are booked against this budget instead (SGLang's own host_memory_budget_scope).
TEST_POOL_BUDGET_BYTES = 1 << 30


def mha_pool(layout: str, *, num_layers: int = 4, heads: int = 2, head_dim: int = 32, page_size: int = 16,
             num_pages: int = 64, dtype=torch.bfloat16) -> MHATokenToKVPoolHost:
    """A real MHA host pool of about ``num_pages`` pages (``layout``: ``page_first`` / ``layer_first``)."""
    tokens = num_pages * page_size
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(num_layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(num_layers))
    ptrs = [torch.tensor([t.data_ptr() for t in side], dtype=torch.uint64) for side in (k, v)]
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD),
                         page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
                         device=CPU)
    with host_memory_budget_scope(TEST_POOL_BUDGET_BYTES):
        return MHATokenToKVPoolHost(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0, end_layer=num_layers)


def mla_pool(layout: str, *, num_layers: int = 4, kv_lora_rank: int = 64, rope_dim: int = 16, page_size: int = 16,
             num_pages: int = 64, dtype=torch.bfloat16) -> MLATokenToKVPoolHost:
    """A real MLA host pool (rows of ``kv_lora_rank + rope_dim``) of about ``num_pages`` pages."""
    tokens, width = num_pages * page_size, kv_lora_rank + rope_dim
    info = MLABufferInfo(buffers=tuple(torch.zeros(tokens, 1, width, dtype=dtype) for _ in range(num_layers)),
                         data_ptrs=None, layer_indices=tuple(range(num_layers)), device_layer_num=num_layers,
                         page_size=page_size, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, kv_cache_dim=width,
                         dtype=dtype, device=CPU)
    with host_memory_budget_scope(TEST_POOL_BUDGET_BYTES):
        return MLATokenToKVPoolHost(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0, end_layer=num_layers,
                                    target_layer_num=num_layers)


def storage_config(extra: dict | str, *, model: str = "test-model", tp_rank: int = 0, tp_size: int = 1,
                   mla: bool = False, page_first: bool = True) -> HiCacheStorageConfig:
    """What SGLang's cache controller passes a backend (``_generate_storage_config``), for one rank."""
    extra = json.loads(extra) if isinstance(extra, str) else dict(extra)
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=page_first,
                                model_name=model, extra_config=extra)


def attach(backend_name: str, config: HiCacheStorageConfig, pool):
    """A backend as SGLang attaches one: the factory, then ``register_mem_pool_host`` and
    ``on_host_pools_registered`` (``HiCacheController.attach_storage_backend``)."""
    backend = StorageBackendFactory.create_backend(backend_name, config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def fill_pages(pool, host_indices: torch.Tensor, seed: int) -> None:
    """Random bytes in the pool's pages at ``host_indices`` (every token slot of each page)."""
    gen = torch.Generator().manual_seed(seed)
    for start in host_indices[::pool.page_size].tolist():
        page = pool.get_data_page(start, flat=False)
        page.copy_(torch.randn(page.shape, generator=gen).to(page.dtype))


def page_bytes(pool, host_indices: torch.Tensor) -> list[bytes]:
    """Each page's flat bytes (``get_data_page(index, flat=True)``) at ``host_indices``."""
    return [pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            for start in host_indices[::pool.page_size].tolist()]


def page_keys(tokens: list[int], page_size: int, prior: str | None = None) -> list[str]:
    """SGLang's storage keys of ``tokens``' full pages (``get_hash_str``: SHA-256 chain over uint32 LE tokens)."""
    return get_hash_str(tokens[:len(tokens) // page_size * page_size], prior, page_size=page_size)
