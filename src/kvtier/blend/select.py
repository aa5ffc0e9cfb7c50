"""Token selection (CacheBlend, Yao et al., EuroSys 2025): which reused tokens to recompute.

After the first layer is computed for every token, the tokens whose K/V at the check layer deviate most from the
reused K/V are those whose cross-attention to the other documents matters: recompute them, reuse the rest.
"""

from __future__ import annotations

import torch

from kvtier.errors import InputError


def check_fraction(fraction) -> float:
    """``fraction`` as a float in [0, 1]. Raises InputError otherwise."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= float(fraction) <= 1.0:
        raise InputError(f"recompute fraction must be a number in [0, 1] (0: reuse all, 1: full prefill), "
                         f"got {fraction!r}")
    return float(fraction)


def kv_deviation(k_new, v_new, k_old, v_old) -> torch.Tensor:
    """Per-token squared deviation ``[num_tokens]`` of K and V ``[1, num_kv_heads, num_tokens, head_dim]``."""
    return ((k_new - k_old) ** 2).sum(dim=(0, 1, 3)) + ((v_new - v_old) ** 2).sum(dim=(0, 1, 3))


def select_tokens(deviation: torch.Tensor, candidates: torch.Tensor, forced: torch.Tensor,
                  fraction: float) -> torch.Tensor:
    """Sorted token indexes to recompute: every ``forced`` token plus the ``round(fraction * num candidates)``
    ``candidates`` (not forced) of highest ``deviation``.

    Args:
        deviation: ``[T]`` float, per-token deviation at the check layer.
        candidates: ``[T]`` bool, reused tokens that may be selected.
        forced: ``[T]`` bool, tokens always recomputed (no reused KV, the question, each segment's head).
        fraction: in [0, 1].
    """
    return select_top(deviation, candidates, forced, round(fraction * int((candidates & ~forced).sum())))


def select_guarded(deviation: torch.Tensor, scale: torch.Tensor, candidates: torch.Tensor, forced: torch.Tensor,
                   doc_index: torch.Tensor, fraction: float, guard: float) -> torch.Tensor:
    """The quality guard's selection: sorted indexes of every ``forced`` token plus, in each document, its
    candidates of highest ``deviation``, ``min(1, fraction * r_d / guard)`` of them, where ``r_d`` is the
    document's mean relative deviation (``deviation / scale`` over its candidates). A document that deviates
    ``guard`` gets ``fraction`` recomputed; one that deviates twice as much, twice that; one that barely moved,
    almost none.

    Args:
        deviation: ``[T]`` float, per-token squared K/V deviation at the check layer (``kv_deviation``).
        scale: ``[T]`` float, per-token squared norm of the new K/V there (what makes the deviation relative).
        candidates, forced: ``[T]`` bool, as ``select_tokens``.
        doc_index: ``[T]`` long, each token's document (any distinct ids; < 0: none).
        fraction: in [0, 1]. guard: > 0, the relative deviation at which a document gets ``fraction``.
    """
    chosen = forced.clone()
    free = candidates & ~forced
    relative = deviation / scale.clamp_min(torch.finfo(scale.dtype).tiny)
    for doc in torch.unique(doc_index[free & (doc_index >= 0)]).tolist():
        idx = torch.nonzero(free & (doc_index == doc)).flatten()
        share = min(1.0, fraction * float(relative[idx].mean()) / guard)
        count = round(share * int(idx.numel()))
        if count > 0:
            chosen[idx[torch.topk(deviation[idx], count).indices]] = True
    return torch.nonzero(chosen).flatten()


def select_top(deviation: torch.Tensor, candidates: torch.Tensor, forced: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted indexes (into these ``[N]`` tensors) of every ``forced`` entry plus the ``count`` ``candidates``
    (not forced) of highest ``deviation`` (all of them when there are fewer)."""
    chosen = forced.clone()
    idx = torch.nonzero(candidates & ~forced).flatten()
    count = min(int(count), int(idx.numel()))
    if count > 0:
        chosen[idx[torch.topk(deviation[idx], count).indices]] = True
    return torch.nonzero(chosen).flatten()
