"""kvtier as SGLang's HiCache storage backend (the L3 tier behind SGLang's GPU and host memory; SGLang 0.5.23).

Load it through SGLang's ``dynamic`` backend factory::

    python -m sglang.launch_server --model-path M --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang", "class_name": "KVTierStorage",
          "interface_v1": 1, "hicache_storage_pass_prefix_keys": true, "kvtier.server_url": "tcp://127.0.0.1:5555"}'

Pages travel through a ``kvtier server`` (``kvtier.server_url``; its shared-memory L1 on the same host, then its L2
adapters; several SGLang processes share it) or an in-process ``KVCache`` (no ``kvtier.server_url``). Each page is
one kvtier chunk keyed by SGLang's page key with this backend's identity added (``sglang_config``: the model, the
host pool's dtype, layout and page size, the TP rank for MHA, the pipeline stage, ``kvtier.cache_salt``), so
another model, rank or layout never hits. SGLang's keys already carry its request namespace (``extra_key``,
``cache_salt``). A server publishing KV events in the ``sglang`` encoding (``--kv-events-encoding sglang``) announces
the pages it holds with SGLang's own block ids; ``hicache_storage_pass_prefix_keys`` lets them name each batch's
parent page.

Failure policy: a server that is gone or slow is a miss (``batch_exists`` 0, False per page), never an exception
into SGLang and never a wait past ``kvtier.timeout_seconds`` per reply. Configuration mistakes raise ConfigError
when SGLang creates the backend (attach fails with the message).
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtier.connectors.sglang_config import pool_layout, storage_settings
from kvtier.connectors.sglang_pages import PageIO
from kvtier.errors import ConfigError
from kvtier.identity import model_identity
from kvtier.metrics import Metrics

logger = logging.getLogger("sglang.kvtier_storage")  # under SGLang's logger: its format and level


class KVTierStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over kvtier. Made by SGLang as ``cls(storage_config, kwargs)``.

    Its parts: ``config`` and ``namespace`` (``sglang_config.storage_settings``), and once SGLang registers the host
    pool, ``backend`` (a ``kvtier.client.Client`` or ``kvtier.cache.KVCache``) and ``pages`` (``PageIO``). SGLang's
    methods below delegate to ``pages``; each answers a miss when the backend fails.

    Raises:
        ConfigError: bad extra config (from the constructor) or a host pool it cannot store (from
            ``register_mem_pool_host``).
    """

    def __init__(self, storage_config, kwargs=None):
        self.storage_config = storage_config
        self.config, self.namespace = storage_settings(storage_config.extra_config)
        settings = self.config.connector
        self.model = settings.model or _model_of(storage_config)
        self.metrics = Metrics()
        self.backend = None
        self.pages: PageIO | None = None
        self.mem_pool_host = None

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Open the backend for this host pool's pages (its layout is part of every key)."""
        self.close()  # attached again (SGLang's runtime attach): the old pool's backend goes
        self.mem_pool_host = mem_pool_host
        layout = pool_layout(mem_pool_host, self.storage_config)
        settings = self.config.connector
        if settings.server_url:
            from kvtier.client import Client

            self.backend = Client(settings.server_url, model=self.model, layout=layout, namespace=self.namespace,
                                  timeout_seconds=settings.timeout_seconds, metrics=self.metrics,
                                  secret_file=settings.auth_secret_file, prefault=True)
        else:
            from kvtier.cache import KVCache

            self.backend = KVCache(self.config, self.model, layout, namespace=self.namespace)
        self.pages = PageIO(self.backend, mem_pool_host, layout, settings.timeout_seconds)
        logger.info("kvtier storage: %s, model %s, pages %s (%d bytes each)", settings.server_url or "in-process cache",
                    self.model, layout.group, layout.chunk_bytes(mem_pool_host.page_size))

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        raise ConfigError(f"the kvtier storage backend stores the KV pool only; this model also has a {host_pool_name!r} "
                          "pool (hybrid models: Mamba, sliding window), which it does not store yet")

    # ---- SGLang's storage calls: one line each, a miss when the backend fails ------------------------------
    def batch_exists(self, keys, extra_info=None) -> int:
        return self._guard("batch_exists", 0, lambda: self.pages.exists(self.pages.chain(keys, extra_info)))

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._guard("batch_get_v1", [False] * len(keys),
                           lambda: self.pages.get_v1(self.pages.chain(keys, extra_info), host_indices))

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._guard("batch_set_v1", [False] * len(keys),
                           lambda: self.pages.set_v1(self.pages.chain(keys, extra_info), host_indices))

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        targets = [t if t is not None else self.mem_pool_host.get_dummy_flat_data_page()
                   for t in (target_locations or [None] * len(keys))]
        done = self._guard("batch_get", [False] * len(keys), lambda: self.pages.get_flat(self.pages.chain(keys), targets))
        return [target if ok else None for target, ok in zip(targets, done)]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return all(self._guard("batch_set", [False], lambda: self.pages.set_flat(self.pages.chain(keys), values)))

    def clear(self) -> bool:
        """Drop every page the backend holds (a server: every cache's chunks; it needs ``$KVTIER_ADMIN_TOKEN``)."""
        return self._guard("clear", False, lambda: self.backend.clear() is not False)

    def get_stats(self):
        return None  # SGLang then reports its own prefetch and backup counters; kvtier's are on the server's /metrics

    def close(self) -> None:
        if self.backend is not None:
            self._guard("close", None, self.backend.close)
            self.backend, self.pages = None, None

    def _guard(self, what: str, miss, call):
        """``call()``, or ``miss`` when the backend is not open or ``call`` raises (logged with its traceback,
        counted in ``kvtier_connector_errors_total``): SGLang never sees an exception from a storage call. An
        unreachable or slow server is not an exception: the backend answers it as a miss itself."""
        if self.pages is None:
            return miss
        try:
            return call()
        except Exception:  # noqa: BLE001 - an outage is already a miss inside the backend: this is a bug, loud
            self.metrics.inc("kvtier_connector_errors_total", op=what)
            logger.exception("kvtier storage: %s failed unexpectedly; answered as a miss (kvtier_connector_errors_total)",
                             what)
            return miss


def _model_of(storage_config) -> str:
    """The weights' identity of SGLang's model (``identity.model_identity`` of its path or repo id)."""
    if not storage_config.model_name:
        raise ConfigError("SGLang gave the storage backend no model name; set kvtier.model in "
                          "--hicache-storage-backend-extra-config (the model id in every page key)")
    return model_identity(storage_config.model_name)
