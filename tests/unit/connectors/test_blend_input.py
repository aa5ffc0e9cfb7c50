"""Blending's bad input (issue 18): segments that do not tile the prompt, a document shorter than one chunk, kinds,
a recompute fraction outside [0, 1], the selection's counts. No model."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.blend import Segment, check_fraction, check_knobs, segments_from_lengths, validate_segments
from kvtier.blend.select import select_guarded, select_tokens, select_top
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


def test_the_guard_recomputes_more_of_the_document_that_deviates_more():
    # two documents of 10 candidates each; the second deviates 4x as much (relative to the same scale)
    deviation = torch.cat([torch.linspace(1, 2, 10), 4 * torch.linspace(1, 2, 10), torch.zeros(2)])
    scale = torch.full((22,), 100.0)
    candidates = torch.tensor([True] * 20 + [False, False])
    forced = torch.tensor([False] * 21 + [True])
    doc_index = torch.tensor([0] * 10 + [1] * 10 + [-1, -1])
    # document 0's mean relative deviation is 0.015: at guard 0.015 it gets the fraction (2 of 10), document 1 4x that
    chosen = select_guarded(deviation, scale, candidates, forced, doc_index, 0.2, 0.015).tolist()
    assert chosen == [8, 9, 12, 13, 14, 15, 16, 17, 18, 19, 21]
    # a guard 4x higher: a quarter of each share (0.05 of document 0 rounds to none)
    assert select_guarded(deviation, scale, candidates, forced, doc_index, 0.2, 0.06).tolist() == [18, 19, 21]
    # shares are capped at the whole document; tokens outside documents are never chosen
    everything = select_guarded(deviation, scale, candidates, forced, doc_index, 1.0, 1e-6).tolist()
    assert everything == list(range(20)) + [21]


@pytest.mark.parametrize("guard", [0, -1.0, True, "0.01", math.nan])
def test_a_bad_guard_is_refused(guard):
    with pytest.raises(InputError, match="guard must be None"):
        check_knobs(1, 1, 0, 2.0, 30, guard)


def test_the_guard_and_gradual_filtering_are_not_combined():
    check_knobs(1, 1, 0, 2.0, 30, 0.001)
    with pytest.raises(InputError, match="set one of them"):
        check_knobs(1, 1, 2, 2.0, 30, 0.001)
