"""Run by ``test_sglang_controller.py`` with the SGLang environment's python: SGLang's own ``HiCacheController`` on
CPU (gloo, world size 1) with kvtier attached by its real ``attach_storage_backend``, one write-back and one
prefetch through the controller's own threads; prints ``RESULT <json>``.

What SGLang's scheduler would do around the controller is done here by hand, as ``UnifiedRadixCache`` does it: the
pages' keys (``get_hash_str``), the host slots of a prefetch hit (``prefetch_buffer.put``), reading the acks. The
parallel context a launcher publishes is stated with ``get_parallel().override_permanently`` (world size 1).

    .venv-sglang/bin/python tests/integration/sglang/controller_driver.py SERVER_URL
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
import torch.distributed as dist

from kvtier_harness.service_proc import free_port
from kvtier_harness.sglang_pools import TEST_POOL_BUDGET_BYTES, fill_pages, page_bytes, page_keys

P, LAYERS, HEADS, DIM, TOKENS, PAGES = 16, 4, 2, 32, 1024, 12


def main(url: str) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    device = MHATokenToKVPool(TOKENS, P, torch.bfloat16, HEADS, DIM, LAYERS, "cpu", False)
    allocator = TokenToKVPoolAllocator(TOKENS, torch.bfloat16, "cpu", device, False)
    with host_memory_budget_scope(TEST_POOL_BUDGET_BYTES):  # not the machine's free memory less 10 GiB
        host = MHATokenToKVPoolHost(device._mha_buffer_info(), 2.0, 0, P, "page_first", pin_memory=False,
                                    device="cpu", device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)
    extra = {"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang", "class_name": "KVTierStorage",
             "interface_v1": 1, "kvtier.server_url": url}
    ctl = HiCacheController(allocator, host, P, dist.group.WORLD, threading.Event(), io_backend="direct",
                            storage_backend="dynamic", model_name="controller-model",
                            storage_backend_extra_config=extra)
    out = {"backend": type(ctl.storage_backend).__name__, "zero_copy": ctl.page_get_func.__name__}
    tokens = list(range(1000, 1000 + PAGES * P))
    keys = page_keys(tokens, P)
    written = host.alloc(PAGES * P)
    fill_pages(host, written, 11)
    expected = page_bytes(host, written)
    ctl.write_storage(written, tokens, hash_value=keys)  # write-back: the backup thread calls batch_set_v1
    done = ctl.ack_backup_queue.get(timeout=60)
    out["backup_tokens"] = done.completed_tokens
    host.free(written)

    op = ctl.prefetch("req-1", tokens + [7] * P, last_hash=None)  # a prompt with one page more than stored
    hit = ctl.prefetch_hit_queue.get(timeout=60)  # the prefetch thread's batch_exists
    out["hit_tokens"] = hit.storage_hit_count
    hit.host_indices = host.alloc(hit.storage_hit_count)
    ctl.prefetch_buffer.put(hit)  # the scheduler's part: host slots for the hit; the IO thread calls batch_get_v1
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=60)
        if ack.completed_tokens is not None:
            out["prefetched_tokens"] = ack.completed_tokens
        if ack.completed_req:
            break
    out["same_bytes"] = page_bytes(host, hit.host_indices) == expected
    out["same_request"] = ack.rid == op.request_id
    ctl.detach_storage_backend()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
