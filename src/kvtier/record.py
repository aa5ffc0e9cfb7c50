"""The self-describing chunk record: what leaves L1 for an L2 adapter.

Layout (all integers big-endian)::

    magic b"KVTR" | u16 format version | u32 header length | header (msgpack) | u64 header checksum
    | payload (raw KV bytes) | tag

The header holds the key, the KV layout, the chunk's token ids, the payload length, the payload's
xxh3-64 checksum, the payload encoding and the record authentication (``auth``). A reader checks all of
them: any mismatch raises CorruptRecordError, which the cache turns into a miss, a delete and a metric.
The header checksum (format version 4: xxh3-64 of everything before it) covers what describes the payload
(layout, codec parameters, token ids), so a damaged header is a corrupt record, never KV decoded with
the wrong parameters; records of versions 1-3 have none and are read as before. The checksums catch
accidents; they are no defence against someone who can write the store.

Encoding (format version 3, ``kvtier.codecs``): ``encoding`` is ``"raw"`` or a codec name (``"lz4"``,
``"fp8_e4m3+zstd"``) and ``codec_params`` what its decoder needs; ``payload_bytes`` and ``checksum`` then
describe the encoded bytes, and ``decode_payload`` turns them back into the chunk the layout and the token
count describe (checked). A codec this reader does not have raises UnknownCodecError (keep the record: a
newer kvtier may read it); one whose bytes do not decode raises CodecError (a corrupt record).

Record authentication (format version 2, for L2 stores several parties can write): with a key
(``l2_record_key``), ``auth`` names the MAC and ``tag`` (32 bytes) authenticates everything before it:
``"blake3"`` (keyed BLAKE3 under a key derived from the record key; the default: about 4x faster than
SHA-256 here, so signing costs little store throughput) or ``"hmac-sha256"`` (standard library only).
A reader with the key accepts either and refuses (RecordAuthError) a wrong tag and a record written
without a key (``auth`` ``"none"``, no tag; format version 1 records are such records).

Key rotation and shared stores (``RecordKeys``): a signed header names its key by ``key_id`` (8 bytes of
HMAC-SHA256(key, "kvtier record key id"): identifies, never reveals). A reader accepts the signing key and
a list of verification keys; a record signed with a key it does not hold, or signed while the reader has no
key at all (unless ``accept_unverified``), raises ForeignRecordError: a miss the cache keeps (another
deployment's valid data), unlike a wrong tag under a known key (RecordAuthError: forged, deleted). A record
signed before key ids existed (no ``key_id``) is tried with every accepted key; failing all, it is foreign.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

import msgspec
import xxhash

from kvtier.errors import CorruptRecordError, ForeignRecordError, InputError, RecordAuthError
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout

MAGIC = b"KVTR"
FORMAT_VERSION = 4  # 2: ``auth`` and the tag; 3: key ids and codecs; 4: the header checksum; 1-3 still read
READ_VERSIONS = (1, 2, 3, 4)
RAW_ENCODINGS = ("raw", "none")
AUTH_ALGORITHMS = ("blake3", "hmac-sha256")
TAG_BYTES = 32
_PREFIX = struct.Struct(">4sHI")
PREFIX_BYTES = _PREFIX.size
_HEADER_CHECKSUM = struct.Struct(">Q")  # format version 4 on


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
    auth: str = "none"  # or one of AUTH_ALGORITHMS: a TAG_BYTES tag follows the payload
    key_id: bytes = b""  # with auth: record_key_id() of the signing key (older signed records: empty)
    codec_params: dict = {}  # with a codec ``encoding``: kvtier.codecs ``Encoded.params``

    @property
    def raw_bytes(self) -> int:
        """Bytes of the raw chunk (``payload_bytes`` when not encoded)."""
        if not self.encoded:
            return self.payload_bytes
        return KVLayout.from_dict(self.layout).chunk_bytes(len(self.token_ids))

    @property
    def encoded(self) -> bool:
        """Whether the payload is a codec's output (``decode_payload``), not raw KV."""
        return self.encoding not in RAW_ENCODINGS

    @property
    def key(self) -> ChunkKey:
        return ChunkKey(self.model, self.layout_id, self.namespace, self.prefix_hash)


def record_key_id(key: bytes) -> bytes:
    """8 bytes naming a record key in headers; a one-way function of it."""
    return hmac.digest(key, b"kvtier record key id", "sha256")[:8]


@dataclass(frozen=True)
class RecordKeys:
    """The record keys of one reader / writer.

    Attributes:
        signing: ``l2_record_key`` (new records are signed with it), or None.
        verifying: ``l2_record_verify_keys``: further keys whose records are accepted (a rotation's old key,
            a second deployment sharing the store).
        accept_unverified: ``l2_accept_signed_records``: with no key at all, serve signed records without
            checking their tag (the checksum still is); default: refused as foreign.
    """

    signing: bytes | None = None
    verifying: tuple[bytes, ...] = ()
    accept_unverified: bool = False

    @classmethod
    def of(cls, value: bytes | RecordKeys | None) -> RecordKeys:
        """``value`` as RecordKeys: a single key (bytes) is the signing key; None: no keys."""
        if isinstance(value, RecordKeys):
            return value
        return cls(signing=value)

    @property
    def any(self) -> bool:
        return self.signing is not None or bool(self.verifying)

    def accepted(self) -> dict[bytes, bytes]:
        """key id -> key, for every key this reader accepts."""
        keys = ([self.signing] if self.signing is not None else []) + list(self.verifying)
        return {record_key_id(k): k for k in keys}


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RecordHeader)


def encode_record(key: ChunkKey, layout: KVLayout, token_ids: list[int], payload,
                  auth_key: bytes | RecordKeys | None = None, auth: str = "blake3", checksum: int | None = None,
                  codec=None) -> list:
    """Return ``[header_bytes, payload]``, plus the tag of MAC ``auth`` (``AUTH_ALGORITHMS``) with ``auth_key``
    (a key, or ``RecordKeys`` whose signing key is used); write the parts, in order, to store the record.

    ``payload`` is any buffer (bytes, memoryview, numpy array) of the raw chunk ``layout.chunk_shape(len(
    token_ids))`` in ``layout.dtype``; without a codec it is not copied. ``checksum``: the raw payload's xxh3-64
    as taken earlier (when the chunk was committed), so bytes that changed since fail verification; None:
    computed here. ``codec``: a ``kvtier.codecs.Codec`` to store the payload encoded with (None or ``none``:
    raw); encoding costs CPU, so call this off the engine's path (the L2 writer threads do).

    Raises:
        InputError: a lossy codec cannot encode this KV (wrong dtype, NaN / inf values).
    """
    view = memoryview(payload).cast("B")
    auth_key = RecordKeys.of(auth_key).signing
    encoding, params = "raw", {}
    if codec is not None and codec.name != "none":
        encoded = codec.encode(view, layout, len(token_ids))
        view, encoding, params = memoryview(encoded.data).cast("B"), codec.name, encoded.params
        checksum = params["xxh3"]  # the codec's checksum of its output: one hash, not two
    header = RecordHeader(key.model, key.layout_id, key.namespace, key.prefix_hash, layout.to_dict(),
                          list(token_ids), view.nbytes,
                          xxhash.xxh3_64_intdigest(view) if checksum is None else checksum, encoding,
                          auth=auth if auth_key else "none", key_id=record_key_id(auth_key) if auth_key else b"",
                          codec_params=params)
    body = _encoder.encode(header)
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)) + body
    head += _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(head))
    return [head, view, _tag(auth, auth_key, head, view)] if auth_key else [head, view]


def _tag(auth: str, auth_key: bytes, head, payload) -> bytes:
    if auth == "hmac-sha256":
        mac = hmac.new(auth_key, head, hashlib.sha256)
    elif auth == "blake3":
        import blake3  # only where records are signed with it

        mac = blake3.blake3(head, key=hmac.digest(auth_key, b"kvtier record blake3 key", "sha256"))
    else:
        raise ValueError(f"unknown record authentication {auth!r}; use one of {AUTH_ALGORITHMS}")
    mac.update(payload)  # both release the GIL over large buffers
    return mac.digest()


def record_size(parts: list) -> int:
    """Total bytes of an encoded record."""
    return sum(memoryview(p).nbytes for p in parts)


def decode_header(buf) -> tuple[RecordHeader, int]:
    """Parse the header at the start of ``buf`` and check its checksum (format version 4 on); return (header,
    payload offset). Raises CorruptRecordError: truncated, bad magic or version, checksum mismatch, a header that
    does not parse or whose layout is not a KV layout; ForeignRecordError (one): a newer format version."""
    view = memoryview(buf).cast("B")
    if view.nbytes < PREFIX_BYTES:
        raise CorruptRecordError(f"record truncated: {view.nbytes} bytes")
    magic, version, hlen = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecordError("not a kvtier record (bad magic)")
    if version > FORMAT_VERSION:  # a newer kvtier's: kept for it, a miss here
        raise ForeignRecordError(f"record format version {version} is newer than this kvtier reads "
                                 f"{READ_VERSIONS}; upgrade kvtier to read it")
    if version not in READ_VERSIONS:
        raise CorruptRecordError(f"record format version {version}; this kvtier reads {READ_VERSIONS}")
    offset = PREFIX_BYTES + hlen + (_HEADER_CHECKSUM.size if version >= 4 else 0)
    if view.nbytes < offset:
        raise CorruptRecordError("record truncated inside its header")
    if version >= 4:
        (expected,) = _HEADER_CHECKSUM.unpack_from(view, PREFIX_BYTES + hlen)
        if xxhash.xxh3_64_intdigest(view[:PREFIX_BYTES + hlen]) != expected:
            raise CorruptRecordError("record header checksum mismatch")
    try:
        header = _decoder.decode(view[PREFIX_BYTES:PREFIX_BYTES + hlen])
        layout = KVLayout.from_dict(header.layout)
    except (msgspec.DecodeError, msgspec.ValidationError, InputError) as exc:
        raise CorruptRecordError(f"record header unreadable: {exc}") from exc
    if not header.encoded and header.payload_bytes != layout.chunk_bytes(len(header.token_ids)):
        raise CorruptRecordError(f"record of {len(header.token_ids)} tokens holds {header.payload_bytes} bytes; its "
                                 f"layout needs {layout.chunk_bytes(len(header.token_ids))}")
    return header, offset


def decode_record(buf, key: ChunkKey | None = None, token_ids: list[int] | None = None,
                  auth_key: bytes | RecordKeys | None = None) -> tuple[RecordHeader, memoryview]:
    """Verify a whole record and return (header, payload view into ``buf``).

    ``auth_key``: the ``l2_record_key`` (bytes) or the reader's ``RecordKeys``; with a key, the record must
    carry a valid tag of one of ``AUTH_ALGORITHMS`` under a key it accepts. Without any, a signed record is
    foreign unless ``accept_unverified`` (then its tag is not checked; the checksum still is).

    Raises:
        CorruptRecordError: bad magic/version, truncated, checksum mismatch, or a key / token ids
            different from the expected ones (a hash collision or a misplaced file).
        RecordAuthError (a CorruptRecordError): with a key, a wrong tag under a key it holds, or no tag.
        ForeignRecordError (a CorruptRecordError): signed with a key it does not hold, or signed while it has
            none (module docstring): keep the record, serve a miss.
        UnknownCodecError (a ConfigError): the payload's codec is not one this kvtier has: keep it, a miss.
    """
    header, offset = decode_header(buf)
    view = memoryview(buf).cast("B")
    if header.encoded:
        from kvtier.codecs import get_codec

        get_codec(header.encoding)  # UnknownCodecError before anything else: the record is kept, not deleted
    if header.auth != "none" and header.auth not in AUTH_ALGORITHMS:
        raise CorruptRecordError(f"record authentication {header.auth!r} is not one this kvtier reads")
    tag_bytes = TAG_BYTES if header.auth != "none" else 0
    payload = view[offset:view.nbytes - tag_bytes]
    if payload.nbytes != header.payload_bytes:
        raise CorruptRecordError(f"record payload is {payload.nbytes} bytes, header says {header.payload_bytes}")
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise CorruptRecordError("record checksum mismatch")
    keys = RecordKeys.of(auth_key)
    if keys.any:
        if not tag_bytes:
            raise RecordAuthError("record written without the record key (l2_record_key), which this reader requires")
        _check_tag(header, keys.accepted(), view[:offset], payload, view[view.nbytes - TAG_BYTES:])
    elif tag_bytes and not keys.accept_unverified:
        raise ForeignRecordError("record is signed with a record key and this server has none: set the same "
                                 "l2_record_key (or list it in l2_record_verify_keys), or l2_accept_signed_records: "
                                 "true to serve signed records unchecked")
    if key is not None and header.key != key:
        raise CorruptRecordError("record belongs to another key")
    if token_ids is not None and list(token_ids) != header.token_ids:
        raise CorruptRecordError("record token ids differ from the requested tokens")
    return header, payload


def decode_payload(header: RecordHeader, payload, out=None):
    """The raw chunk of a verified record (``decode_record``'s result): ``payload`` itself when raw, else the
    decoded bytes (uint8 numpy array of ``layout.chunk_bytes(len(header.token_ids))``, written into ``out`` when
    given, e.g. an L1 slot).

    Raises:
        UnknownCodecError (a ConfigError): a codec this kvtier does not have: keep the record, count a miss.
        CodecError (a CorruptRecordError): the bytes do not decode to the layout's chunk.
    """
    if not header.encoded:
        return payload
    from kvtier.codecs import get_codec  # only readers of encoded records load the codecs

    layout = KVLayout.from_dict(header.layout)
    # the record's checksum (verified) is the codec's own over these bytes: no second pass
    return get_codec(header.encoding).decode(payload, header.codec_params, layout, len(header.token_ids), out=out,
                                             verify=False)


def _check_tag(header: RecordHeader, accepted: dict[bytes, bytes], head, payload, tag) -> None:
    if header.key_id:
        chosen = accepted.get(header.key_id)
        if chosen is None:
            raise ForeignRecordError(f"record signed with a record key this server does not hold (key id "
                                     f"{header.key_id.hex()}); list that key in l2_record_verify_keys to read it")
        if not hmac.compare_digest(_tag(header.auth, chosen, head, payload), tag):
            raise RecordAuthError("record tag does not match its record key: forged or damaged")
        return
    if not any(hmac.compare_digest(_tag(header.auth, k, head, payload), tag) for k in accepted.values()):
        raise ForeignRecordError("record (signed before key ids) matches none of this server's record keys: "
                                 "another deployment's, or forged")
