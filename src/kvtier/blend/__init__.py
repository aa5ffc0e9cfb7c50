"""Non-prefix reuse (CacheBlend-style blending): segments, RoPE re-rotation, token selection, partial recompute,
and the knobs' defaults (``DEFAULT_FRACTION`` and the rest: ``blend.knobs``).

Engine-agnostic math (tensors in, tensors out); the transformers connector (``connectors.hf_blend``, and
``connectors.hf_rag`` for ingest and query by text) runs it.
"""

from kvtier.blend.knobs import (DEFAULT_CHECK_LAYER, DEFAULT_FRACTION, DEFAULT_HEAD_TOKENS, DEFAULT_REFINE_LAYERS,
                                DEFAULT_WIDEN, check_knobs)
from kvtier.blend.rope import RopeRotator
from kvtier.blend.segments import KINDS, Segment, segments_from_lengths, validate_segments
from kvtier.blend.select import check_fraction, select_tokens

__all__ = ["DEFAULT_CHECK_LAYER", "DEFAULT_FRACTION", "DEFAULT_HEAD_TOKENS", "DEFAULT_REFINE_LAYERS", "DEFAULT_WIDEN",
           "KINDS", "RopeRotator", "Segment", "check_fraction", "check_knobs", "segments_from_lengths",
           "select_tokens", "validate_segments"]
