"""Partial recompute in transformers: run a Llama-family model over an assembled KV cache, recomputing only
selected tokens and scattering their new K/V back (tensors in, tensors out; no kvtier storage here).

Flow: layer 0 runs for every token (it is cheap and its output is what the deviation is measured on); the check
layer's K/V of every token are projected from that output and compared with the reused K/V
(``select.select_tokens``); from the check layer on only the selected tokens' hidden states go through the
layers, their queries attending to the whole assembled cache (reused K/V for the others) under a causal mask by
position. The decoder layers are the model's own modules; only their cache is ours (``ScatterCache``).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvtier.blend.select import kv_deviation, select_tokens


class ScatterCache:
    """The ``past_key_values`` a decoder layer's attention sees: ``update`` writes the layer's new K/V
    ``[1, H, S, D]`` at token indexes ``rows`` of that layer's full K/V ``[1, H, T, D]`` and returns the full K/V."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.rows: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[layer_idx][:, :, self.rows] = key_states
        self.values[layer_idx][:, :, self.rows] = value_states
        return self.keys[layer_idx], self.values[layer_idx]


def _check_kv(layer, hidden, cos, sin):
    """K/V ``[1, H, T, D]`` a decoder layer would compute from ``hidden`` ``[1, T, hidden_size]``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    k = attn.k_proj(x).view(shape)
    if hasattr(attn, "k_norm"):  # Qwen3: per-head RMSNorm before the rotation
        k = attn.k_norm(k)
    k = k.transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    return k, v


@torch.inference_mode()
def blend_prefill(model, input_ids: torch.Tensor, kv: torch.Tensor, reused: torch.Tensor, forced: torch.Tensor,
                  fraction: float, check_layer: int = 1, exact: torch.Tensor | None = None):
    """Prefill ``input_ids`` over the assembled ``kv``, recomputing the forced and the selected tokens.

    Args:
        model: a Llama-family ``PreTrainedModel`` (``model.model.layers``, ``.norm``, ``.rotary_emb``, ``lm_head``).
        input_ids: ``[1, T]`` long.
        kv: ``(num_layers, 2, T, num_kv_heads, head_dim)`` in the model's dtype: reused K (already at the new
            positions) and V where ``reused``; anything elsewhere (overwritten). Not mutated.
        reused: ``[T]`` bool, tokens whose KV in ``kv`` may be kept.
        forced: ``[T]`` bool, tokens always recomputed (the last token must be one: its logits are returned).
        fraction: share of the reused, non-forced tokens to recompute, in [0, 1].
        check_layer: the layer whose K/V deviation selects the tokens (>= 1).
        exact: ``[T]`` bool or None, reused tokens whose KV is already exact (a reused prefix): never selected.

    Returns:
        ``(logits_last [1, vocab], DynamicCache of all T tokens, num_recomputed)``.
    """
    inner = model.model
    layers = inner.layers
    T = input_ids.shape[1]
    forced = forced | ~reused
    per_layer = kv.transpose(2, 3).unsqueeze(2)  # (L, 2, 1, H, T, D)
    cache = ScatterCache([per_layer[i, 0].clone() for i in range(len(layers))],
                         [per_layer[i, 1].clone() for i in range(len(layers))])
    positions = torch.arange(T).unsqueeze(0)
    hidden = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(hidden, positions)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    rows = torch.arange(T)
    for i, layer in enumerate(layers):
        if i == check_layer:
            k, v = _check_kv(layer, hidden, cos, sin)
            deviation = kv_deviation(k, v, cache.keys[i], cache.values[i])
            candidates = reused if exact is None else reused & ~exact
            rows = select_tokens(deviation, candidates, forced, fraction)
            hidden, cos, sin = hidden[:, rows], cos[:, rows], sin[:, rows]
        cache.rows = rows
        mask = causal[rows][None, None] if len(rows) < T or i < check_layer else causal[None, None]
        hidden = layer(hidden, attention_mask=mask, position_ids=positions[:, rows],
                       past_key_values=cache, position_embeddings=(cos, sin))
        if isinstance(hidden, tuple):
            hidden = hidden[0]
    logits = model.lm_head(inner.norm(hidden[:, -1:]))[:, -1, :]
    past = DynamicCache(ddp_cache_data=list(zip(cache.keys, cache.values)), config=model.config)
    return logits, past, int(len(rows))
