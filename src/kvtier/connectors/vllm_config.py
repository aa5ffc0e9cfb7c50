"""Settings of the kvtier vLLM connector: the ``kv_connector_extra_config`` keys, their checks, and the
KV layout of a vLLM instance. Every error is a ConfigError that names the key and what would work."""

from __future__ import annotations

import difflib
from typing import Any

from kvtier.config import parse_bool, parse_size
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

# extra-config key -> parser. Every other key is refused at startup.
SETTINGS = {
    "kvtier.server_url": str,            # tcp://host:port of `kvtier server`; without it, an in-process cache
    "kvtier.chunk_size": int,            # tokens per chunk; a multiple of vLLM's block size (default: server's, or 256)
    "kvtier.use_layerwise": parse_bool,  # load and save layer by layer inside the forward pass
    "kvtier.model": str,                 # model id in kvtier keys (default: the weights' identity; change it with them)
    "kvtier.timeout_s": float,           # server only: longest wait for one reply (also the startup wait)
    "kvtier.auth_secret_file": str,      # server only: the secret file (default: the same-user server's for the URL)
    "kvtier.l1_size_gb": parse_size,     # in-process cache only: L1 budget
    "kvtier.local_disk": str,            # in-process cache only: folder of the local_disk L2 (required there)
    "kvtier.hash_algorithm": str,        # in-process cache only (default: vLLM's prefix_caching_hash_algo)
    "kvtier.enable_kv_events": parse_bool,  # in-process cache only: hand kvtier events to vLLM's publisher
}


def parse_settings(extra: dict[str, Any]) -> dict[str, Any]:
    """Validate ``kv_connector_extra_config``. Raises ConfigError naming an unknown key or a bad value."""
    out = {}
    for key, value in (extra or {}).items():
        if key not in SETTINGS:
            near = difflib.get_close_matches(key, list(SETTINGS), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"unknown kvtier connector key {key!r} in kv_connector_extra_config; {hint}"
                              f"valid keys: {', '.join(SETTINGS)}")
        try:
            out[key] = SETTINGS[key](value)
        except (ValueError, TypeError, ConfigError) as exc:
            raise ConfigError(f"kv_connector_extra_config[{key!r}] = {value!r} is invalid: {exc}") from None
    return out


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """Raise ConfigError unless ``chunk_size`` is a positive multiple of vLLM's ``block_size``."""
    if chunk_size <= 0 or chunk_size % block_size:
        sizes = ", ".join(str(block_size * k) for k in (1, 2, 3, 4))
        raise ConfigError(f"kvtier chunk_size {chunk_size} is not a multiple of vLLM's block size {block_size}; "
                          f"use one of {sizes}, ... (set kvtier.chunk_size or the server's --chunk-size)")


def layout_of(vllm_config) -> KVLayout:
    """kvtier's KVLayout of this vLLM instance's KV cache (per tensor-parallel shard)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    dtype = vllm_config.cache_config.cache_dtype
    dtype = str(mc.dtype).removeprefix("torch.") if dtype == "auto" else dtype
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ConfigError("the kvtier vLLM connector supports tensor_parallel_size=1 and pipeline_parallel_size=1 "
                          f"only (got {pc.tensor_parallel_size} and {pc.pipeline_parallel_size})")
    return KVLayout(mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), dtype)
