"""Blending's bad input (issue 18): segments that do not tile the prompt, a document shorter than one chunk, kinds,
a recompute fraction outside [0, 1], the selection's counts. No model."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.blend import Segment, check_fraction, segments_from_lengths, validate_segments
from kvtier.blend.select import select_tokens, select_top
from kvtier.errors import InputError


@pytest.mark.parametrize("segments, said", [
    ([Segment(0, 40), Segment(50, 60, "text")], "starts at token 50"),
    ([Segment(0, 40), Segment(30, 60, "text")], "starts at token 30"),
    ([Segment(0, 40)], "they end at token 40, the prompt has 60"),
    ([Segment(0, 40), Segment(40, 70, "text")], "they end at token 70"),
    ([], "is empty"),
    ([Segment(0, 0), Segment(0, 60)], "is empty; drop it"),
    ([Segment(0, 60, "image")], "kind 'image'"),
    ([Segment(0, 20, "text"), Segment(20, 60, "prefix")], "only the first segment"),
    ([Segment(0, 10, "doc"), Segment(10, 60, "text")], "shorter than one chunk"),
    ([(0, 60)], "not a kvtier.blend.Segment"),
    ("0:60", "must be a list"),
])
def test_bad_segments_are_refused_naming_the_rule(segments, said):
    with pytest.raises(InputError, match=said):
        validate_segments(segments, 60, 16)


def test_good_segments_pass():
    segs = segments_from_lengths([8, 16, 30, 6], ["prefix", "doc", "doc", "text"])
    assert validate_segments(segs, 60, 16) == segs
    assert [s.num_tokens for s in segs] == [8, 16, 30, 6]
    with pytest.raises(InputError, match="one kind per segment"):
        segments_from_lengths([8, 16], ["prefix"])
    with pytest.raises(InputError, match="must be ints"):
        segments_from_lengths([8.0], ["doc"])


@pytest.mark.parametrize("fraction", [-0.01, 1.01, 2, math.nan, math.inf, True, "0.5", None])
def test_a_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(InputError, match=r"in \[0, 1\]"):
        check_fraction(fraction)


def test_fraction_bounds_are_accepted():
    assert check_fraction(0) == 0.0 and check_fraction(1) == 1.0 and check_fraction(0.15) == 0.15


def test_selection_takes_forced_tokens_and_the_top_candidates():
    deviation = torch.tensor([9.0, 1.0, 5.0, 7.0, 0.5, 3.0])
    candidates = torch.tensor([False, True, True, True, True, True])
    forced = torch.tensor([False, False, False, False, False, True])
    assert select_tokens(deviation, candidates, forced, 0.5).tolist() == [2, 3, 5]  # 2 of 4 candidates
    assert select_tokens(deviation, candidates, forced, 0.0).tolist() == [5]
    assert select_top(deviation, candidates, forced, 99).tolist() == [1, 2, 3, 4, 5]  # no more than there are
