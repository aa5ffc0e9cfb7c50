"""The assembled KV of a blended prefill: one buffer holding every layer's K/V at the prompt's positions, and
which tokens are reused, exact or forced (tensors in, tensors out; engine-agnostic).

The buffer is ``(num_layers, 2, 1, num_kv_heads, T, head_dim)``: layer ``i``'s keys ``buf[i, 0]`` and values
``buf[i, 1]`` are contiguous ``[1, H, T, D]`` tensors, the layout transformers' attention reads, so the recompute
writes into them and the decode continues from them without a copy. Stored KV (kvtier's
``(num_layers, 2, n, num_kv_heads, head_dim)``) is copied in once, its K re-rotated on the way
(``RopeRotator.rotate_into``).
"""

from __future__ import annotations

import torch


class KVAssembly:
    """K/V buffers and token flags for a prompt of ``num_tokens`` tokens.

    Attributes:
        buf: ``(num_layers, 2, 1, num_kv_heads, num_tokens, head_dim)`` of ``dtype``; uninitialised where nothing
            was put (``zero`` the spans that are computed).
        reused: ``[T]`` bool, tokens whose K/V was put. exact: ``[T]`` bool, reused tokens whose K/V equals a full
            prefill's (a prefix, a document right after the context it was computed after). forced: ``[T]`` bool,
            tokens always recomputed (the last token is).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, dtype: torch.dtype):
        self.buf = torch.empty((num_layers, 2, 1, num_kv_heads, num_tokens, head_dim), dtype=dtype)
        self.reused = torch.zeros(num_tokens, dtype=torch.bool)
        self.exact = torch.zeros(num_tokens, dtype=torch.bool)
        self.forced = torch.zeros(num_tokens, dtype=torch.bool)
        self.forced[-1] = True

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer ``[1, H, T, D]`` views of the keys."""
        return list(self.buf[:, 0].unbind(0))

    @property
    def values(self) -> list[torch.Tensor]:
        """Per layer ``[1, H, T, D]`` views of the values."""
        return list(self.buf[:, 1].unbind(0))

    def put(self, start: int, kv: torch.Tensor, rotator=None, offset: int = 0) -> None:
        """Copy ``kv`` ``(num_layers, 2, n, num_kv_heads, head_dim)`` (any strides, e.g. a read-only view of a
        stored chunk) to tokens ``[start, start + n)``, its K rotated by ``offset`` positions (``rotator``: a
        ``RopeRotator``; needed when ``offset`` is not 0). Does not set the flags."""
        end = start + kv.shape[2]
        dst = self.buf[:, :, 0, :, start:end]  # (L, 2, H, n, D)
        src = kv.transpose(2, 3)
        if offset:
            rotator.rotate_into(dst[:, 0], src[:, 0], offset)
        else:
            dst[:, 0].copy_(src[:, 0])
        dst[:, 1].copy_(src[:, 1])

    def zero(self, start: int, end: int) -> None:
        """Zero tokens ``[start, end)`` of every layer (spans that will be computed: never read uninitialised)."""
        self.buf[:, :, 0, :, start:end].zero_()
