"""Chunk records, keys and layouts."""

import numpy as np
import pytest

from kvtier.errors import CorruptRecordError, ForeignRecordError, InputError, RecordAuthError
from kvtier.keys import ChunkKey, namespace_of, parse_name
from kvtier.layout import KVLayout
from kvtier.record import RecordKeys, decode_record, encode_record, record_key_id

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4)


def _record(tokens=(1, 2, 3, 4)):
    key = ChunkKey("m", LAYOUT.layout_id, "", b"\x01" * 32)
    payload = np.arange(LAYOUT.chunk_bytes(len(tokens)) // 4, dtype=np.float32)
    return key, payload, b"".join(bytes(p) for p in encode_record(key, LAYOUT, list(tokens), payload))


def test_round_trip():
    key, payload, buf = _record()
    header, view = decode_record(buf, key, [1, 2, 3, 4])
    assert bytes(view) == payload.tobytes() and header.key == key and header.layout == LAYOUT.to_dict()


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "header"])
def test_damaged_records_raise(damage):
    key, _, buf = _record()
    buf = bytearray(buf)
    if damage == "truncate":
        buf = buf[:-10]
    elif damage == "flip":
        buf[-1] ^= 0xFF
    elif damage == "magic":
        buf[0:4] = b"XXXX"
    else:
        buf[12] ^= 0xFF
    with pytest.raises(CorruptRecordError):
        decode_record(bytes(buf), key)


def _rewritten(buf: bytes, **changes) -> bytes:
    """``buf`` (a version 4 record of ``_record``) with its header fields changed and its header checksum right."""
    import struct

    import msgspec
    import xxhash

    from kvtier.record import RecordHeader

    hlen = struct.unpack_from(">I", buf, 6)[0]
    header = msgspec.structs.replace(msgspec.msgpack.decode(buf[10:10 + hlen], type=RecordHeader), **changes)
    body = msgspec.msgpack.encode(header)
    head = struct.pack(">4sHI", b"KVTR", 4, len(body)) + body
    return head + struct.pack(">Q", xxhash.xxh3_64_intdigest(head)) + buf[10 + hlen + 8:]


def test_an_unknown_encoding_is_an_unknown_codec_not_a_corrupt_record():
    from kvtier.errors import UnknownCodecError

    key, _, buf = _record()
    future = _rewritten(buf, encoding="rav")  # no codec of that name (a newer kvtier's, say): kept, a miss
    with pytest.raises(UnknownCodecError, match="'rav'"):
        decode_record(future, key)


def test_a_newer_format_version_is_foreign_kept_not_corrupt():
    key, _, buf = _record()
    newer = bytearray(buf)
    newer[4:6] = (5).to_bytes(2, "big")
    with pytest.raises(ForeignRecordError, match="version 5 is newer"):
        decode_record(bytes(newer), key)


def test_every_damaged_header_byte_is_a_corrupt_record():
    """The header describes how to read the payload (layout, codec parameters): one flipped bit anywhere in it
    must be a corrupt record, never a record read with other parameters."""
    from kvtier.codecs import get_codec
    from kvtier.record import PREFIX_BYTES, decode_payload

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16)
    tokens = list(range(32))
    kv = np.random.default_rng(0).standard_normal(layout.chunk_shape(32)).astype(np.float32)
    key = ChunkKey("m", layout.layout_id, "", b"\x01" * 16)
    parts = encode_record(key, layout, tokens, kv, codec=get_codec("int8"))
    head, record = bytes(parts[0]), b"".join(bytes(p) for p in parts)
    assert len(head) > PREFIX_BYTES + 8
    for at in range(len(head)):
        for bit in (0x01, 0x80):
            damaged = bytearray(record)
            damaged[at] ^= bit
            with pytest.raises(CorruptRecordError):
                header, payload = decode_record(bytes(damaged), key, tokens)
                decode_payload(header, payload)


def test_a_header_whose_layout_is_not_a_layout_is_corrupt():
    key, _, buf = _record()
    for layout in ({**LAYOUT.to_dict(), "dtype": "bfloat17"}, {**LAYOUT.to_dict(), "tp_size": 0}, {"x": 1},
                   {**LAYOUT.to_dict(), "num_layers": 3}):  # the last: a raw payload of the wrong size
        with pytest.raises(CorruptRecordError):
            decode_record(_rewritten(buf, layout=layout), key)


def test_wrong_key_or_tokens_is_corrupt():
    key, _, buf = _record()
    with pytest.raises(CorruptRecordError, match="another key"):
        decode_record(buf, ChunkKey("other", key.layout_id, "", key.prefix_hash))
    with pytest.raises(CorruptRecordError, match="token ids"):
        decode_record(buf, key, [1, 2, 3, 5])


def test_layout_ids_separate_dtypes_and_tp():
    ids = {KVLayout(2, 3, 4, d).layout_id for d in ("float32", "bfloat16", "float8_e4m3fn")}
    ids |= {KVLayout(2, 3, 4, "float32", 2, r).layout_id for r in (0, 1)}
    assert len(ids) == 5
    assert KVLayout(30, 3, 64).chunk_bytes(256) == 11_796_480  # 11.25 MiB


def test_a_latent_layout_is_one_part_with_its_own_id_and_record():
    latent = KVLayout(4, 1, 576, "bfloat16", latent=True)
    assert latent.chunk_shape(8) == (4, 1, 8, 1, 576) and latent.kv_parts == 1
    assert latent.bytes_per_token == 4 * 576 * 2
    assert latent.layout_id != KVLayout(4, 1, 576, "bfloat16").layout_id
    assert latent.to_dict()["latent"] is True and "latent" not in KVLayout(4, 1, 576).to_dict()
    assert KVLayout.from_dict(latent.to_dict()) == latent
    with pytest.raises(InputError, match="one KV head"):
        KVLayout(4, 2, 576, latent=True)
    key = ChunkKey("m", latent.layout_id, "", b"\x02" * 32)
    payload = np.arange(latent.chunk_bytes(4) // 2, dtype=np.uint16)
    header, view = decode_record(b"".join(bytes(p) for p in encode_record(key, latent, [1, 2, 3, 4], payload)), key)
    assert KVLayout.from_dict(header.layout) == latent and bytes(view) == payload.tobytes()


def test_lossy_codecs_refuse_a_latent_layout():
    from kvtier.codecs import get_codec

    latent = KVLayout(2, 1, 64, "float32", latent=True)
    kv = np.zeros(latent.chunk_shape(16), np.float32)
    with pytest.raises(InputError, match="latent"):
        get_codec("int8").encode(kv, latent, 16)


def test_layout_validation():
    with pytest.raises(InputError, match="shape"):
        LAYOUT.validate_kv(np.zeros((2, 2, 5, 3, 4), np.float32), 4)
    with pytest.raises(InputError, match="dtype"):
        LAYOUT.validate_kv(np.zeros((2, 2, 4, 3, 4), np.float64), 4)
    with pytest.raises(InputError):
        KVLayout(0, 3, 4)
    with pytest.raises(InputError, match="dtype"):
        KVLayout(1, 1, 1, "int4")


def test_key_names_are_hex_and_namespaced():
    key = ChunkKey("a/model:with weird chars", "abc", namespace_of("lora1", "salt"), b"\xab" * 16)
    name = key.name()
    assert all(c in "0123456789abcdef-" for c in name)
    assert parse_name(name) == (key.scope, key.prefix_hash)
    assert ChunkKey("a/model:with weird chars", "abc", "", b"\xab" * 16).name() != name


@pytest.mark.parametrize("auth", ["blake3", "hmac-sha256"])
def test_authenticated_records_need_the_key(auth):
    key, payload, plain = _record()
    record_key = b"r" * 32
    signed = b"".join(bytes(p) for p in encode_record(key, LAYOUT, [1, 2, 3, 4], payload, auth_key=record_key, auth=auth))
    header, view = decode_record(signed, key, [1, 2, 3, 4], auth_key=record_key)
    assert header.auth == auth and bytes(view) == payload.tobytes()
    # issue 22: a reader without a key refuses a signed record unless told to serve it unchecked
    with pytest.raises(ForeignRecordError, match="this server has none"):
        decode_record(signed, key)
    unchecked = RecordKeys(accept_unverified=True)
    assert bytes(decode_record(signed, key, auth_key=unchecked)[1]) == payload.tobytes()
    # another deployment's key: foreign (kept by the cache), not forged (deleted)
    with pytest.raises(ForeignRecordError, match="does not hold"):
        decode_record(signed, key, auth_key=b"x" * 32)
    with pytest.raises(RecordAuthError, match="without the record key"):
        decode_record(plain, key, auth_key=record_key)
    # a forger who can write the store: another payload with a correct checksum and our key id, under the old tag
    forged_payload = payload.copy()
    forged_payload[0] += 1
    head, _, tag = encode_record(key, LAYOUT, [1, 2, 3, 4], forged_payload, auth_key=record_key, auth=auth)
    forged = bytes(head) + forged_payload.tobytes() + bytes(signed[-32:])
    with pytest.raises(RecordAuthError, match="forged"):
        decode_record(forged, key, [1, 2, 3, 4], auth_key=record_key)


def test_a_rotated_key_keeps_its_records_readable():
    key, payload, _ = _record()
    old, new = b"o" * 32, b"n" * 32
    signed_old = b"".join(bytes(p) for p in encode_record(key, LAYOUT, [1, 2, 3, 4], payload, auth_key=old))
    rotated = RecordKeys(signing=new, verifying=(old,))
    header, view = decode_record(signed_old, key, [1, 2, 3, 4], auth_key=rotated)
    assert header.key_id == record_key_id(old) != record_key_id(new) and bytes(view) == payload.tobytes()
    signed_new = b"".join(bytes(p) for p in encode_record(key, LAYOUT, [1, 2, 3, 4], payload, auth_key=rotated))
    assert decode_record(signed_new, key, auth_key=new)[0].key_id == record_key_id(new)
    with pytest.raises(ForeignRecordError):
        decode_record(signed_new, key, auth_key=old)  # the old deployment does not hold the new key


def test_records_signed_before_key_ids_are_tried_with_every_accepted_key():
    key, payload, _ = _record()
    old = b"o" * 32
    parts = encode_record(key, LAYOUT, [1, 2, 3, 4], payload, auth_key=old)
    import struct

    import msgspec

    header = msgspec.msgpack.decode(bytes(parts[0])[10:-8])[:-2]  # a version 2 header: no key id, no codec params
    body = msgspec.msgpack.encode(header)
    head = struct.pack(">4sHI", b"KVTR", 2, len(body)) + body
    from kvtier.record import _tag

    legacy = head + payload.tobytes() + _tag("blake3", old, head, payload.tobytes())
    assert bytes(decode_record(legacy, key, auth_key=RecordKeys(b"n" * 32, (old,)))[1]) == payload.tobytes()
    with pytest.raises(ForeignRecordError, match="before key ids"):
        decode_record(legacy, key, auth_key=b"n" * 32)


def test_format_version_1_records_are_still_read():
    key, payload, _ = _record()
    import struct

    import msgspec
    import xxhash
    body = msgspec.msgpack.encode([key.model, key.layout_id, key.namespace, key.prefix_hash, LAYOUT.to_dict(),
                                   [1, 2, 3, 4], payload.nbytes, xxhash.xxh3_64_intdigest(payload), "raw"])
    v1 = struct.pack(">4sHI", b"KVTR", 1, len(body)) + body + payload.tobytes()
    header, view = decode_record(v1, key, [1, 2, 3, 4])
    assert header.auth == "none" and bytes(view) == payload.tobytes()
    with pytest.raises(RecordAuthError):
        decode_record(v1, key, auth_key=b"k" * 32)


@pytest.mark.parametrize("spec", ["zstd", "lz4", "fp8_e4m3+zstd", "int8:group=0,sink=0"])  # one byte an element
def test_encoded_records_name_their_codec_and_decode_back_to_the_layout(spec):
    from kvtier.codecs import get_codec
    from kvtier.record import decode_payload

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
    tokens = list(range(16))
    kv = np.random.default_rng(3).standard_normal(layout.chunk_shape(16)).astype(np.float32)
    kv = (kv.view(np.uint32) & 0xFFFF0000).view(np.float32)  # bf16 values widened to fp32, as real KV often is
    key = ChunkKey("m", layout.layout_id, "", b"\x01" * 16)
    codec = get_codec(spec)
    record = b"".join(bytes(p) for p in encode_record(key, layout, tokens, kv, auth_key=b"k" * 32, codec=codec))
    header, payload = decode_record(record, key, tokens, auth_key=b"k" * 32)
    assert header.encoding == codec.name and header.encoded and payload.nbytes == header.payload_bytes
    raw = np.frombuffer(decode_payload(header, payload), np.float32).reshape(kv.shape)
    if codec.lossless:
        assert np.array_equal(raw, kv) and payload.nbytes < kv.nbytes
    else:
        assert np.allclose(raw, kv, atol=0.2) and payload.nbytes < kv.nbytes / 3
    damaged = bytearray(record)
    damaged[len(record) - 40] ^= 0xFF  # inside the encoded payload: the record's checksum sees it
    with pytest.raises(CorruptRecordError):
        decode_record(bytes(damaged), key, tokens, auth_key=b"k" * 32)


def test_a_record_of_a_codec_this_kvtier_lacks_is_an_unknown_codec():

    import msgspec

    from kvtier.errors import UnknownCodecError
    from kvtier.record import decode_payload

    key, payload, plain = _record()
    header, view = decode_record(plain, key)
    assert not header.encoded and decode_payload(header, view) is view
    future = msgspec.structs.replace(header, encoding="zfuture", codec_params={"zfuture": {}, "xxh3": 0})
    with pytest.raises(UnknownCodecError, match="zfuture"):
        decode_payload(future, view)
