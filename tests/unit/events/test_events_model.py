"""Event types and encodings: golden vectors of reference events-and-hashing.md §1.4 and the §7 decoder."""

import msgspec
import pytest

from kvtier.errors import ConfigError, KVTierError
from kvtier.events import (AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, Encoder, EventBatch,
                           decode_batch, encode_batch)

H0, H1 = 2164874634404590027, 17270480062156288726
LEGACY_HEX = ("93cb41d954fc402000009397ab426c6f636b53746f72656492cf1e0b2e028ef071cbcfefad121d154ab2d6c09801020304"
              "0506070804c0a347505593ac426c6f636b52656d6f76656491cf1e0b2e028ef071cba347505591b0416c6c426c6f636b7343"
              "6c656172656400")
MAP_HEX = ("93cb41d954fc4020000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf1e0b2e028e"
           "f071cbcfefad121d154ab2d6b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa62"
           "6c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392"
           "c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a4747970"
           "65ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf1e0b2e028ef071cba66d656469756da3475055a967726f"
           "75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400")


def golden_batch(v033_extras: bool) -> EventBatch:
    extra = dict(extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention") if v033_extras else {}
    removed_extra = dict(group_idx=0) if v033_extras else {}
    return EventBatch(1700000000.5, [
        BlockStored([H0, H1], None, list(range(1, 9)), 4, None, "GPU", None, **extra),
        BlockRemoved([H0], "GPU", **removed_extra),
        AllBlocksCleared(),
    ], 0)


def test_legacy_array_golden_vector_106_bytes():
    out = encode_batch(golden_batch(False), "vllm-legacy")
    assert len(out) == 106
    assert out.hex() == LEGACY_HEX


def test_map_golden_vector_291_bytes_vllm_033():
    out = encode_batch(golden_batch(True), "vllm")
    assert len(out) == 291
    assert out.hex() == MAP_HEX


def test_all_blocks_cleared_only_batches():
    batch = EventBatch(0.0, [AllBlocksCleared()], 0)
    assert encode_batch(batch, "vllm-legacy").hex() == "93cb00000000000000009191b0416c6c426c6f636b73436c656172656400"
    assert encode_batch(batch, "vllm").hex() == "93cb00000000000000009181a474797065b0416c6c426c6f636b73436c656172656400"


def test_vllm_026_map_header_decodes_like_033():
    # 0.26 classes write fixmap 0x8b where 0.33 writes map16 de000b; decoders must not care
    old = bytes.fromhex(MAP_HEX.replace("93de000b", "938b", 1))
    assert len(old) == 289
    assert decode_batch(old) == decode_batch(bytes.fromhex(MAP_HEX))


@pytest.mark.parametrize("hex_", [LEGACY_HEX, MAP_HEX])
def test_decode_golden(hex_):
    batch = decode_batch(bytes.fromhex(hex_))
    assert batch.ts == 1700000000.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert stored.block_hashes == [H0, H1] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(1, 9)) and stored.block_size == 4 and stored.medium == "GPU"
    assert removed.block_hashes == [H0] and removed.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared)


def sample_batch(parent=H0):
    return EventBatch(1.25, [
        BlockStored([H1, 5], parent, [7, 8, 9, 10], 2, None, "CPU", "adapter-a"),
        BlockStored([0xFFFFFFFFFFFFFFFF], None, [1], 1, None, "STORAGE", None),
        BlockRemoved([H1], "STORAGE"),
        AllBlocksCleared(),
    ], 3)


@pytest.mark.parametrize("encoding", ["vllm", "vllm-legacy", "sglang"])
def test_round_trip_every_encoding(encoding):
    batch = sample_batch()
    got = decode_batch(encode_batch(batch, encoding))
    if encoding == "vllm-legacy":  # the 0.10.2-0.13 layout has no lora_name
        batch.events[0].lora_name = None
    assert got == batch


def test_sglang_writes_signed_int64_and_its_field_set():
    raw = msgspec.msgpack.decode(encode_batch(sample_batch(), "sglang"))
    stored = raw[1][0]
    assert stored["block_hashes"] == [H1 - 2**64, 5]
    assert raw[1][1]["block_hashes"] == [-1]
    assert "extra_keys" not in stored and "group_idx" not in stored
    assert list(stored)[:7] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                "medium"]


def test_bytes_hashes_round_trip_raw_and_reduce_to_last_8_bytes():
    digest = bytes(range(32))
    batch = EventBatch(2.0, [BlockStored([digest], None, [1, 2], 2, None, "CPU", None)], 0)
    payload = encode_batch(batch)
    assert bytes([0xC4, 0x20]) + digest in payload  # bin8, as vLLM's bytes mode
    assert decode_batch(payload, raw_hashes=True) == batch
    assert decode_batch(payload).events[0].block_hashes == [int.from_bytes(digest[-8:], "big")]
    short = encode_batch(EventBatch(2.0, [BlockRemoved([b"\x01\x02"], "CPU")], 0))
    assert decode_batch(short).events[0].block_hashes == [0x0102]


def test_decoder_accepts_other_producers_shapes():
    enc = msgspec.msgpack.encode
    # vLLM 0.9.0: 2-element batch, array events without medium; extra trailing elements ignored
    payload = enc([5.0, [["BlockStored", [1], None, [1, 2], 2, None], ["BlockRemoved", [1]],
                         ["BlockStored", [2], 1, [3, 4], 2, None, "CPU", None, "trailing", 99]]])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert [e.medium for e in batch.events] == ["GPU", "GPU", "CPU"]
    assert batch.events[2].parent_block_hash == 1
    # maps with unknown keys, negative int64 hashes, an unknown event type
    payload = enc([6, [{"type": "BlockStored", "block_hashes": [-1], "parent_block_hash": -2, "token_ids": [1],
                        "block_size": 1, "lora_id": None, "future_field": {"x": 1}},
                       {"type": "SomethingNew", "a": 1}], None])
    batch = decode_batch(payload)
    assert len(batch.events) == 1
    assert batch.events[0].block_hashes == [2**64 - 1] and batch.events[0].parent_block_hash == 2**64 - 2
    assert batch.events[0].medium == "GPU" and batch.ts == 6.0


@pytest.mark.parametrize("payload", [b"\xc1garbage", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode([1.0, [["BlockStored"]]]),
                                     msgspec.msgpack.encode([1.0, [7]]), msgspec.msgpack.encode(["x", []]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]])])
def test_undecodable_payloads_raise_decode_error(payload):
    with pytest.raises(DecodeError) as info:
        decode_batch(payload)
    assert isinstance(info.value, KVTierError)


def test_unknown_encoding_is_a_config_error():
    with pytest.raises(ConfigError, match="vllm-legacy"):
        Encoder("vllm-0.9")
