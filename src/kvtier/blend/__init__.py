"""Non-prefix reuse (CacheBlend-style blending): segments, RoPE re-rotation, token selection, partial recompute.

Engine-agnostic math (tensors in, tensors out); the transformers connector (``connectors.hf_blend``) runs it.
"""

from kvtier.blend.rope import RopeRotator
from kvtier.blend.segments import KINDS, Segment, segments_from_lengths, validate_segments
from kvtier.blend.select import check_fraction, select_tokens

__all__ = ["KINDS", "RopeRotator", "Segment", "check_fraction", "segments_from_lengths", "select_tokens",
           "validate_segments"]
