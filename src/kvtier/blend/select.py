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


def select_top(deviation: torch.Tensor, candidates: torch.Tensor, forced: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted indexes (into these ``[N]`` tensors) of every ``forced`` entry plus the ``count`` ``candidates``
    (not forced) of highest ``deviation`` (all of them when there are fewer)."""
    chosen = forced.clone()
    idx = torch.nonzero(candidates & ~forced).flatten()
    count = min(int(count), int(idx.numel()))
    if count > 0:
        chosen[idx[torch.topk(deviation[idx], count).indices]] = True
    return torch.nonzero(chosen).flatten()
