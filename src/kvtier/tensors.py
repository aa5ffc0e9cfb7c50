"""One tensor <-> numpy convention for every KV copy (the in-process cache and the server client).

KV travels as numpy arrays of the layout's element size: float32 and float16 as themselves, bfloat16 as 16-bit
ints, fp8 as uint8 (numpy has no bfloat16 / fp8). torch is optional for the core package: only the functions
that return torch tensors need it.
"""

from __future__ import annotations

import warnings

import numpy as np

from kvtier.errors import KVTierError
from kvtier.layout import KVLayout


def require_torch():
    """The ``torch`` module. Raises KVTierError (how to install it) when torch is missing."""
    try:
        import torch
    except ImportError:
        raise KVTierError("retrieve returns torch tensors; install torch: pip install 'kvtier[hf]'") from None
    return torch


def as_numpy(kv) -> np.ndarray:
    """A numpy view of a torch tensor or numpy array (bf16/fp8 viewed as same-size ints; no copy).

    A CUDA tensor is copied to host memory (``.cpu()``); a CPU tensor shares its memory with the result.
    """
    if isinstance(kv, np.ndarray):
        return kv
    torch = require_torch()
    if kv.dtype in (torch.bfloat16,):
        kv = kv.view(torch.int16)
    elif kv.element_size() == 1 and kv.dtype != torch.uint8:
        kv = kv.view(torch.uint8)
    return kv.detach().cpu().numpy()


def as_torch(arr, dtype):
    """A torch view of a numpy chunk array (an L1 slot, a shared-memory slot or a frame), no copy; ``dtype`` is the
    KV's torch dtype (bf16 / fp8 arrive as same-size integers and are re-viewed). A read-only array gives a tensor
    that must only be read. Raises KVTierError when torch is missing."""
    torch = require_torch()
    with warnings.catch_warnings():  # torch warns about read-only arrays: the caller only reads them
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t if t.dtype == dtype else t.view(dtype)


def empty_kv(layout: KVLayout, num_tokens: int):
    """A new, uninitialised torch tensor ``layout.chunk_shape(num_tokens)`` =
    ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` in the layout dtype, and its numpy view (same memory)."""
    torch = require_torch()
    out = torch.empty(layout.chunk_shape(num_tokens), dtype=getattr(torch, layout.dtype))
    return out, as_numpy(out)


def chunk_view(buf, layout: KVLayout, num_tokens: int, dtype: np.dtype) -> np.ndarray:
    """``buf`` (an L1 slot, a shared-memory view or a received frame; ``layout.chunk_bytes(num_tokens)`` bytes)
    as an array ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` of ``dtype``; no copy, writable iff
    ``buf`` is. Raises ValueError when ``buf`` does not hold exactly that many bytes."""
    return np.frombuffer(buf, dtype=dtype).reshape(layout.chunk_shape(num_tokens))


def copy_from(src: np.ndarray):
    """A ``store_chunks`` fill (``kvtier.backend.Fill``) that copies chunk ``[start, start + n)`` out of ``src``,
    the numpy KV of a whole prompt ``(num_layers, 2, T, num_kv_heads, head_dim)`` (``as_numpy``); the slot is
    written as ``src``'s dtype (same element size, so the bytes are the same)."""

    def fill(start: int, dst: np.ndarray) -> None:
        np.copyto(dst.view(src.dtype), src[:, :, start:start + dst.shape[2]])

    return fill


def join_chunks(layout: KVLayout, num_tokens: int, chunks):
    """One new torch tensor ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` in the layout dtype holding
    ``chunks`` (``[(start, view)]`` of ``Retrieved.chunks``, together covering ``[0, num_tokens)``)."""
    out, dst = empty_kv(layout, num_tokens)
    for start, view in chunks:
        dst[:, :, start:start + view.shape[2]] = view.view(dst.dtype)
    return out
