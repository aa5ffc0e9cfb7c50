"""Lossless compressors: ``zstd`` (the ``zstandard`` package) and ``lz4`` (``lz4``, block format), each after an
optional byte shuffle (``shuffle.py``).

Options (``registry`` parses them from ``zstd:level=3,shuffle=none``):

- ``zstd``: ``level`` (default 1; zstd's -7..22, negative levels trade ratio for speed), ``shuffle``
  (``byte``, the default, or ``none``).
- ``lz4``: ``acceleration`` (default 1: lz4's default mode; larger is faster and compresses less), ``shuffle``.

Both libraries release the GIL while they work. Their (de)compressor objects are not shared between threads.
"""

from __future__ import annotations

import threading

import numpy as np

from kvtier.codecs.base import Compressor
from kvtier.codecs.shuffle import shuffle, unshuffle
from kvtier.errors import CodecError

SHUFFLES = ("byte", "none")


class _Shuffled(Compressor):
    """The part both compressors share: the optional byte shuffle, empty chunks, and the size check on the way
    back. Subclasses implement ``_deflate(planes) -> buffer`` and ``_inflate(data, size) -> uint8 array``."""

    def compress(self, data, itemsize):
        if self.options["shuffle"] == "byte" and itemsize > 1:
            planes, params = shuffle(data, itemsize), {"shuffle": "byte", "itemsize": itemsize}
        else:
            planes, params = data, {"shuffle": "none"}
        params.update(self._params())
        return (self._deflate(planes) if planes.size else b""), params

    def decompress(self, data, params, size, out=None):
        if (empty := self.empty(data, size, out)) is not None:
            return empty
        inflated = self._inflate(data, size)
        if inflated.size != size:  # lz4 accepts a block that decodes to fewer bytes than the room given
            raise CodecError(f"{self.name}: decompressed {inflated.size} bytes; the layout needs {size}")
        how = params.get("shuffle")
        if how == "byte":
            return unshuffle(inflated, int(params["itemsize"]), out)
        if how != "none":
            raise CodecError(f"unknown shuffle {how!r} in codec params; this kvtier knows {SHUFFLES}")
        if out is None:
            return inflated
        out[...] = inflated  # zstandard and lz4.block only return new buffers
        return out

    def _params(self) -> dict:
        return {}

    def _deflate(self, planes: np.ndarray):
        raise NotImplementedError

    def _inflate(self, data, size: int) -> np.ndarray:
        raise NotImplementedError


class Zstd(_Shuffled):
    name = "zstd"
    OPTIONS = {"level": 1, "shuffle": "byte"}

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._local = threading.local()

    def _objects(self):
        local = self._local
        if not hasattr(local, "compressor"):
            import zstandard

            # no zstd checksum: the codec's xxh3 over the encoded bytes already covers them
            local.compressor = zstandard.ZstdCompressor(level=int(self.options["level"]), write_checksum=False,
                                                        write_content_size=True)
            local.decompressor = zstandard.ZstdDecompressor()
            local.module = zstandard
        return local

    def _params(self):
        return {"level": int(self.options["level"])}

    def _deflate(self, planes):
        return self._objects().compressor.compress(planes)

    def _inflate(self, data, size):
        local = self._objects()
        try:
            declared = local.module.frame_content_size(data)
        except local.module.ZstdError as exc:
            raise CodecError(f"zstd: not a zstd frame ({exc})") from exc
        if declared != size:  # before allocating what a damaged header claims
            raise CodecError(f"zstd: the frame holds {declared} bytes; the layout needs {size}")
        return np.frombuffer(local.decompressor.decompress(data, max_output_size=size), dtype=np.uint8)


class Lz4(_Shuffled):
    name = "lz4"
    OPTIONS = {"acceleration": 1, "shuffle": "byte"}

    def _deflate(self, planes):
        import lz4.block

        acceleration = int(self.options["acceleration"])
        mode = {"mode": "fast", "acceleration": acceleration} if acceleration > 1 else {"mode": "default"}
        return lz4.block.compress(planes, store_size=False, **mode)

    def _inflate(self, data, size):
        import lz4.block

        try:
            return np.frombuffer(lz4.block.decompress(data, uncompressed_size=size), dtype=np.uint8)
        except lz4.block.LZ4BlockError as exc:
            raise CodecError(f"lz4: the block does not decode to the {size} bytes the layout needs ({exc})") from exc
