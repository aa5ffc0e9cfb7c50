"""Byte shuffle: regroup an array of ``itemsize``-byte elements into byte planes (all first bytes, then all second
bytes, ...), the filter of HDF5 / Blosc. A float's sign-and-exponent byte varies little across a KV chunk while its
low mantissa bytes look random; apart, the exponent plane compresses well (measured in docs/codecs.md).

Trailing bytes that do not fill an element (none for a KV chunk) stay at the end, unchanged.
"""

from __future__ import annotations

import numpy as np


def shuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    """``data``: 1-D uint8. Returns a new 1-D uint8 array of the same size, planes first."""
    n = data.size // itemsize
    if itemsize <= 1 or n == 0:
        return data
    out = np.empty(data.size, dtype=np.uint8)
    elements = data[:n * itemsize].reshape(n, itemsize)
    for i in range(itemsize):  # one strided read per plane: faster than a transposed copy here
        out[i * n:(i + 1) * n] = elements[:, i]
    out[n * itemsize:] = data[n * itemsize:]
    return out


def unshuffle(data: np.ndarray, itemsize: int, out: np.ndarray | None = None) -> np.ndarray:
    """The inverse of ``shuffle``: 1-D uint8 planes -> 1-D uint8 elements, written into ``out`` (1-D uint8 of
    ``data.size`` bytes, not overlapping ``data``) when given, else into a new array; returns that array."""
    n = data.size // itemsize
    if itemsize <= 1 or n == 0:
        if out is None:
            return data
        out[...] = data
        return out
    if out is None:
        out = np.empty(data.size, dtype=np.uint8)
    np.stack([data[i * n:(i + 1) * n] for i in range(itemsize)], axis=-1, out=out[:n * itemsize].reshape(n, itemsize))
    out[n * itemsize:] = data[n * itemsize:]
    return out
