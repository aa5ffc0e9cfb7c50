"""Partial recompute in transformers: run a Llama-family or Gemma-3 model over an assembled KV cache, recomputing only
selected tokens and writing their new K/V over the reused ones in every layer (tensors in, tensors out; no
kvtier storage here).

Flow: the layers before the check layer run for every token (layer 0 is cheap and its output is what the
deviation is measured on); the check layer's K/V of every token are projected from that output and compared
with the reused K/V (``select.select_top``); from the check layer on only the selected tokens' hidden states go
through the layers, their queries attending to the whole assembled cache (reused K/V for the others) under a
causal mask by position. Gradual filtering (CacheBlend §4.3): with ``refine_layers`` > 0 the check layer keeps
``widen`` times the final count, and each of the next ``refine_layers`` layers narrows the selection by the
deviation of the K/V it has just recomputed, down to ``fraction``.

The decoder layers are the model's own modules; only their cache is ours (``BlendCache``). The selected rows go
through each layer in a few blocks in position order, each attending to the keys up to its last position only
(a block's queries never see later keys, so the rest of the cache need not be read). Each layer gets its own
rotary cos/sin and, for a sliding-window layer (Gemma-3), a mask limited to its window (``RopeRotator``'s
per-layer types and windows), as the model's own forward would.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvtier.blend.rope import RopeRotator
from kvtier.blend.select import kv_deviation, select_top
from kvtier.errors import BlendUnsupportedError

MASKED_ATTENTION = ("sdpa", "eager")  # attention implementations whose masks we build (bool / additive float)
MIN_BLOCK_ROWS = 64  # selected rows per attention block at least (each block is one more call of each layer)
# Two blocks: with a mask, transformers' sdpa path repeats the KV heads for every call (a copy of the keys up to the
# block's end), which eats the attention saved by more blocks; measured on SmolLM2 (420 rows of 3,300 tokens, per
# layer): 1 block 23 ms, 2 blocks 16 ms, 4 blocks 22 ms.
ATTENTION_BLOCKS = 2


class BlendCache:
    """The ``past_key_values`` a decoder layer's attention sees during a blended prefill.

    ``keys[i]`` / ``values[i]`` ``[1, H, T, D]``: layer ``i``'s assembled K/V, written in place. Before each layer
    call: ``rows`` (``[S]`` long, sorted token indexes the call computes; None: all T tokens), ``limit`` (the
    K/V ``update`` returns: tokens ``[0, limit)``) and ``measure`` (keep the per-row deviation of the new K/V from
    the old in ``deviation`` ``[S]``)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.rows: torch.Tensor | None = None
        self.limit = keys[0].shape[2] if keys else 0
        self.measure = False
        self.deviation: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.rows is None:
            k.copy_(key_states)
            v.copy_(value_states)
        else:
            if self.measure:
                self.deviation = kv_deviation(key_states, value_states, k[:, :, self.rows], v[:, :, self.rows])
            k[:, :, self.rows] = key_states
            v[:, :, self.rows] = value_states
        return k[:, :, :self.limit], v[:, :, :self.limit]


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


def _row_blocks(rows: torch.Tensor, num_blocks: int) -> list[tuple[int, int]]:
    """``[(i, j)]``: ``rows[i:j]``, consecutive blocks of about equal size (at least ``MIN_BLOCK_ROWS`` rows)."""
    n = int(rows.numel())
    count = max(1, min(num_blocks, n // MIN_BLOCK_ROWS))
    edges = [round(n * b / count) for b in range(count + 1)]
    return [(edges[b], edges[b + 1]) for b in range(count)]


def _mask(rows: torch.Tensor, limit: int, eager: bool, dtype, window: int | None = None) -> torch.Tensor:
    """``[1, 1, S, limit]``: row ``r`` may attend to tokens ``<= rows[r]`` and, with a ``window``, ``> rows[r] -
    window`` (bool for sdpa, additive for eager)."""
    keys = torch.arange(limit)[None, :]
    allowed = keys <= rows[:, None]
    if window:
        allowed &= keys > rows[:, None] - window
    if not eager:
        return allowed[None, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def check_attention(model) -> str:
    """The model's attention implementation, ``"sdpa"`` or ``"eager"`` (those whose masks blending builds).

    Raises:
        BlendUnsupportedError: any other (flash attention, flex): load the model with ``attn_implementation="sdpa"``.
    """
    impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    if impl not in MASKED_ATTENTION:
        raise BlendUnsupportedError(f"blending builds attention masks for {', '.join(MASKED_ATTENTION)}, not "
                                    f"{impl!r}; load the model with attn_implementation='sdpa'")
    return impl


@torch.inference_mode()
def blend_prefill(model, input_ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  reused: torch.Tensor, forced: torch.Tensor, fraction: float, *, check_layer: int = 1,
                  exact: torch.Tensor | None = None, refine_layers: int = 0, widen: float = 1.0,
                  attention_blocks: int = ATTENTION_BLOCKS, rotator: RopeRotator | None = None):
    """Prefill ``input_ids`` over the assembled K/V, recomputing the forced and the selected tokens.

    Args:
        model: a Llama-family or Gemma-3 ``PreTrainedModel`` (``model.model.layers``, ``.norm``, ``.rotary_emb``,
            ``lm_head``) with ``sdpa`` or ``eager`` attention.
        input_ids: ``[1, T]`` long.
        keys, values: per layer ``[1, num_kv_heads, T, head_dim]`` in the model's dtype: reused K (already at the
            new positions) and V where ``reused``; anything elsewhere. **Mutated**: every recomputed token's K/V
            is written over them, in every layer; they become the returned cache's tensors (no copy).
        reused: ``[T]`` bool, tokens whose K/V in ``keys`` / ``values`` may be kept.
        forced: ``[T]`` bool, tokens always recomputed (the last token is: its logits are returned).
        fraction: share of the candidates (reused, not forced, not ``exact``) recomputed, in [0, 1].
        check_layer: the layer whose K/V deviation selects the tokens, in [1, num_layers - 1].
        exact: ``[T]`` bool or None, reused tokens whose K/V is already exact (a reused prefix): never selected.
        refine_layers: gradual filtering: layers after the check layer that narrow the selection (0: none).
        widen: with ``refine_layers``, the check layer keeps ``widen`` times the final count (>= 1).
        attention_blocks: the selected rows go through each layer in up to this many blocks (>= 1).
        rotator: the model's ``RopeRotator`` (its layer types and windows); default ``RopeRotator.for_model``.

    Returns:
        ``(logits_last [1, vocab], DynamicCache of all T tokens (over ``keys`` / ``values``), num_recomputed)``:
        ``num_recomputed`` counts the tokens recomputed in the last layer (all T in the layers before the check).

    Raises:
        BlendUnsupportedError: an attention implementation other than sdpa or eager, or a position encoding
            ``RopeRotator.for_model`` refuses.
    """
    eager = check_attention(model) == "eager"
    rotator = rotator or RopeRotator.for_model(model)
    inner = model.model
    layers = inner.layers
    T = input_ids.shape[1]
    forced = forced | ~reused
    candidates = reused & ~forced if exact is None else reused & ~forced & ~exact
    num_candidates = int(candidates.sum())
    refine_layers = max(0, min(refine_layers, len(layers) - 1 - check_layer))
    final = round(fraction * num_candidates)
    first = min(num_candidates, round(final * max(widen, 1.0))) if refine_layers else final
    cache = BlendCache(keys, values)
    positions = torch.arange(T).unsqueeze(0)
    hidden = inner.embed_tokens(input_ids)
    # per layer type: (cos, sin) [1, rows, head_dim] of the rows still computed
    rope = {t: inner.rotary_emb(hidden, positions, *(() if t is None else (t,))) for t in set(rotator.layer_types)}
    full_masks = {}  # window -> [1, 1, T, T] (None: sdpa's own causal kernel)
    rows = positions[0]
    for i, layer in enumerate(layers):
        kind, window = rotator.layer_types[i], rotator.windows[i]
        if i < check_layer:  # every token, in order
            if window not in full_masks:
                full_masks[window] = _mask(rows, T, eager, hidden.dtype, window) if eager or window else None
            cache.rows = None
            hidden = _call(layer, hidden, full_masks[window], positions, cache, rope[kind])
            continue
        if i == check_layer:
            k, v = _check_kv(layer, hidden, *rope[kind])
            rows = select_top(kv_deviation(k, v, keys[i], values[i]), candidates, forced, first)
            hidden = hidden[:, rows]
            rope = {t: (c[:, rows], s[:, rows]) for t, (c, s) in rope.items()}
        step = i - check_layer  # layers check+1 .. check+refine_layers narrow the selection
        cache.measure = 1 <= step <= refine_layers
        cos, sin = rope[kind]
        outs, devs = [], []
        for a, b in _row_blocks(rows, attention_blocks):
            block = rows[a:b]
            cache.rows, cache.limit = block, int(block[-1]) + 1
            outs.append(_call(layer, hidden[:, a:b], _mask(block, cache.limit, eager, hidden.dtype, window),
                              positions[:, block], cache, (cos[:, a:b], sin[:, a:b])))
            devs.append(cache.deviation)
        hidden = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if cache.measure:
            count = round(first + (final - first) * step / refine_layers)
            keep = select_top(torch.cat(devs), candidates[rows], forced[rows], count)
            rows, hidden = rows[keep], hidden[:, keep]
            rope = {t: (c[:, keep], s[:, keep]) for t, (c, s) in rope.items()}
    cache.measure = False
    logits = model.lm_head(inner.norm(hidden[:, -1:]))[:, -1, :]
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:  # Gemma: the model's own forward caps its logits
        logits = torch.tanh(logits / cap) * cap
    return logits, cache_over(keys, values), int(len(rows))


def _call(layer, hidden, mask, positions, cache, cos_sin):
    out = layer(hidden, attention_mask=mask, position_ids=positions, past_key_values=cache,
                position_embeddings=cos_sin)
    return out[0] if isinstance(out, tuple) else out


def cache_over(keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A ``DynamicCache`` of full layers (every token, a sliding-window layer's too) whose layers hold ``keys[i]`` /
    ``values[i]`` themselves (no copy; transformers' ``ddp_cache_data`` would concatenate, i.e. copy, each layer
    once)."""
    cache = DynamicCache()
    for k, v in zip(keys, values):
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache
