"""Hand-made kvtier traces for the simulator's tests: a header and records written with ``kvtier.trace.format``."""

from __future__ import annotations

from pathlib import Path

from kvtier.trace.format import FORMAT, VERSION, TraceHeader, TraceRecord, encode_line

CHUNK = 16  # tokens per chunk
BYTES_PER_TOKEN = 128  # 2048 bytes per chunk
CHUNK_BYTES = CHUNK * BYTES_PER_TOKEN


def header(**fields) -> TraceHeader:
    values = {"format": FORMAT, "version": VERSION, "chunk_size": CHUNK, "block_size": CHUNK,
              "l1_size_bytes": 64 * CHUNK_BYTES, "eviction_policy": "LRU", **fields}
    return TraceHeader(**values)


def common(chunks: list[int], session: str = "c:test") -> dict:
    """The fields every request record of a prompt of whole ``chunks`` has."""
    return {"session": session, "tokens": len(chunks) * CHUNK, "chunks": chunks, "bytes_per_token": BYTES_PER_TOKEN}


def turn(t: float, chunks: list[int], session: str = "c:test", **store) -> list[TraceRecord]:
    """What a client does for one prompt of whole chunks, without leases (frames): lookup, retrieve, store (with
    ``store`` fields: a hint)."""
    fields = common(chunks, session)
    return [TraceRecord(t=t, op="lookup", hits=[0, 0], **fields),
            TraceRecord(t=t, op="retrieve", hits=[0, 0], **fields),
            TraceRecord(t=t, op="store", **fields, **store)]


def write_trace(path: Path, records: list[TraceRecord], **header_fields) -> Path:
    with open(path, "wb") as fh:
        fh.write(encode_line(header(**header_fields)))
        for record in records:
            fh.write(encode_line(record))
    return path


def cycle(prompts: list[list[int]], passes: int) -> list[TraceRecord]:
    """Every prompt in turn, ``passes`` times over."""
    out, t = [], 0.0
    for _ in range(passes):
        for chunks in prompts:
            t += 1.0
            out += turn(t, chunks)
    return out
