"""KV chunks for codec tests: shaped like a real model's (a few outlier key channels, per-layer magnitudes), made
from a seeded generator so every run tests the same bytes."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.layout import KVLayout


def kv_like(layout: KVLayout, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """A tensor ``layout.chunk_shape(num_tokens)`` in ``layout.dtype``: normal values, keys with channels up to 20x
    larger (as real keys have), every layer with its own magnitude."""
    rng = np.random.default_rng(seed)
    shape = layout.chunk_shape(num_tokens)
    values = rng.standard_normal(shape).astype(np.float32)
    channel = np.ones(layout.head_dim, dtype=np.float32)
    channel[rng.choice(layout.head_dim, max(1, layout.head_dim // 8), replace=False)] = 20.0
    values[:, 0] *= channel
    values *= rng.uniform(0.05, 4.0, (layout.num_layers, 1, 1, 1, 1)).astype(np.float32)
    return torch.from_numpy(values).to(getattr(torch, layout.dtype))


def raw_bytes(kv: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a 1-D uint8 array (no copy)."""
    return kv.contiguous().reshape(-1).view(torch.uint8).numpy()
