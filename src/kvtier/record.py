"""The self-describing chunk record: what leaves L1 for an L2 adapter.

Layout (all integers big-endian)::

    magic b"KVTR" | u16 format version | u32 header length | header (msgpack) | payload (raw KV bytes)

The header holds the key, the KV layout, the chunk's token ids, the payload length, the payload's
xxh3-64 checksum and the payload encoding (``"raw"``). A reader checks all of them: any mismatch
raises CorruptRecordError, which the cache turns into a miss, a delete and a metric.
"""

from __future__ import annotations

import struct

import msgspec
import xxhash

from kvtier.errors import CorruptRecordError
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout

MAGIC = b"KVTR"
FORMAT_VERSION = 1
_PREFIX = struct.Struct(">4sHI")
PREFIX_BYTES = _PREFIX.size


class RecordHeader(msgspec.Struct, array_like=True, frozen=True):
    """Header fields; ``checksum`` is xxh3-64 of the payload."""

    model: str
    layout_id: str
    namespace: str
    prefix_hash: bytes
    layout: dict
    token_ids: list[int]
    payload_bytes: int
    checksum: int
    encoding: str = "raw"

    @property
    def key(self) -> ChunkKey:
        return ChunkKey(self.model, self.layout_id, self.namespace, self.prefix_hash)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RecordHeader)


def encode_record(key: ChunkKey, layout: KVLayout, token_ids: list[int], payload) -> list:
    """Return ``[header_bytes, payload]``; write both, in order, to store the record.

    ``payload`` is any buffer (bytes, memoryview, numpy array); it is not copied.
    """
    view = memoryview(payload).cast("B")
    header = RecordHeader(key.model, key.layout_id, key.namespace, key.prefix_hash, layout.to_dict(),
                          list(token_ids), view.nbytes, xxhash.xxh3_64_intdigest(view))
    body = _encoder.encode(header)
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)) + body, view]


def record_size(parts: list) -> int:
    """Total bytes of an encoded record."""
    return sum(memoryview(p).nbytes for p in parts)


def decode_header(buf) -> tuple[RecordHeader, int]:
    """Parse the header at the start of ``buf``; return (header, payload offset). Raises CorruptRecordError."""
    view = memoryview(buf).cast("B")
    if view.nbytes < PREFIX_BYTES:
        raise CorruptRecordError(f"record truncated: {view.nbytes} bytes")
    magic, version, hlen = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecordError("not a kvtier record (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptRecordError(f"record format version {version}; this kvtier reads {FORMAT_VERSION}")
    if view.nbytes < PREFIX_BYTES + hlen:
        raise CorruptRecordError("record truncated inside its header")
    try:
        header = _decoder.decode(view[PREFIX_BYTES:PREFIX_BYTES + hlen])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptRecordError(f"record header unreadable: {exc}") from None
    return header, PREFIX_BYTES + hlen


def decode_record(buf, key: ChunkKey | None = None, token_ids: list[int] | None = None) -> tuple[RecordHeader, memoryview]:
    """Verify a whole record and return (header, payload view into ``buf``).

    Raises:
        CorruptRecordError: bad magic/version, truncated, checksum mismatch, or a key / token ids
            different from the expected ones (a hash collision or a misplaced file).
    """
    header, offset = decode_header(buf)
    view = memoryview(buf).cast("B")
    payload = view[offset:]
    if header.encoding != "raw":
        raise CorruptRecordError(f"record payload encoding {header.encoding!r} is not one this kvtier reads ('raw')")
    if payload.nbytes != header.payload_bytes:
        raise CorruptRecordError(f"record payload is {payload.nbytes} bytes, header says {header.payload_bytes}")
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise CorruptRecordError("record checksum mismatch")
    if key is not None and header.key != key:
        raise CorruptRecordError("record belongs to another key")
    if token_ids is not None and list(token_ids) != header.token_ids:
        raise CorruptRecordError("record token ids differ from the requested tokens")
    return header, payload
