"""The kvtier trace format: what a server was asked, one JSON object per line (``msgspec``), versioned.

Line 1 is the header (``TraceHeader``): ``{"format": "kvtier-trace", "version": 1, ...}`` with the server's chunk size,
block size, L1 size, policy, retention settings and L2 adapters, and ``fields``: a description of every record
field, so a trace explains itself. Every later line is one request (``TraceRecord``), in the order the server's
request thread handled them::

    {"t": 0.0132, "op": "lookup", "session": "c:3f09a1b2c4d5", "tokens": 1100, "chunks": [1234..., 5678...],
     "bytes_per_token": 128, "hits": [3, 1], "bytes": 131072}

``chunks`` are 64-bit digests of the prompt's chunk keys (``chunk_digest``: model, layout, namespace and prefix
hash), never token ids (``token_ids`` only when the server was asked: ``server.trace_token_ids``). JSON numbers
up to 2**64: a reader whose numbers are doubles must read them as big integers. Fields a record does not use are
left out (``omit_defaults``).

``read_trace`` checks the header and each line and raises ``TraceError`` (an InputError) naming the file and the
line number: a file that is not a kvtier trace, another version, a record cut short (a trace copied while it was
written, or truncated), a record with a missing or mistyped field.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import msgspec
import xxhash

from kvtier.errors import InputError

FORMAT = "kvtier-trace"
VERSION = 1
OPS = ("lookup", "retrieve", "prefetch", "store", "end", "clear")

FIELDS = {
    "t": "seconds since the trace started (the server's monotonic clock)",
    "op": "lookup | retrieve | prefetch | store | end (of a store's or a retrieve's lease: see ticket) | clear",
    "session": "'s:' + the store's retention hint session_id, else 'c:' + a digest of the client connection",
    "tokens": "prompt length in tokens",
    "first": "index of the prompt's chunk chunks[0] is (a request's start offset // chunk_size); default 0",
    "chunks": "64-bit digests of the chunk keys, chunk first .. last (full chunks; the last may be partial)",
    "bytes_per_token": "KV bytes per token of the request's layout (chunk bytes = tokens in it x this)",
    "hits": "lookup: [leading chunks in L1, chunks after them in L2]; retrieve / prefetch: [chunks L1 held "
            "after the request (promotions included), 0]",
    "stored": "store: chunks given an L1 slot (visible at once with ticket 0, else at the end of its lease)",
    "ticket": "store / retrieve: the lease its slots are held under until the 'end' record with this ticket; "
              "0: no lease (committed or released at once)",
    "ok": "end: true when the store was committed (false: aborted, nothing stored); retrieves: true",
    "bytes": "KV bytes of the hit chunks (lookup, retrieve, prefetch) or of the slots reserved (store)",
    "priority": "store: retention hint priority (0-3)",
    "ttl_seconds": "store: retention hint TTL, null for none",
    "medium": "clear: CPU (L1), STORAGE (L2), or null for both",
    "token_ids": "the prompt's token ids, only with server.trace_token_ids",
}


class TraceError(InputError):
    """A trace file that cannot be read: the message names the file and the line."""


class TraceHeader(msgspec.Struct, kw_only=True):
    """Line 1 of a trace: the format, its version and the settings of the server that recorded it."""

    format: str
    version: int
    created_unix_seconds: float = 0.0
    chunk_size: int
    block_size: int
    save_unfull_chunk: bool = False
    l1_size_bytes: int = 0
    eviction_policy: str = "LRU"
    l1_retention_max_share: float = 0.5
    session_ttl_seconds: float = 300.0
    l2: list[dict] = []  # {"type": ..., "capacity_bytes": int | None} per adapter, in cascade order
    token_ids: bool = False
    fields: dict[str, str] = {}


class TraceRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request (see ``FIELDS``)."""

    t: Annotated[float, msgspec.Meta(ge=0)]  # seconds since the start: never before it (nor NaN)
    op: str
    session: str = ""
    tokens: int = 0
    chunks: list[int] = []
    bytes_per_token: int = 0
    first: int = 0
    hits: list[int] = []
    stored: int = 0
    bytes: int = 0
    priority: int = 0
    ttl_seconds: float | None = None
    ticket: int = 0
    ok: bool = True
    medium: str | None = None
    token_ids: list[int] | None = None


_encoder = msgspec.json.Encoder()


def encode_line(obj: TraceHeader | TraceRecord) -> bytes:
    """One line of a trace (JSON, with its newline)."""
    return _encoder.encode(obj) + b"\n"


def chunk_digest(scope: str, prefix_hash: bytes) -> int:
    """The 64-bit digest a trace names a chunk by: xxh3-64 of its key's scope (``ChunkKey.scope``: model, layout,
    namespace) and prefix hash."""
    return xxhash.xxh3_64_intdigest(prefix_hash, seed=int(scope, 16))


_header_decoder = msgspec.json.Decoder(TraceHeader)
_record_decoder = msgspec.json.Decoder(TraceRecord)


def _check_header(path: str, line: bytes) -> TraceHeader:
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise TraceError(f"{path}: line 1 is not a kvtier trace header (not JSON: {exc}); record one with "
                         "kvtier server --trace-file") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise TraceError(f"{path}: line 1 is not a kvtier trace header (no \"format\": \"{FORMAT}\"); record one "
                         "with kvtier server --trace-file")
    if raw.get("version") != VERSION:
        raise TraceError(f"{path}: line 1: trace format version {raw.get('version')!r}, this kvtier reads version "
                         f"{VERSION}; replay it with the kvtier version that recorded it, or record a new trace")
    try:
        return _header_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{path}: line 1: bad trace header: {exc}") from None


def read_trace(path: str | Path) -> tuple[TraceHeader, Iterator[tuple[int, TraceRecord]]]:
    """Open a trace: its header, and an iterator of (line number, record) over the rest, read as it goes.

    Raises TraceError naming the line: at once for a missing or bad header (another format, another version);
    while iterating, for a line that is not a whole record (cut short, not JSON, a field missing or of the wrong
    type, an unknown ``op``). OSError for a file that cannot be opened.
    """
    path = str(path)
    fh = open(path, "rb")  # noqa: SIM115 -- closed by the iterator (or here, on a bad header)
    try:
        first = fh.readline()
        if not first:
            raise TraceError(f"{path}: empty file, not a kvtier trace (line 1 should be its header)")
        header = _check_header(path, first)
    except BaseException:
        fh.close()
        raise
    return header, _records(path, fh)


def _records(path: str, fh) -> Iterator[tuple[int, TraceRecord]]:
    decode = _record_decoder.decode
    with fh:
        for number, line in enumerate(fh, start=2):
            if not line.endswith(b"\n"):
                raise TraceError(f"{path}: line {number} is cut short (no end of line): the trace is truncated; "
                                 f"drop that line (e.g. head -n {number - 1}) or record it again")
            try:
                record = decode(line)
            except msgspec.ValidationError as exc:
                raise TraceError(f"{path}: line {number}: bad record: {exc}") from None
            except msgspec.DecodeError as exc:
                if not line.strip():
                    continue
                raise TraceError(f"{path}: line {number} is not a whole JSON record ({exc}): the trace is damaged or "
                                 "truncated") from None
            if record.op not in OPS:
                raise TraceError(f"{path}: line {number}: unknown op {record.op!r}; valid: {', '.join(OPS)}")
            yield number, record
