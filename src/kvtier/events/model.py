"""KV cache event types, their wire encodings, and a decoder that reads every known producer.

Source of the formats: shared reference ``events-and-hashing.md`` §1 (vLLM), §3 (SGLang), §7 (decoder
rules); the golden byte vectors of §1.4 are pinned in ``tests/unit/events/test_events_model.py``.

Encodings (``kv_events.encoding``):

- ``vllm`` (default): the batch is a msgpack array ``[ts, events, data_parallel_rank]``; each event is a
  tagged map ``{"type": <class name>, field: value, ...}`` with vLLM 0.33's declared field set, so the bytes
  equal vLLM 0.33's (fields without a default are always written, fields with a default only when set).
- ``vllm-legacy``: each event is a tagged array, vLLM 0.10.2-0.13 layout
  (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``).
- ``sglang``: tagged maps with SGLang's field set (no ``extra_keys``/``group_idx``); integer hashes are
  written as signed int64 as SGLang does (same 64 bits; with this encoding the emitter takes a digest's first 8
  bytes, SGLang's id of a page: ``hashing.sglang_event_id``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtier.errors import ProtocolError
from kvtier.medium import Medium

ENCODINGS = ("vllm", "vllm-legacy", "sglang")
_U64 = (1 << 64) - 1

Hash = int | bytes


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks became available in a tier (vLLM 0.33 field set and order).

    ``block_hashes``: one per block (uint64 event id, or raw digest bytes); ``parent_block_hash``: the block just
    before ``block_hashes[0]`` (None at the start of a sequence); ``token_ids``: the tokens of every listed
    block concatenated; ``block_size``: tokens per block; ``medium``: ``"GPU"``, ``"CPU"`` (kvtier L1) or
    ``"STORAGE"`` (kvtier L2). The remaining fields exist for byte compatibility with vLLM and are None
    unless a producer sets them.
    """

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks left a tier (their last copy there is gone). vLLM 0.33 field set."""

    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Every block of every tier of this publisher is gone."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``ts``: wall-clock seconds (float64); ``events``: in order; ``data_parallel_rank``: the publisher's rank."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# SGLang field set (>= 0.5.20 tagged maps; §3). Its later optional fields are omitted when None.
class _SGLBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None


class _SGLBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[Hash]
    medium: str | None = None


def _signed(h):
    return h - (1 << 64) if isinstance(h, int) and h > 0x7FFFFFFFFFFFFFFF else h


def _legacy(ev: Event) -> list:
    if isinstance(ev, BlockStored):
        return ["BlockStored", ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                ev.lora_id, ev.medium]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", ev.block_hashes, ev.medium]
    return ["AllBlocksCleared"]


def _sglang(ev: Event):
    if isinstance(ev, BlockStored):
        return _SGLBlockStored([_signed(h) for h in ev.block_hashes], _signed(ev.parent_block_hash),
                               ev.token_ids, ev.block_size, ev.lora_id, ev.medium, ev.lora_name)
    if isinstance(ev, BlockRemoved):
        return _SGLBlockRemoved([_signed(h) for h in ev.block_hashes], ev.medium)
    return ev


class Encoder:
    """Turns an EventBatch into msgpack bytes in one of ``ENCODINGS``.

    Raises:
        ConfigError: unknown encoding name (from the constructor).
    """

    def __init__(self, encoding: str = "vllm") -> None:
        if encoding not in ENCODINGS:
            from kvtier.errors import ConfigError
            raise ConfigError(f"unknown event encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
        self.encoding = encoding
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, batch: EventBatch) -> bytes:
        if self.encoding == "vllm":
            return self._enc.encode(batch)
        convert = _legacy if self.encoding == "vllm-legacy" else _sglang
        return self._enc.encode([batch.ts, [convert(e) for e in batch.events], batch.data_parallel_rank])


def encode_batch(batch: EventBatch, encoding: str = "vllm") -> bytes:
    """Encode one batch (see ``Encoder``). Returns msgpack bytes."""
    return Encoder(encoding).encode(batch)


# ----------------------------------------------------------------------------------------- decoding

class DecodeError(ProtocolError):
    """A payload is not an event batch in any known encoding."""


_raw_decoder = msgspec.msgpack.Decoder()
_STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_STORED_MAP_KEYS = frozenset(BlockStored.__struct_fields__)
_REMOVED_MAP_KEYS = frozenset(BlockRemoved.__struct_fields__)


def _norm_hash(h, raw: bool):
    """uint64 / int64 / bin -> uint64 int (bin: last 8 bytes big-endian, left-padded when shorter)."""
    if raw or h is None:
        return h
    if isinstance(h, bool):
        raise DecodeError("block hash is a boolean")
    if isinstance(h, int):
        return h & _U64
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h)[-8:], "big")
    raise DecodeError(f"block hash of type {type(h).__name__}")


def _hashes(v, raw: bool) -> list:
    if not isinstance(v, list):
        raise DecodeError("block_hashes is not an array")
    return [_norm_hash(h, raw) for h in v]


def _event(obj, raw: bool) -> Event | None:
    """One event from a tagged array or tagged map; None for an unknown tag (skipped)."""
    if isinstance(obj, dict):
        tag, fields = obj.get("type"), obj
    elif isinstance(obj, list) and obj:
        tag = obj[0]
        if tag == "BlockStored":
            fields = dict(zip(_STORED_ORDER, obj[1:]))
        elif tag == "BlockRemoved":
            fields = dict(zip(("block_hashes", "medium"), obj[1:]))
        else:
            fields = {}
    else:
        raise DecodeError("event is neither a tagged array nor a tagged map")
    if tag == "BlockStored":
        kw = {k: v for k, v in fields.items() if k in _STORED_MAP_KEYS and v is not None}
        try:
            return BlockStored(
                block_hashes=_hashes(fields["block_hashes"], raw),
                parent_block_hash=_norm_hash(fields.get("parent_block_hash"), raw),
                token_ids=fields.get("token_ids") or [], block_size=fields.get("block_size") or 0,
                lora_id=fields.get("lora_id"), medium=fields.get("medium") or Medium.GPU,
                lora_name=fields.get("lora_name"),
                **{k: v for k, v in kw.items() if k not in _STORED_ORDER})
        except (KeyError, TypeError) as exc:
            raise DecodeError(f"BlockStored event is malformed: {exc}") from exc
    if tag == "BlockRemoved":
        if "block_hashes" not in fields:
            raise DecodeError("BlockRemoved event has no block_hashes")
        extra = {k: v for k, v in fields.items() if k in _REMOVED_MAP_KEYS and k not in ("block_hashes", "medium")}
        return BlockRemoved(_hashes(fields["block_hashes"], raw), fields.get("medium") or Medium.GPU, **extra)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


_typed_decoder = msgspec.msgpack.Decoder(EventBatch)


def _fix_typed(batch: EventBatch, raw: bool) -> EventBatch:
    """Apply the §7 rules (medium default, hash normalisation) to a batch the typed decoder accepted."""
    for ev in batch.events:
        if isinstance(ev, AllBlocksCleared):
            continue
        if ev.medium is None:
            ev.medium = Medium.GPU
        if raw:
            continue
        if not all(type(h) is int and h >= 0 for h in ev.block_hashes):
            ev.block_hashes = _hashes(ev.block_hashes, False)
        if isinstance(ev, BlockStored) and ev.parent_block_hash is not None:
            ev.parent_block_hash = _norm_hash(ev.parent_block_hash, False)
    return batch


def decode_batch(payload: bytes, *, raw_hashes: bool = False) -> EventBatch:
    """Decode a batch from any producer in §7: vLLM maps or arrays, SGLang, 2- or 3-element batches.

    Unknown map keys, trailing array elements and unknown event tags are ignored. A missing ``medium`` is
    ``"GPU"``. Hashes become uint64 ints (negative int64 wrapped, ``bin`` reduced to its last 8 bytes
    big-endian) unless ``raw_hashes`` keeps them as sent.

    Raises:
        DecodeError: not msgpack, or not shaped like an event batch.
    """
    try:  # fast path: vLLM's own map form, decoded in C; anything else takes the general path
        return _fix_typed(_typed_decoder.decode(payload), raw_hashes)
    except (msgspec.DecodeError, msgspec.ValidationError, DecodeError):
        pass
    try:
        obj = _raw_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise DecodeError("payload is not an event batch [ts, events, dp_rank?]")
    ts = obj[0]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise DecodeError("batch timestamp is not a number")
    rank = obj[2] if len(obj) > 2 else None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise DecodeError("batch data_parallel_rank is not an int")
    events = [e for e in (_event(o, raw_hashes) for o in obj[1]) if e is not None]
    return EventBatch(float(ts), events, rank)
