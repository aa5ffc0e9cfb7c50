"""The KV conversions and facts ``HFConnector`` and its blended prefill share: a ``DynamicCache`` to and from
kvtier's layout ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)``, a loaded model's weights identity, a
cache's chunk size."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvtier.errors import InputError
from kvtier.identity import model_identity


def kv_to_dynamic_cache(kv: torch.Tensor) -> DynamicCache:
    """Build a ``DynamicCache`` of full layers from kvtier KV.

    Full layers on purpose: a sliding-window layer's cache type (``DynamicCache(config=...)`` for Gemma-3) drops
    the tokens before its window, which kvtier stores; the model masks each layer to its window itself, so a
    full layer gives the same output (and decoding continues from it).

    Args:
        kv: ``(num_layers, 2, n, num_kv_heads, head_dim)``; read through strided views and copied into the
            cache's own per-layer tensors (``kv`` is not kept).

    Returns:
        a cache whose layer ``l`` holds keys ``kv[l, 0]`` and values ``kv[l, 1]`` as ``[1, heads, n, head_dim]``
        (an empty cache, layers made on first use, when ``n`` is 0).
    """
    if kv.shape[2] == 0:
        return DynamicCache()
    # (L, 2, n, H, D) -> per layer [1, H, n, D]
    per_layer = kv.transpose(2, 3).unsqueeze(2)  # (L, 2, 1, H, n, D)
    return DynamicCache(ddp_cache_data=[(per_layer[i, 0], per_layer[i, 1]) for i in range(kv.shape[0])])


def dynamic_cache_to_kv(cache: DynamicCache, num_tokens: int, start: int = 0) -> torch.Tensor:
    """Copy tokens ``[start, start + num_tokens)`` of a batch-1 ``DynamicCache`` into kvtier's layout.

    Returns:
        a new contiguous tensor ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` in the cache's dtype.
    """
    layers = cache.layers
    _, heads, _, head_dim = layers[0].keys.shape
    out = torch.empty((len(layers), 2, num_tokens, heads, head_dim), dtype=layers[0].keys.dtype)
    end = start + num_tokens
    for i, layer in enumerate(layers):
        out[i, 0].copy_(layer.keys[0, :, start:end].transpose(0, 1))  # [H, n, D] -> [n, H, D]
        out[i, 1].copy_(layer.values[0, :, start:end].transpose(0, 1))
    return out


def model_identity_of(model) -> str:
    """The weights' identity (``identity.model_identity``) of a loaded transformers model: its folder or hub repo
    id (``config.name_or_path``) and revision (``config._commit_hash``), never a display name.

    Raises:
        InputError: the model was built in memory (no ``name_or_path``): pass an explicit model id that changes
            whenever the weights change.
    """
    source = getattr(model.config, "name_or_path", "")
    if not source:
        raise InputError("this model has no name_or_path (built in memory, not loaded from a folder or the hub); "
                         "pass model_id explicitly, one that changes whenever the weights change")
    return model_identity(source, getattr(model.config, "_commit_hash", None))


def chunk_size_of(cache) -> int | None:
    """The cache's chunk size if it tells (KVCache: ``config.chunk_size``; server Client: ``info.chunk_size``
    once its handshake is done), else None."""
    for holder in (cache, getattr(cache, "config", None), getattr(cache, "info", None)):
        size = getattr(holder, "chunk_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return None
