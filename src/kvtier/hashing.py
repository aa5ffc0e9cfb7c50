"""Prefix hashing, byte-compatible with vLLM's prefix-cache block hashes.

``digest[i] = H(serialize((digest[i-1] or root, tuple(block_i_tokens), extra_keys_i)))``, block by block
(vLLM 0.32 ``hash_block_tokens``), where ``H``/``serialize`` follow vLLM's ``--prefix-caching-hash-algo``
names and the root hash is ``H(seed)`` (vLLM's NONE_HASH; seed ``"vllm-none-hash"`` as in vLLM >= 0.29).
With the engine's block size, algorithm, seed and per-block extra keys the digests equal vLLM's block
hashes (shared reference events-and-hashing.md §2); a chunk is keyed by the digest of its last block.
Python's ``hash()`` is never used, so every process agrees.
"""

from __future__ import annotations

import array
import functools
import hashlib
import pickle  # only to reproduce vLLM's "sha256" digest input; nothing pickled leaves the process
from collections.abc import Sequence

import cbor2
import numpy as np
import xxhash

from kvtier.errors import ConfigError, InputError

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "sha256_cbor_64bit")
DEFAULT_ALGORITHM = "sha256"  # vLLM 0.32's default prefix_caching_hash_algo
DEFAULT_SEED = "vllm-none-hash"


def check_algorithm(algorithm: str) -> str:
    """Return ``algorithm`` if known. Raises ConfigError listing the valid names."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown hash algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    return algorithm


def _digest(algorithm: str, data: bytes) -> bytes:
    if algorithm.startswith("sha256"):
        out = hashlib.sha256(data).digest()
        return out[-8:] if algorithm == "sha256_cbor_64bit" else out
    return xxhash.xxh3_128_digest(data)


def _serialize(algorithm: str, obj) -> bytes:
    if algorithm in ("sha256", "xxhash"):
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return cbor2.dumps(obj, canonical=True)


def root_hash(algorithm: str = DEFAULT_ALGORITHM, seed: str = DEFAULT_SEED) -> bytes:
    """The parent of block 0 (vLLM NONE_HASH): ``H(serialize(seed))``; 8 bytes for sha256_cbor_64bit."""
    check_algorithm(algorithm)
    return _root_hash(algorithm, str(seed))


@functools.lru_cache(maxsize=64)  # one per (algorithm, seed) a process hashes with: a handful
def _root_hash(algorithm: str, seed: str) -> bytes:
    return _digest(algorithm, _serialize(algorithm, seed))


def event_id(digest: bytes) -> int:
    """Low 64 bits of a digest, big-endian, as vLLM publishes block hashes in KV events."""
    return int.from_bytes(digest[-8:], "big")


def sglang_event_id(digest: bytes) -> int:
    """High 64 bits of a digest, big-endian, as uint64: SGLang's block id of a page (``hash_str_to_int64`` of its
    hex key, ``sglang.srt.mem_cache.utils``; the ``sglang`` event encoding writes it as the signed int64)."""
    return int.from_bytes(digest[:8], "big")


def as_token_array(tokens, *, check_ids: bool = True) -> np.ndarray:
    """Validate tokens as a 1-D sequence of non-negative ints; return them as an int64 numpy array.

    Accepts a list, tuple, numpy array or torch tensor. Raises InputError otherwise. ``check_ids`` False: the
    ids' sign is left to ``check_token_ids`` (a caller that has seen these exact ids before skips it).
    """
    if hasattr(tokens, "detach"):  # torch tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, (list, tuple)):
        try:  # array("Q") is the fastest strict conversion of a list: floats and negatives raise
            arr = np.frombuffer(array.array("Q", tokens), dtype=np.int64) if tokens else np.zeros(0, np.int64)
        except (TypeError, OverflowError):
            arr = _as_array_slow(tokens)
    elif isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype == np.int64:  # the wire's tokens
        arr = tokens
    else:
        arr = _as_array_slow(tokens)
    return check_token_ids(arr) if check_ids else arr


def check_token_ids(arr: np.ndarray) -> np.ndarray:
    """``arr`` (1-D int64) when every id is non-negative (ids of 2**63 and more arrive here negative). Raises
    InputError naming the smallest id otherwise."""
    if arr.size and arr.min() < 0:
        raise InputError(f"token ids must be non-negative; got {int(arr.min())}")
    return arr


def _as_array_slow(tokens) -> np.ndarray:
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError):
        raise InputError("tokens must be a 1-D sequence of non-negative ints (token ids)") from None
    if arr.ndim != 1:
        raise InputError(f"tokens must be 1-D; got shape {arr.shape}. Pass one prompt's token ids at a time")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"tokens must be ints; got dtype {arr.dtype}. Tokenize the text first")
    if arr.dtype == np.uint64 and arr.max() >= 2**63:
        raise InputError("token ids must be below 2**63")
    return arr.astype(np.int64, copy=False)


def _cbor_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For 0..65535: canonical CBOR of the uint (1-3 bytes: value, 0x18 v, 0x19 hi lo)."""
    v = np.arange(65536, dtype=np.int64)
    lens = 1 + (v >= 24) + (v >= 256)
    enc = np.zeros((65536, 4), np.uint8)
    enc[:24, 0] = v[:24]
    enc[24:256, 0], enc[24:256, 1] = 0x18, v[24:256]
    enc[256:, 0], enc[256:, 1], enc[256:, 2] = 0x19, v[256:] >> 8, v[256:] & 0xFF
    return _packed(enc, lens)


def _pickle_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For 0..65535: the pickle opcode of the int (BININT1 v, or BININT2 lo hi)."""
    v = np.arange(65536, dtype=np.int64)
    lens = 2 + (v >= 256)
    enc = np.zeros((65536, 4), np.uint8)
    enc[:256, 0], enc[:256, 1] = 0x4B, v[:256]
    enc[256:, 0], enc[256:, 1], enc[256:, 2] = 0x4D, v[256:] & 0xFF, v[256:] >> 8
    return _packed(enc, lens)


def _packed(enc: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encodings packed in a uint32 each (bytes in encoding order), a uint32 whose bytes are 1 where the
    encoding has a byte, and the lengths."""
    mask = (np.arange(4) < lens[:, None]).astype(np.uint8)
    return enc.view(np.uint32).ravel(), mask.view(np.uint32).ravel(), lens


_TABLES: dict = {}


def _gather(tokens: np.ndarray, build) -> tuple[np.ndarray, np.ndarray]:
    """Every token's encoding from a 65536-entry table (4 bytes a token), unused bytes dropped: several times
    faster than encoding token by token. Tokens must be < 65536."""
    table = _TABLES.get(build) or _TABLES.setdefault(build, build())
    enc, mask, lens_of = table
    return enc[tokens].view(np.uint8)[mask[tokens].view(np.bool_)], lens_of[tokens]


def _cbor_uints(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical CBOR encodings of every token, concatenated, and each token's encoded length;
    identical to ``cbor2.dumps(..., canonical=True)``."""
    if tokens.size and int(tokens.max()) < 65536:
        return _gather(tokens, _cbor_table)
    # general case: head byte + the low (width - 1) bytes of the big-endian uint64
    t = tokens.astype(np.uint64)
    lens = (1 + (t >= 24) + (t >= 256) + 2 * (t >= 65536) + 4 * (t >= 2**32)).astype(np.int64)
    head = _heads(t, lens)
    rows = np.concatenate([head[:, None], t.astype(">u8").view(np.uint8).reshape(-1, 8)], axis=1)
    col = np.arange(9)
    return rows[(col >= (10 - lens)[:, None]) | (col == 0)], lens


def _heads(t: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """CBOR initial byte of each unsigned int: the value itself below 24, else 0x18/0x19/0x1A/0x1B by width."""
    head = np.full(len(t), 0x1B, np.uint8)
    for width, byte in ((5, 0x1A), (3, 0x19), (2, 0x18)):
        head[lens == width] = byte
    small = lens == 1
    head[small] = t[small].astype(np.uint8)
    return head


def _cbor_head(major: int, n: int) -> bytes:
    """CBOR initial byte(s) for major type ``major`` with argument ``n`` (shortest form, as canonical CBOR)."""
    if n < 24:
        return bytes([major << 5 | n])
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | extra]) + n.to_bytes(width, "big")
    raise InputError(f"length {n} too large for CBOR")


# Pickle protocol 5 (what vLLM's "sha256"/"xxhash" hash) of ``(parent: bytes, tuple(block tokens), None)``:
#   PROTO 5 | FRAME <u64 LE length of the rest> | SHORT_BINBYTES <len> parent | MEMOIZE
#   | MARK <each token> TUPLE MEMOIZE | NONE TUPLE3 MEMOIZE | STOP
# A token is BININT1 (< 256), BININT2 (< 65536) or BININT (< 2**31, 4 bytes LE). Token ids >= 2**31 (LONG1),
# blocks of 1-3 tokens (TUPLE1-3), blocks with extra keys and blocks whose pickle would span two frames (>= 64 KiB)
# go through pickle.dumps itself. tests/unit/keys/test_hashing.py proves the bytes equal pickle.dumps(..., protocol=5).
# The table encoders (``_pickle_chain``, ``_cbor_chain``) pay a fixed cost and read 256 KiB tables: below these
# lengths encoding block by block is faster, much more so in a server whose caches are cold at each request
# (median µs over 256 / 2,048 / 8,192 tokens, blocks of 16, caches flushed before each call: pickle 45 / 199 / 721
# block by block vs 127 / 306 / 870 with the table; CBOR 72 / 345 / 1,354 vs 105 / 262 / 778).
_PICKLE_TABLE_MIN_TOKENS = 8192
_CBOR_TABLE_MIN_TOKENS = 1024
_PICKLE_MAX_BLOCK = 12_000  # tokens: 5 bytes each at most, so the block stays inside one 64 KiB frame
_PICKLE_KEEP = np.arange(5) < np.arange(6)[:, None]  # row ``len``: which of a token's 5 bytes its encoding uses


def _pickle_uints(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pickle opcodes of every token (all < 2**31), concatenated, and each token's encoded length (2, 3 or 5)."""
    if tokens.size and int(tokens.max()) < 65536:
        return _gather(tokens, _pickle_table)
    t = tokens.astype("<u4")
    lens = 2 + (t >= 256).astype(np.int64) + 2 * (t >= 65536)
    rows = np.empty((len(t), 5), np.uint8)
    rows[:, 0] = np.array([0, 0, 0x4B, 0x4D, 0, 0x4A], np.uint8)[lens]  # BININT1, BININT2, BININT
    rows[:, 1:] = t.view(np.uint8).reshape(-1, 4)
    return rows[_PICKLE_KEEP[lens]], lens


def _boundaries(lens: np.ndarray, block_size: int) -> list[int]:
    """Byte offset of every block boundary in the concatenated token encodings (``lens`` bytes per token)."""
    per_block = np.add.reduceat(lens, np.arange(0, len(lens), block_size))
    return np.concatenate([[0], np.cumsum(per_block)]).tolist()


def prefix_hashes(
    tokens,
    block_size: int,
    algorithm: str = DEFAULT_ALGORITHM,
    seed: str = DEFAULT_SEED,
    extra_keys: Sequence | None = None,
    *,
    include_partial: bool = False,
    parent: bytes | None = None,
) -> list[bytes]:
    """One digest per full block of ``tokens`` (plus the trailing partial block if ``include_partial``).

    ``digest[i] = H(serialize((digest[i-1] or root, tuple(block_i_tokens), extra_keys[i])))``: vLLM 0.32's
    ``hash_block_tokens`` chain. With the engine's block size, algorithm, seed and per-block extra keys the
    digests ARE the engine's block hashes (``request.block_hashes``). A chunk's key is the digest of its last block.

    Args:
        tokens: 1-D sequence of non-negative token ids.
        block_size: tokens per block (> 0): the engine's block size (``block_size`` in the config).
        algorithm: one of ``ALGORITHMS`` (vLLM ``--prefix-caching-hash-algo`` names).
        seed: root-hash seed (vLLM uses ``$PYTHONHASHSEED`` or ``"vllm-none-hash"``).
        extra_keys: ``None`` or one entry per block (``None`` or a tuple in vLLM's tagged form, e.g.
            ``(("lora", name, path),)``; see ``kvtier.identity``). Tuples, not lists: pickle tells them apart.
        include_partial: also hash the last, shorter block (``save_unfull_chunk``).
        parent: digest preceding ``tokens[0]`` (default: the root hash).

    Returns:
        list of digests: 32 bytes (sha256*), 16 bytes (xxhash*), 8 bytes (sha256_cbor_64bit).

    Raises:
        InputError: bad tokens, ``block_size <= 0``, or fewer ``extra_keys`` entries than blocks.
        ConfigError: unknown algorithm.
    """
    check_algorithm(algorithm)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise InputError(f"block_size must be a positive int, got {block_size!r}")
    arr = as_token_array(tokens)
    n_full = len(arr) // block_size
    n = n_full + (1 if include_partial and len(arr) % block_size else 0)
    if extra_keys is not None and len(extra_keys) < n:
        raise InputError(f"extra_keys has {len(extra_keys)} entries; need one per block ({n})")
    prev = parent if parent is not None else root_hash(algorithm, seed)
    if n == 0:
        return []
    arr = arr[: n * block_size] if n == n_full else arr
    if algorithm in ("sha256_cbor", "xxhash_cbor") and len(arr) >= _CBOR_TABLE_MIN_TOKENS:
        return _cbor_chain(arr, block_size, n, algorithm, prev, extra_keys)
    if (algorithm in ("sha256", "xxhash") and len(arr) >= _PICKLE_TABLE_MIN_TOKENS
            and 3 < block_size <= _PICKLE_MAX_BLOCK and int(arr.max()) < 2**31):
        return _pickle_chain(arr, block_size, n, algorithm, prev, extra_keys)
    out: list[bytes] = []
    as_list = arr.tolist()
    for i in range(n):
        block = tuple(as_list[i * block_size:(i + 1) * block_size])
        extra = None if extra_keys is None else extra_keys[i]
        if algorithm == "sha256_cbor_64bit":
            data = cbor2.dumps((int.from_bytes(prev, "big"), block, extra), canonical=True)
        else:
            data = _serialize(algorithm, (prev, block, extra))
        prev = _digest(algorithm, data)
        out.append(prev)
    return out


def _cbor_chain(arr, block_size, n, algorithm, prev, extra_keys) -> list[bytes]:
    enc, lens = _cbor_uints(arr)
    bounds = _boundaries(lens, block_size)
    enc_bytes = enc.tobytes()
    # (parent, tuple(tokens), extra) is a CBOR 3-array: bstr parent, uint array, extra (nil)
    head = b"\x83" + _cbor_head(2, len(prev))
    full_array = _cbor_head(4, block_size)
    fn = hashlib.sha256 if algorithm == "sha256_cbor" else xxhash.xxh3_128
    out: list[bytes] = []
    for i in range(n):
        extra = None if extra_keys is None else extra_keys[i]
        tail = b"\xf6" if extra is None else cbor2.dumps(extra, canonical=True)
        size = min(block_size, len(arr) - i * block_size)
        array_head = full_array if size == block_size else _cbor_head(4, size)
        prev = fn(b"".join((head, prev, array_head, enc_bytes[bounds[i]:bounds[i + 1]], tail))).digest()
        out.append(prev)
    return out


def _pickle_chain(arr, block_size, n, algorithm, prev, extra_keys) -> list[bytes]:
    enc, lens = _pickle_uints(arr)
    bounds = _boundaries(lens, block_size)
    enc_bytes = enc.tobytes()
    # per block: PROTO, FRAME and its length, SHORT_BINBYTES and the parent's length (13 bytes)
    frames = np.diff(np.asarray(bounds, np.uint64)) + np.uint64(len(prev) + 10)
    heads = np.empty((n, 13), np.uint8)
    heads[:, :3] = (0x80, 0x05, 0x95)
    heads[:, 3:11] = frames.astype("<u8").view(np.uint8).reshape(-1, 8)
    heads[:, 11:] = (ord("C"), len(prev))
    heads = heads.tobytes()
    fn = hashlib.sha256 if algorithm == "sha256" else xxhash.xxh3_128
    as_list = None
    out: list[bytes] = []
    for i in range(n):
        lo, hi = i * block_size, min((i + 1) * block_size, len(arr))
        extra = None if extra_keys is None else extra_keys[i]
        if extra is None and hi - lo > 3:
            data = b"".join((heads[13 * i:13 * i + 13], prev, b"\x94(", enc_bytes[bounds[i]:bounds[i + 1]],
                             b"t\x94N\x87\x94."))
        else:  # extra keys (LoRA, salt, images: pickle shares a memo across the tuple) or 1-3 tokens
            if as_list is None:
                as_list = arr.tolist()
            data = pickle.dumps((prev, tuple(as_list[lo:hi]), extra), protocol=pickle.HIGHEST_PROTOCOL)
        prev = fn(data).digest()
        out.append(prev)
    return out
