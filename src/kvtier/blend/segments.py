"""Segments: a prompt marked as ``[prefix][doc A][doc B]...[question]`` for non-prefix reuse.

A **segment** is a span of a prompt. Its kind says how kvtier treats it:

- ``"prefix"``: the prompt's head (a system prompt); reused through ordinary prefix chunks (exact KV).
- ``"doc"``: a document (a retrieved passage) whose KV is stored on its own, keyed by its own tokens
  (``keys.segment_namespace``), and reused wherever it stands in a later prompt (``kvtier.blend.rope``).
- ``"text"``: anything else (the question): always computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import InputError

KINDS = ("prefix", "doc", "text")


@dataclass(frozen=True, slots=True)
class Segment:
    """Tokens ``[start, end)`` of a prompt, of kind ``"prefix"``, ``"doc"`` or ``"text"``."""

    start: int
    end: int
    kind: str = "doc"

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def segments_from_lengths(lengths, kinds) -> list[Segment]:
    """Segments that tile a prompt from per-segment token counts and kinds (e.g. ``[12, 700, 650, 20]`` and
    ``["prefix", "doc", "doc", "text"]``). Raises InputError when the two lists differ in length."""
    lengths, kinds = list(lengths), list(kinds)
    if len(lengths) != len(kinds):
        raise InputError(f"{len(lengths)} segment lengths but {len(kinds)} kinds; give one kind per segment")
    out, start = [], 0
    for n, kind in zip(lengths, kinds):
        if not isinstance(n, int) or isinstance(n, bool):
            raise InputError(f"segment lengths must be ints (token counts), got {n!r}")
        out.append(Segment(start, start + n, kind))
        start += n
    return out


def validate_segments(segments, num_tokens: int, chunk_size: int) -> list[Segment]:
    """Check that ``segments`` tile a prompt of ``num_tokens`` tokens and may be stored.

    Rules: a non-empty list of ``Segment``; each non-empty; the first starts at 0, each starts where the one
    before ended, the last ends at ``num_tokens``; kinds from ``KINDS``; at most one ``"prefix"``, and only
    first; every ``"doc"`` holds at least ``chunk_size`` tokens (a shorter document is not worth a stored
    chunk: mark it ``"text"``).

    Returns the segments as a list. Raises InputError naming the first broken rule and how to fix it.
    """
    if isinstance(segments, (str, bytes)) or not hasattr(segments, "__iter__"):
        raise InputError(f"segments must be a list of kvtier.blend.Segment, got {type(segments).__name__}")
    segs = list(segments)
    if not segs:
        raise InputError("segments is empty; mark the prompt as at least one Segment covering all its tokens")
    at = 0
    for i, seg in enumerate(segs):
        if not isinstance(seg, Segment):
            raise InputError(f"segment {i} is a {type(seg).__name__}, not a kvtier.blend.Segment")
        if seg.kind not in KINDS:
            raise InputError(f"segment {i} has kind {seg.kind!r}; use one of {', '.join(KINDS)}")
        if seg.start != at:
            raise InputError(f"segments do not tile the prompt: segment {i} starts at token {seg.start}, but the "
                             f"one before ends at {at}; segments must be contiguous, from 0 to the prompt's end")
        if seg.end <= seg.start:
            raise InputError(f"segment {i} [{seg.start}, {seg.end}) is empty; drop it")
        if seg.kind == "prefix" and i != 0:
            raise InputError(f"segment {i} is a prefix, but only the first segment may be one")
        if seg.kind == "doc" and seg.num_tokens < chunk_size:
            raise InputError(f"segment {i} is a doc of {seg.num_tokens} tokens, shorter than one chunk "
                             f"({chunk_size} tokens); mark it 'text' (computed each time) or use a smaller chunk_size")
        at = seg.end
    if at != num_tokens:
        raise InputError(f"segments do not tile the prompt: they end at token {at}, the prompt has {num_tokens}")
    return segs
