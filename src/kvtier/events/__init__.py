"""KV cache events: vLLM-compatible types and encodings, the emitter the cache calls, ZMQ publisher with replay,
and a subscriber (see reference events-and-hashing.md §1-§3, §7)."""

from kvtier.events.emitter import EventEmitter
from kvtier.events.model import (
    ENCODINGS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Encoder,
    Event,
    EventBatch,
    decode_batch,
    encode_batch,
)
from kvtier.events.publisher import EventPublisher, should_bind
from kvtier.events.replay import END_SEQ
from kvtier.events.block_index import BlockIndex
from kvtier.events.subscriber import Gap, Subscriber, SubscriberStats

__all__ = [
    "ENCODINGS", "END_SEQ", "AllBlocksCleared", "BlockIndex", "BlockRemoved", "BlockStored", "DecodeError",
    "Encoder", "Event", "EventBatch", "EventEmitter", "EventPublisher", "Gap", "Subscriber", "SubscriberStats",
    "decode_batch", "encode_batch", "should_bind",
]
