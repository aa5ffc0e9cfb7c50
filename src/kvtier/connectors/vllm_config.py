"""Settings of the kvtier vLLM connector, all in kvtier's one config tree (``kvtier.config``).

- ``connector_config``: ``kv_connector_extra_config`` (``kvtier.<key>``) over the YAML file and ``KVTIER_*``
  variables, plus the engine's own hashing (block size, hash algorithm, seed: never set by the user).
- ``request_controls``: per-request controls from a request's ``kv_transfer_params``.
- ``layout_of``, ``check_chunk_size``: the KV layout of a vLLM instance and the chunk-size rule.

Every error is a ConfigError that names the key and what would work.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from kvtier.config import ConnectorConfig, KVTierConfig, load_config
from kvtier.errors import ConfigError, InputError
from kvtier.hints import RetentionHint, hint_from_params
from kvtier.layout import KVLayout
from kvtier.units import parse_bool

PREFIX = "kvtier."
# taken from vLLM's engine config (``--block-size``, ``--prefix-caching-hash-algo``, PYTHONHASHSEED)
ENGINE_KEYS = ("block_size", "hash_algorithm", "hash_seed")
# tree keys that make no sense inside an engine: the server's own sockets, the connector section itself
_NOT_FOR_ENGINES = ("server", "connector")
_RENAMED = {"kvtier.timeout_s": "kvtier.timeout_seconds"}


def valid_keys() -> list[str]:
    """Every ``kv_connector_extra_config`` key the connector accepts."""
    tree = [k for k in KVTierConfig.model_fields if k not in ENGINE_KEYS + _NOT_FOR_ENGINES]
    return [PREFIX + k for k in [*ConnectorConfig.model_fields, *tree]]


def connector_config(extra: dict[str, Any] | None, engine: dict[str, Any], environ: dict | None = None,
                     where: str = "kv_connector_extra_config") -> KVTierConfig:
    """The connector's configuration: YAML file (``KVTIER_CONFIG_FILE``) < ``KVTIER_*`` < ``extra``, with
    ``engine`` (``VLLMIdentity.hash_settings()``: block_size, hash_algorithm, hash_seed) always winning.

    ``extra`` is vLLM's ``kv_connector_extra_config``: ``kvtier.<key>`` where ``<key>`` is a field of the
    ``connector`` section (``kvtier.server_url``) or of the top level (``kvtier.l1_size_gb``, nested keys
    with dots: ``kvtier.kv_events.endpoint``). ``kvtier.local_disk`` adds a local_disk L2 in front of
    ``kvtier.l2_adapters``.

    ``where``: what the errors call ``extra`` (the SGLang backend's ``--hicache-storage-backend-extra-config``).

    Raises:
        ConfigError: an unknown key (with the nearest valid one), an engine setting given by the user,
            or a bad value (naming the ``kvtier.`` key).
    """
    data: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if key in _RENAMED:
            raise ConfigError(f"kv_connector_extra_config key {key!r} was renamed to {_RENAMED[key]!r}")
        name = key.removeprefix(PREFIX) if key.startswith(PREFIX) else None
        path = name.split(".") if name else []
        if path and path[0] in ENGINE_KEYS:
            raise ConfigError(f"{key} comes from vLLM's engine config (--block-size, --prefix-caching-hash-algo, "
                              f"PYTHONHASHSEED), so kvtier hashes exactly like the engine; remove it from "
                              "kv_connector_extra_config")
        if path and path[0] in ConnectorConfig.model_fields and len(path) == 1:
            path = ["connector", *path]
        elif not path or path[0] not in KVTierConfig.model_fields or path[0] in _NOT_FOR_ENGINES:
            near = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"unknown kvtier connector key {key!r} in {where}; {hint}"
                              f"valid keys: {', '.join(valid_keys())}")
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    disk = data.get("connector", {}).get("local_disk")
    if disk:
        data["l2_adapters"] = [{"type": "local_disk", "path": str(disk)}, *data.get("l2_adapters", [])]
    if "chunk_size" in data and "block_size" in engine:  # say it in vLLM's terms, with sizes that work
        try:
            size = int(data["chunk_size"])
        except (TypeError, ValueError):
            size = None  # not a number: the tree's validation says so
        if size is not None:
            check_chunk_size(size, int(engine["block_size"]))
    data.update(engine)
    try:
        return load_config(overrides=data, environ=environ)
    except ConfigError as exc:
        text = str(exc).replace("key 'connector.", f"key '{PREFIX}")
        raise ConfigError(f"{text} ({where}: {extra})") from None


@dataclass(frozen=True)
class RequestControls:
    """What one request allows the connector to do (``kv_transfer_params``; vLLM's offloading names).

    ``max_load_tokens``: load at most this many leading prompt tokens from kvtier (0: never load; None: no
    limit). ``max_store_tokens``: store at most this many leading tokens (0: never store; None: no limit).
    """

    max_load_tokens: int | None = None
    max_store_tokens: int | None = None
    hint: RetentionHint | None = None  # kvtier.priority / kvtier.ttl_seconds / kvtier.session_id (kvtier.hints)


NO_TRANSFER = RequestControls(0, 0)
# kv_transfer_params key -> (field, meaning). max_*: vLLM's OffloadingConnector names (non-negative ints).
TRANSFER_PARAMS = {
    "max_load_tokens": "load at most this many leading prompt tokens (0: do not load)",
    "max_offload_tokens": "store at most this many leading tokens (0: do not store)",
    "kvtier.skip_load": "true: do not load for this request",
    "kvtier.skip_store": "true: do not store this request",
    "kvtier.priority": "retention priority 0-3 of the stored chunks (higher: evicted later)",
    "kvtier.ttl_seconds": "protect the stored chunks from eviction for this many seconds (> 0)",
    "kvtier.session_id": "the session the chunks belong to (protected for session_ttl_seconds; management API)",
}


def request_controls(params: dict[str, Any] | None) -> RequestControls:
    """The controls of a request's ``kv_transfer_params`` (other connectors' keys are left alone).

    Raises:
        ConfigError: an unknown ``kvtier.`` key (named, with the valid ones) or a bad value.
    """
    if not params:
        return RequestControls()
    out: dict[str, int | None] = {"max_load_tokens": None, "max_store_tokens": None}
    for key, value in params.items():
        if key.startswith(PREFIX) and key not in TRANSFER_PARAMS:
            near = difflib.get_close_matches(key, list(TRANSFER_PARAMS), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"unknown kvtier key {key!r} in kv_transfer_params; {hint}valid keys: "
                              + "; ".join(f"{k} ({v})" for k, v in TRANSFER_PARAMS.items()))
        if key in ("max_load_tokens", "max_offload_tokens"):
            if type(value) is not int or value < 0:
                raise ConfigError(f"kv_transfer_params[{key!r}] = {value!r}: must be an int >= 0 "
                                  f"({TRANSFER_PARAMS[key]})")
            field = "max_load_tokens" if key == "max_load_tokens" else "max_store_tokens"
            out[field] = value if out[field] is None else min(out[field], value)
        elif key in ("kvtier.skip_load", "kvtier.skip_store"):
            try:
                skip = parse_bool(value)
            except ConfigError as exc:
                raise ConfigError(f"kv_transfer_params[{key!r}]: {exc}") from None
            if skip:
                out["max_load_tokens" if key == "kvtier.skip_load" else "max_store_tokens"] = 0
    try:
        hint = hint_from_params(params)
    except InputError as exc:
        raise ConfigError(f"kv_transfer_params: {exc}") from None
    return RequestControls(**out, hint=hint)


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """Raise ConfigError unless ``chunk_size`` is a positive multiple of vLLM's ``block_size``."""
    if chunk_size <= 0 or chunk_size % block_size:
        sizes = ", ".join(str(block_size * k) for k in (1, 2, 3, 4))
        raise ConfigError(f"kvtier chunk_size {chunk_size} is not a multiple of vLLM's block size {block_size}; "
                          f"use one of {sizes}, ... (set kvtier.chunk_size or the server's --chunk-size)")


def layout_of(vllm_config) -> KVLayout:
    """kvtier's KVLayout of this vLLM instance's KV cache (per tensor-parallel shard): the model's layers, KV heads
    and head size, the KV cache dtype (``--kv-cache-dtype``: ``auto`` is the model's; fp8 is ``float8_e4m3fn``,
    fp8_e5m2 ``float8_e5m2``), latent for an MLA model (one head of ``kv_lora_rank + qk_rope_head_dim``).

    Raises:
        ConfigError: tensor or pipeline parallelism, or a ``kv_cache_dtype`` kvtier does not copy.
    """
    from kvtier.connectors.vllm_cuda_layouts import CACHE_DTYPES

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype {cache_dtype!r}: kvtier copies {', '.join(CACHE_DTYPES)} KV caches; "
                          "run with one of those or without the kvtier connector")
    dtype = CACHE_DTYPES[cache_dtype] or str(mc.dtype).removeprefix("torch.")
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ConfigError("the kvtier vLLM connector supports tensor_parallel_size=1 and pipeline_parallel_size=1 "
                          f"only (got {pc.tensor_parallel_size} and {pc.pipeline_parallel_size})")
    return KVLayout(mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), dtype,
                    latent=bool(getattr(mc, "use_mla", False)))
