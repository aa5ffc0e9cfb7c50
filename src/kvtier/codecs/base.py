"""The codec contract: a chunk's KV bytes in, fewer bytes and their parameters out, and back.

A codec is at most one *transform* (lossy: changes the element type, e.g. fp8 with scales) followed by at most
one *compressor* (lossless bytes -> bytes, e.g. zstd). ``none`` has neither.

``Codec.encode(payload, layout, num_tokens)`` takes the raw chunk bytes, ``layout.chunk_shape(num_tokens)`` =
``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` C-contiguous in ``layout.dtype``, and returns
``Encoded(data, params)``. ``params`` is a small msgpack-able dict: one entry per stage, named by the stage,
holding what its decoder needs (the stage's options as used; scales live in ``data``), and ``"xxh3"``, the
xxh3-64 of ``data``. A decoder reads only ``params``, never its own configuration, so any reader decodes any
record its codec names.

``Codec.decode(data, params, layout, num_tokens)`` checks the checksum, every stage's output size against what
the layout implies, and returns exactly ``layout.chunk_bytes(num_tokens)`` bytes, or raises ``CodecError``; a
damaged input never comes back as a wrong tensor of the right size (the checksum sees to that).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.errors import CodecError, InputError
from kvtier.layout import KVLayout

CHECKSUM_PARAM = "xxh3"


@dataclass(frozen=True, slots=True)
class Encoded:
    """One encoded chunk.

    Attributes:
        data: the encoded bytes (bytes, bytearray or a numpy uint8 array; any buffer).
        params: what decoding needs: ``{stage name: {option: value}, "xxh3": int}``; msgpack-able.
    """

    data: object
    params: dict

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes


class Transform:
    """A lossy stage: the chunk as a torch tensor in the layout dtype -> bytes of (usually) fewer bits per element.

    Subclasses set ``name`` and ``OPTIONS`` (option -> default) and implement ``encode`` / ``decoded`` /
    ``encoded_size``. ``self.options`` holds the configured values (checked by ``registry``).
    """

    name = ""
    OPTIONS: dict = {}

    def __init__(self, **options) -> None:
        self.options = {**self.OPTIONS, **options}

    def encode(self, kv, layout: KVLayout) -> tuple[np.ndarray, dict, int]:
        """``kv``: torch tensor ``chunk_shape`` in ``layout.dtype``. Returns (uint8 bytes, params, element size of
        the bytes for a byte shuffle). Raises InputError for KV this transform cannot encode."""
        raise NotImplementedError

    def encoded_size(self, params: dict, layout: KVLayout, num_tokens: int) -> int:
        """Bytes ``encode`` produced for a chunk of ``num_tokens`` with ``params``."""
        raise NotImplementedError

    def decode(self, data: np.ndarray, params: dict, layout: KVLayout, num_tokens: int, out=None):
        """``data``: exactly ``encoded_size`` bytes. Returns a torch tensor ``chunk_shape`` in ``layout.dtype``:
        ``out`` (a writable torch tensor of that shape and dtype, e.g. over an L1 slot) when given, filled in place,
        else a new tensor."""
        raise NotImplementedError


class Compressor:
    """A lossless stage: bytes -> bytes. ``name`` and ``OPTIONS`` as ``Transform``."""

    name = ""
    OPTIONS: dict = {}

    def __init__(self, **options) -> None:
        self.options = {**self.OPTIONS, **options}

    def compress(self, data: np.ndarray, itemsize: int) -> tuple[object, dict]:
        """``data``: 1-D uint8 array of elements ``itemsize`` bytes wide. Returns (buffer, params)."""
        raise NotImplementedError

    def decompress(self, data, params: dict, size: int, out: np.ndarray | None = None) -> np.ndarray:
        """The ``size`` original bytes as a 1-D uint8 array: ``out`` (writable, ``size`` bytes), filled in place,
        when given. Raises CodecError when ``data`` does not hold them."""
        raise NotImplementedError

    def empty(self, data, size: int, out: np.ndarray | None) -> np.ndarray | None:
        """``decompress``'s answer when the chunk or its encoding is empty (then both must be); None otherwise.
        Raises CodecError for encoded bytes of an empty chunk, or no bytes for a chunk that is not."""
        encoded = memoryview(data).nbytes
        if size and encoded:
            return None
        if size or encoded:
            raise CodecError(f"{self.name}: {encoded} encoded bytes for a chunk of {size} bytes")
        return np.empty(0, dtype=np.uint8) if out is None else out


def _tensor_over(out: np.ndarray | None, layout: KVLayout, num_tokens: int):
    """A torch tensor ``layout.chunk_shape(num_tokens)`` sharing ``out``'s bytes; None without ``out`` or bytes."""
    if out is None or not out.nbytes:
        return None
    from kvtier.tensors import require_torch

    torch = require_torch()
    return torch.frombuffer(out, dtype=getattr(torch, layout.dtype)).view(layout.chunk_shape(num_tokens))


def _bytes_of(payload) -> np.ndarray:
    return np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)


class Codec:
    """A transform and/or a compressor, behind the one contract.

    Attributes:
        name: the stage names joined by ``+`` (``"none"``, ``"zstd"``, ``"fp8_e4m3+zstd"``); what a record names.
        spec: ``name`` with the configured options (``"zstd:level=3,shuffle=byte"``).
        lossless: True when there is no transform: decode returns the very bytes encode was given.
    """

    def __init__(self, transform: Transform | None = None, compressor: Compressor | None = None) -> None:
        self.transform = transform
        self.compressor = compressor
        stages = [s for s in (transform, compressor) if s is not None]
        self.name = "+".join(s.name for s in stages) or "none"
        self.spec = "+".join(s.name + (":" + ",".join(f"{k}={v}" for k, v in sorted(s.options.items()))
                                       if s.options else "") for s in stages) or "none"
        self.lossless = transform is None

    def __repr__(self) -> str:
        return f"Codec({self.spec!r})"

    def encode(self, payload, layout: KVLayout, num_tokens: int) -> Encoded:
        """Encode one chunk.

        Args:
            payload: any buffer of ``layout.chunk_bytes(num_tokens)`` bytes: the chunk
                ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` in ``layout.dtype``; read, never changed.

        Raises:
            InputError: ``payload`` has another size, or (lossy codecs) a dtype or values (NaN, inf) the transform
                cannot encode.
        """
        data = _bytes_of(payload)
        expected = layout.chunk_bytes(num_tokens)
        if data.nbytes != expected:
            raise InputError(f"chunk payload is {data.nbytes} bytes; layout {layout.dtype} x "
                             f"{layout.chunk_shape(num_tokens)} needs {expected}")
        params: dict = {}
        itemsize = layout.element_size
        if self.transform is not None:
            from kvtier.tensors import require_torch

            torch = require_torch()
            dtype, shape = getattr(torch, layout.dtype), layout.chunk_shape(num_tokens)
            # read-only views (torch warns once that it may not write them; the transforms never do)
            kv = torch.frombuffer(data, dtype=dtype).view(shape) if expected else torch.empty(shape, dtype=dtype)
            data, params[self.transform.name], itemsize = self.transform.encode(kv, layout)
        if self.compressor is not None:
            data, params[self.compressor.name] = self.compressor.compress(data, itemsize)
        params[CHECKSUM_PARAM] = xxhash.xxh3_64_intdigest(memoryview(data).cast("B"))
        return Encoded(data, params)

    def decode(self, data, params: dict, layout: KVLayout, num_tokens: int, out=None, verify: bool = True) -> np.ndarray:
        """Decode one chunk into ``layout.chunk_bytes(num_tokens)`` bytes.

        Args:
            data, params: as ``encode`` returned them (e.g. read back from a record).
            out: optional writable buffer of exactly that many bytes to decode into (an L1 slot).
            verify: check ``params["xxh3"]`` against ``data``; pass False only when the caller has just checked
                the same bytes with the same hash (a record's checksum).

        Returns:
            a 1-D uint8 array of the chunk's bytes in ``layout.dtype`` (a view of ``out`` when given).

        Raises:
            InputError: ``out`` is not the chunk's size.
            CodecError: wrong checksum, a stage's output of another size than the layout implies, parameters
                this codec does not have, or a decoder error (the cause is chained).
        """
        target = None if out is None else _bytes_of(out)
        if target is not None and target.nbytes != layout.chunk_bytes(num_tokens):
            raise InputError(f"decode target is {target.nbytes} bytes; the chunk needs {layout.chunk_bytes(num_tokens)}")
        try:
            return self._decode(_bytes_of(data), params, layout, num_tokens, target, verify)
        except CodecError:
            raise
        except Exception as exc:  # a decoder's own error, or params of the wrong shape: all mean a bad encoding
            raise CodecError(f"{self.name}: cannot decode the chunk ({type(exc).__name__}: {exc})") from exc

    def _decode(self, data: np.ndarray, params: dict, layout: KVLayout, num_tokens: int, out: np.ndarray | None,
                verify: bool) -> np.ndarray:
        if not isinstance(params, dict):
            raise CodecError(f"{self.name}: codec params must be a dict, got {type(params).__name__}")
        missing = [s.name for s in (self.transform, self.compressor) if s is not None and s.name not in params]
        if missing:
            raise CodecError(f"{self.name}: codec params lack {missing}; the record was written by another codec")
        if verify and xxhash.xxh3_64_intdigest(data) != params.get(CHECKSUM_PARAM):
            raise CodecError(f"{self.name}: encoded chunk checksum mismatch (corrupted or truncated bytes)")
        expected = layout.chunk_bytes(num_tokens)
        size = self.transform.encoded_size(params[self.transform.name], layout, num_tokens) if self.transform else expected
        # the last stage writes into ``out`` itself: a decoded chunk lands in its L1 slot without another copy
        if self.compressor is not None:
            last = self.transform is None
            data = self.compressor.decompress(data, params[self.compressor.name], size, out if last else None)
        if data.nbytes != size:
            raise CodecError(f"{self.name}: decoded {data.nbytes} bytes, but {layout.dtype} x "
                             f"{layout.chunk_shape(num_tokens)} needs {size}")
        if self.transform is not None:
            from kvtier.tensors import as_numpy

            into = _tensor_over(out, layout, num_tokens)
            kv = self.transform.decode(data, params[self.transform.name], layout, num_tokens, into)
            if into is not None and kv is into:
                return out
            data = as_numpy(kv).reshape(-1).view(np.uint8)
        if data.nbytes != expected:  # a transform bug, never silently passed on
            raise CodecError(f"{self.name}: decoded {data.nbytes} bytes; the layout needs {expected}")
        if out is None or data is out:
            return data
        out[...] = data
        return out
