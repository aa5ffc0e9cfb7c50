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


def _planes(data: np.ndarray, itemsize: int, how: str) -> tuple[np.ndarray, dict]:
    """The bytes to compress and the params that say how they were shuffled."""
    if how == "byte" and itemsize > 1:
        return shuffle(data, itemsize), {"shuffle": "byte", "itemsize": itemsize}
    return data, {"shuffle": "none"}


def _unplanes(data: np.ndarray, params: dict) -> np.ndarray:
    how = params.get("shuffle")
    if how == "byte":
        return unshuffle(data, int(params["itemsize"]))
    if how != "none":
        raise CodecError(f"unknown shuffle {how!r} in codec params; this kvtier knows {SHUFFLES}")
    return data


class Zstd(Compressor):
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

    def compress(self, data, itemsize):
        planes, params = _planes(data, itemsize, self.options["shuffle"])
        params["level"] = int(self.options["level"])
        if planes.size == 0:
            return b"", params
        return self._objects().compressor.compress(planes), params

    def decompress(self, data, params, size):
        if size == 0 or memoryview(data).nbytes == 0:
            if size or memoryview(data).nbytes:
                raise CodecError(f"zstd: {memoryview(data).nbytes} encoded bytes for a chunk of {size} bytes")
            return np.empty(0, dtype=np.uint8)
        local = self._objects()
        try:
            declared = local.module.frame_content_size(data)
        except local.module.ZstdError as exc:
            raise CodecError(f"zstd: not a zstd frame ({exc})") from exc
        if declared != size:  # before allocating what a damaged header claims
            raise CodecError(f"zstd: the frame holds {declared} bytes; the layout needs {size}")
        out = np.frombuffer(local.decompressor.decompress(data, max_output_size=size), dtype=np.uint8)
        if out.size != size:
            raise CodecError(f"zstd: decompressed {out.size} bytes; the layout needs {size}")
        return _unplanes(out, params)


class Lz4(Compressor):
    name = "lz4"
    OPTIONS = {"acceleration": 1, "shuffle": "byte"}

    def compress(self, data, itemsize):
        import lz4.block

        planes, params = _planes(data, itemsize, self.options["shuffle"])
        if planes.size == 0:
            return b"", params
        acceleration = int(self.options["acceleration"])
        mode = {"mode": "fast", "acceleration": acceleration} if acceleration > 1 else {"mode": "default"}
        return lz4.block.compress(planes, store_size=False, **mode), params

    def decompress(self, data, params, size):
        import lz4.block

        if size == 0 or memoryview(data).nbytes == 0:
            if size or memoryview(data).nbytes:
                raise CodecError(f"lz4: {memoryview(data).nbytes} encoded bytes for a chunk of {size} bytes")
            return np.empty(0, dtype=np.uint8)
        try:
            out = np.frombuffer(lz4.block.decompress(data, uncompressed_size=size), dtype=np.uint8)
        except lz4.block.LZ4BlockError as exc:
            raise CodecError(f"lz4: the block does not decode to the {size} bytes the layout needs ({exc})") from exc
        if out.size != size:  # lz4 accepts a block that decodes to fewer bytes than the room given
            raise CodecError(f"lz4: decompressed {out.size} bytes; the layout needs {size}")
        return _unplanes(out, params)
