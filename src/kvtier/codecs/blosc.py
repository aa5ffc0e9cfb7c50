"""Lossless compressors through c-blosc2 (the ``blosc2`` package): ``blosc_zstd`` and ``blosc_lz4``.

Why beside ``zstd`` / ``lz4``: blosc2 runs the byte shuffle and the compressor in one C pass over cache-sized
blocks (SIMD shuffle), so it decodes about twice as fast per core as numpy's shuffle plus the compressor, at the
same ratio (``benchmarks/bench_codecs.py``). One thread per call (``nthreads=1``): the L2 writer pool and the
promotion pool give the parallelism, and per-core figures stay per core.

Options: ``level`` (blosc's clevel 0-9; default 1 for ``blosc_zstd``, 5 for ``blosc_lz4``). The byte shuffle's
element size comes from the codec's transform (4 for fp32 KV, 2 for bf16, 1 after fp8 / int8).

A blosc2 frame carries its own sizes; they are checked against the layout before decoding, and the record's
checksum (verified before any decoder runs) keeps damaged bytes away from the decoder. A record someone wrote
on purpose with a valid checksum reaches it, as with any codec: use ``l2_record_key`` on stores others can write.
"""

from __future__ import annotations

import numpy as np

from kvtier.codecs.base import Compressor
from kvtier.errors import CodecError, ConfigError


class _Blosc(Compressor):
    codec_name = ""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        level = self.options["level"]
        if not isinstance(level, int) or not 0 <= level <= 9:
            raise ConfigError(f"codec {self.name!r}: level={level!r}; use an integer in [0, 9]")

    def compress(self, data, itemsize):
        import blosc2

        params = {"level": self.options["level"], "itemsize": int(itemsize)}
        if not data.size:
            return b"", params
        return blosc2.compress2(data, codec=getattr(blosc2.Codec, self.codec_name), clevel=self.options["level"],
                                filters=[blosc2.Filter.SHUFFLE], typesize=max(int(itemsize), 1), nthreads=1), params

    def decompress(self, data, params, size, out=None):
        import blosc2

        if (empty := self.empty(data, size, out)) is not None:
            return empty
        encoded = memoryview(data).nbytes
        try:
            declared, compressed, _ = blosc2.get_cbuffer_sizes(data)
        except Exception as exc:  # noqa: BLE001 -- any failure to read the frame header is a corrupt record
            raise CodecError(f"{self.name}: not a blosc2 frame ({exc})") from exc
        if declared != size or compressed != encoded:  # before the decoder allocates what a header claims
            raise CodecError(f"{self.name}: the frame holds {declared} bytes in {compressed}; the layout needs "
                             f"{size} in {encoded}")
        if out is None:
            out = np.empty(size, dtype=np.uint8)
        try:
            blosc2.decompress2(data, dst=out, nthreads=1)
        except Exception as exc:  # noqa: BLE001
            raise CodecError(f"{self.name}: the frame does not decode ({exc})") from exc
        return out


class BloscZstd(_Blosc):
    name = "blosc_zstd"
    codec_name = "ZSTD"
    OPTIONS = {"level": 1}


class BloscLz4(_Blosc):
    name = "blosc_lz4"
    codec_name = "LZ4"
    OPTIONS = {"level": 5}
