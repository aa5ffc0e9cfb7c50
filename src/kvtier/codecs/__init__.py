"""KV codecs: fewer bytes per chunk for L2 and the network (``docs/codecs.md``).

``get_codec("fp8_e4m3+zstd").encode(payload, layout, num_tokens) -> Encoded(data, params)`` and
``codec.decode(data, params, layout, num_tokens) -> bytes of the chunk``; ``base`` holds the contract,
``compressors`` the lossless stages, ``quantize`` the lossy ones, ``registry`` the names.
"""

from kvtier.codecs.base import Codec, Encoded
from kvtier.codecs.registry import COMPRESSORS, TRANSFORMS, codec_names, get_codec

__all__ = ["Codec", "Encoded", "COMPRESSORS", "TRANSFORMS", "codec_names", "get_codec"]
