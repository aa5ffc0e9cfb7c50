"""Blending's knobs and their defaults: how much of each reused document is recomputed, and how it is chosen.

Every caller (``HFConnector.prefill_segments``, ``connectors.hf_rag.RAG``, ``kvtier demo --rag``,
``benchmarks/rag_blend.py``) takes its defaults from here.
"""

from __future__ import annotations

from kvtier.errors import InputError

# share of the reused (not exact) document tokens recomputed. 0.2: the largest fraction of issue 18's sweep under
# 0.35x a full prefill's TTFT; on issue 43's bar (docs/benchmarks.md) first-token top-1 100 %, teacher-forced top-1
# 89.6-94.3 % in small, loaded runs
DEFAULT_FRACTION = 0.2
DEFAULT_HEAD_TOKENS = 1  # first tokens of each later document always recomputed (its own attention sink)
DEFAULT_CHECK_LAYER = 1  # the layer whose K/V deviation picks the recomputed tokens
DEFAULT_REFINE_LAYERS = 0  # CacheBlend's gradual filtering: off (measured no better on this workload)
DEFAULT_WIDEN = 2.0  # with refine_layers: the check layer's selection is this many times the final one


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_knobs(head_tokens, check_layer, refine_layers, widen, num_layers: int) -> None:
    """Raise InputError naming the first bad knob: ``head_tokens`` an int >= 0, ``check_layer`` an int in
    ``[1, num_layers - 1]``, ``refine_layers`` an int >= 0, ``widen`` a number >= 1."""
    if not _is_int(head_tokens) or head_tokens < 0:
        raise InputError(f"head_tokens must be an int >= 0, got {head_tokens!r}")
    if not _is_int(check_layer) or not 1 <= check_layer < num_layers:
        raise InputError(f"check_layer must be an int in [1, {num_layers - 1}], got {check_layer!r}")
    if not _is_int(refine_layers) or refine_layers < 0:
        raise InputError(f"refine_layers must be an int >= 0, got {refine_layers!r}")
    if isinstance(widen, bool) or not isinstance(widen, (int, float)) or not widen >= 1:
        raise InputError(f"widen must be a number >= 1, got {widen!r}")
