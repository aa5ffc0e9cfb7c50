"""SGLang 0.5.23's own cache controller (``HiCacheController``) on CPU, gloo world size 1, with kvtier attached by
its real ``attach_storage_backend`` (``dynamic`` factory, zero-copy functions selected by ``interface_v1``): one
write-back and one prefetch through the controller's own backup, prefetch and IO threads, against a real server
(``controller_driver.py`` runs in the SGLang environment)."""

from __future__ import annotations

from kvtier_harness.kvtier_server import ServerProcess
from kvtier_harness.sglang import require_sglang, run_json


def test_sglangs_cache_controller_writes_back_and_prefetches_through_kvtier(tmp_path):
    require_sglang()
    with ServerProcess(tmp_path, 256, "64MB") as server:
        got = run_json(["tests/integration/sglang/controller_driver.py", server.url], 300)
    assert got == {"backend": "KVTierStorage", "zero_copy": "_page_get_zero_copy", "backup_tokens": 192,
                   "hit_tokens": 192, "prefetched_tokens": 192, "same_bytes": True, "same_request": True}
