"""The byte shuffle: planes in element order, inverted exactly, trailing bytes kept."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.codecs.shuffle import shuffle, unshuffle


def test_planes_are_the_elements_bytes_in_order():
    data = np.arange(12, dtype=np.uint8)  # three 4-byte elements
    assert shuffle(data, 4).tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("size", [0, 1, 7, 64, 1001])
def test_unshuffle_inverts_shuffle(itemsize, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    planes = shuffle(data, itemsize)
    assert planes.size == size
    assert np.array_equal(unshuffle(planes, itemsize), data)
    if size % itemsize:
        assert np.array_equal(planes[size - size % itemsize:], data[size - size % itemsize:])
