"""Run by ``test_sglang_example.py`` with the SGLang environment's python: parse SGLang's arguments (argv[1:]) with
SGLang's own ``ServerArgs`` and load the storage backend they name through SGLang's own factory code; prints
``RESULT <json>`` (what SGLang read), or exits non-zero with SGLang's own error."""

from __future__ import annotations

import argparse
import json
import sys

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.server_args import ServerArgs

from kvtier.connectors.sglang_config import storage_settings

parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = ServerArgs.from_cli_args(parser.parse_args(sys.argv[1:]))
extra = json.loads(args.hicache_storage_backend_extra_config)
cls = StorageBackendFactory._load_backend_class(extra["module_path"], extra["class_name"], extra["backend_name"])
config, namespace = storage_settings({k: v for k, v in extra.items() if k != "hicache_storage_pass_prefix_keys"})
print("RESULT " + json.dumps({
    "backend": args.hicache_storage_backend, "hierarchical": args.enable_hierarchical_cache,
    "page_size": args.page_size, "layout": args.hicache_mem_layout, "write_policy": args.hicache_write_policy,
    "class": f"{cls.__module__}.{cls.__name__}", "is_hicache_storage": issubclass(cls, HiCacheStorage),
    "interface_v1": extra["interface_v1"], "pass_prefix_keys": extra.get("hicache_storage_pass_prefix_keys"),
    "server_url": config.connector.server_url, "timeout_seconds": config.connector.timeout_seconds}))
