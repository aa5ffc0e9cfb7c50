"""Real L2 records for the adapter contract suites (tests/contract/l2/): ``record.encode_record`` over a real prefix
hash and KV layout, checked with ``record.decode_record``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.hashing import prefix_hashes
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.record import decode_record, encode_record, record_size

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMALL = KVLayout(num_layers=1, num_kv_heads=1, head_dim=32)  # 256 bytes per token in fp32
SIZES = {  # (layout, tokens per chunk) -> payload bytes
    "1KiB": (SMALL, 4),
    "1MiB": (KVLayout(num_layers=4, num_kv_heads=4, head_dim=64), 128),
    "11.25MiB": (KVLayout(num_layers=30, num_kv_heads=3, head_dim=64), 256),  # SmolLM2-135M, 256 tokens
    "64MiB": (KVLayout(num_layers=32, num_kv_heads=8, head_dim=128), 256),
}


@dataclass
class Rec:
    key: ChunkKey
    tokens: list[int]
    parts: list
    payload: bytes

    @property
    def name(self) -> str:
        return self.key.name()

    @property
    def nbytes(self) -> int:
        return record_size(self.parts)


def make_record(seed: int, layout: KVLayout = SMALL, num_tokens: int = 4, tokens: list[int] | None = None) -> Rec:
    rng = np.random.default_rng(seed)
    if tokens is None:  # ids >= 1000: every id takes 3 msgpack bytes, so equal shapes give equal sizes
        tokens = rng.integers(1000, 50_000, num_tokens).tolist()
    key = ChunkKey(MODEL, layout.layout_id, "", prefix_hashes(tokens, len(tokens))[0])
    payload = rng.bytes(layout.chunk_bytes(len(tokens)))
    return Rec(key, tokens, encode_record(key, layout, tokens, payload), payload)


def assert_record(buf, rec: Rec) -> None:
    assert buf is not None, f"{rec.name} missing"
    _, payload = decode_record(buf, key=rec.key, token_ids=rec.tokens)
    assert bytes(payload) == rec.payload
