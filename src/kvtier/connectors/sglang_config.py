"""Settings of the kvtier SGLang storage backend: ``--hicache-storage-backend-extra-config`` read into kvtier's one
config tree (``kvtier.config``), and the KV layout of an SGLang host pool (what every page key carries).

The extra config is one JSON object shared with SGLang. SGLang reads ``backend_name``, ``module_path``,
``class_name`` and ``interface_v1`` (and removes its own prefetch keys and ``hicache_storage_pass_prefix_keys``
before the backend sees it); every other key is kvtier's and written ``kvtier.<key>`` as in vLLM's
``kv_connector_extra_config`` (``kvtier.server_url``, ``kvtier.model``, ``kvtier.timeout_seconds``, tree keys such
as ``kvtier.l1_size_gb`` for an in-process cache), plus ``kvtier.cache_salt``, this backend's own. Every error is a
ConfigError that names the key and what would work.
"""

from __future__ import annotations

import re
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.connectors.vllm_config import ENGINE_KEYS, PREFIX, connector_config
from kvtier.errors import ConfigError
from kvtier.keys import namespace_of
from kvtier.layout import DTYPE_SIZES, KVLayout

WHERE = "--hicache-storage-backend-extra-config"
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")  # SGLang's own, left alone
# ConnectorConfig keys that only the vLLM connector reads: refused here rather than silently ignored
VLLM_ONLY = ("use_layerwise", "store_after_seen", "load_timeout_seconds", "server_events", "server_events_replay")
LAYOUTS = ("layer_first", "page_first")  # host pool layouts whose flat page this backend stores
_URL = re.compile(r"^(tcp://[^\s:/]+:\d{1,5}|ipc://\S+)$")


def storage_settings(extra: dict[str, Any] | None, environ: dict | None = None) -> tuple[KVTierConfig, str]:
    """The backend's configuration tree and namespace from SGLang's extra config (``storage_config.extra_config``).

    The namespace is ``keys.namespace_of(cache_salt=kvtier.cache_salt)``: ``""`` without a salt. An in-process
    cache publishes its events (``kvtier.enable_kv_events``) in SGLang's encoding, with SGLang's block ids.

    Raises:
        ConfigError: ``interface_v1`` missing or not 1, a key that is neither SGLang's nor kvtier's, a vLLM-only
            or engine key, a ``kvtier.server_url`` that is not ``tcp://host:port`` / ``ipc://path``, or a bad value;
            the message names the key.
    """
    extra = dict(extra or {})
    if extra.get("interface_v1") != 1:
        raise ConfigError(f"{WHERE}: interface_v1 is {'missing' if 'interface_v1' not in extra else repr(extra['interface_v1'])};"
                          " set \"interface_v1\": 1 so SGLang uses the backend's zero-copy batch_get_v1 / batch_set_v1 "
                          "(without it SGLang copies every page through a temporary tensor)")
    data, salt = {}, None
    for key, value in extra.items():
        if key in SGLANG_KEYS:
            continue
        name = key.removeprefix(PREFIX) if key.startswith(PREFIX) else None
        if name == "cache_salt":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{WHERE}: kvtier.cache_salt must be a non-empty string, got {value!r}")
            salt = value
            continue
        if name in VLLM_ONLY:
            raise ConfigError(f"{WHERE}: {key} applies to the vLLM connector only; remove it")
        if name and name.split(".")[0] in ENGINE_KEYS:
            raise ConfigError(f"{WHERE}: {key} is not used: SGLang hashes its pages itself and kvtier keys each page by "
                              "SGLang's own key; remove it")
        if name is None:
            raise ConfigError(f"{WHERE}: unknown key {key!r}; SGLang's keys are {', '.join(SGLANG_KEYS)}, kvtier's are "
                              f"written {PREFIX}<key> (e.g. {PREFIX}server_url; docs/configuration.md)")
        data[key] = value
    url = data.get(PREFIX + "server_url")
    if url is not None and (not isinstance(url, str) or not _URL.match(url)):
        raise ConfigError(f"{WHERE}: kvtier.server_url {url!r} is not a kvtier server address; use tcp://host:port "
                          "(e.g. tcp://127.0.0.1:5555) or ipc://path, or leave it out for an in-process cache")
    if data.get(PREFIX + "kv_events.encoding", "sglang") != "sglang":
        raise ConfigError(f"{WHERE}: kvtier.kv_events.encoding must be sglang here (SGLang's block ids)")
    config = connector_config(data, {}, environ, where=WHERE)
    config.kv_events.encoding = "sglang"
    return config, namespace_of(cache_salt=salt)


def pool_layout(pool, storage_config) -> KVLayout:
    """The ``KVLayout`` of an SGLang host pool's pages: their byte size and their identity in every key.

    A page is stored as the pool's flat data page (``get_data_page(index, flat=True)``: MHA ``(2, P, L, H, D)`` in
    ``page_first``, ``(2, L, P, H, D)`` in ``layer_first``; MLA ``(P, L, 1, W)`` / ``(L, P, 1, W)``), so the
    layout's ``group`` names the format: ``sglang/<mha|mla>/<layout>/page<P>`` plus the pipeline stage (its layers)
    and, for MLA, the row width W. MHA pages carry the tensor-parallel rank (each rank holds its heads); MLA pages
    are rank-replicated (``tp_size`` 1 in the layout: every rank reads the same pages). An MLA row of W elements is
    described as one KV head of W / 2 elements for K and for V (the same bytes).

    Raises:
        ConfigError: a pool this backend cannot store: another layout, an fp8 (uint8) or unknown dtype, MHA with
            different K and V head sizes, an odd MLA row width, or a pool that is neither MHA nor MLA.
    """
    layout, dtype = getattr(pool, "layout", None), str(getattr(pool, "dtype", "")).removeprefix("torch.")
    if layout not in LAYOUTS:
        raise ConfigError(f"the kvtier backend stores host pools of layout {' or '.join(LAYOUTS)}; this one is "
                          f"{layout!r} (set --hicache-mem-layout)")
    if dtype not in DTYPE_SIZES:
        raise ConfigError(f"the kvtier backend does not store a host pool of dtype {dtype!r} (an fp8 KV cache is kept "
                          f"as uint8, whose fp8 format the pool does not say); supported: {sorted(DTYPE_SIZES)}")
    stage = f"pp{storage_config.pp_rank}of{storage_config.pp_size}"
    if storage_config.attn_cp_size > 1:
        stage += f"/cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}"
    group = f"sglang/{{}}/{layout}/page{pool.page_size}/{stage}"
    if hasattr(pool, "kv_cache_dim"):  # MLATokenToKVPoolHost
        width = pool.kv_cache_dim
        if width % 2:
            raise ConfigError(f"the kvtier backend stores MLA rows of even width; this pool's is {width}")
        return KVLayout(pool.layer_num, 1, width // 2, dtype, group=group.format(f"mla/w{width}"))
    if not hasattr(pool, "head_num") or getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        raise ConfigError(f"the kvtier backend stores MHA and MLA host pools with one head size for K and V; "
                          f"got {type(pool).__name__}")
    return KVLayout(pool.layer_num, pool.head_num, pool.head_dim, dtype, storage_config.tp_size,
                    storage_config.tp_rank, group=group.format("mha"))
