"""Prefix hashing, byte-compatible with vLLM's prefix-cache block hashes.

``prefix_hash[i] = H(serialize((prefix_hash[i-1] or root, tuple(chunk_i_tokens), extra_keys_i)))`` where
``H``/``serialize`` follow vLLM's ``--prefix-caching-hash-algo`` names and the root hash is ``H(seed)``
(vLLM's NONE_HASH; seed ``"vllm-none-hash"`` as in vLLM >= 0.29). With ``chunk_size`` equal to the
engine's block size the digests equal vLLM's block hashes (see shared reference
events-and-hashing.md §2). Python's ``hash()`` is never used, so every process agrees.
"""

from __future__ import annotations

import array
import hashlib
import pickle  # only to reproduce vLLM's "sha256" digest input; nothing pickled leaves the process
from collections.abc import Sequence

import cbor2
import numpy as np
import xxhash

from kvtier.errors import ConfigError, InputError

ALGORITHMS = ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor", "sha256_cbor_64bit")
DEFAULT_ALGORITHM = "sha256_cbor"
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
    """The parent of chunk 0 (vLLM NONE_HASH): ``H(serialize(seed))``; 8 bytes for sha256_cbor_64bit."""
    check_algorithm(algorithm)
    return _digest(algorithm, _serialize(algorithm, str(seed)))


def event_id(digest: bytes) -> int:
    """Low 64 bits of a digest, big-endian, as vLLM publishes block hashes in KV events."""
    return int.from_bytes(digest[-8:], "big")


def as_token_array(tokens) -> np.ndarray:
    """Validate tokens as a 1-D sequence of non-negative ints; return them as an int64 numpy array.

    Accepts a list, tuple, numpy array or torch tensor. Raises InputError otherwise.
    """
    if hasattr(tokens, "detach"):  # torch tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, (list, tuple)):
        try:  # array("Q") is the fastest strict conversion of a list: floats and negatives raise
            arr = np.frombuffer(array.array("Q", tokens), dtype=np.int64) if tokens else np.zeros(0, np.int64)
        except (TypeError, OverflowError):
            arr = _as_array_slow(tokens)
    else:
        arr = _as_array_slow(tokens)
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


def _small_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For 0..65535: CBOR encodings packed in a uint32 (bytes in encoding order), a uint32 whose
    bytes are 1 where the encoding has a byte, and the lengths (1, 2 or 3)."""
    v = np.arange(65536, dtype=np.int64)
    lens = 1 + (v >= 24) + (v >= 256)
    enc = np.zeros((65536, 4), np.uint8)
    enc[:24, 0] = v[:24]
    enc[24:256, 0], enc[24:256, 1] = 0x18, v[24:256]
    enc[256:, 0], enc[256:, 1], enc[256:, 2] = 0x19, v[256:] >> 8, v[256:] & 0xFF
    mask = (np.arange(4) < lens[:, None]).astype(np.uint8)
    return enc.view(np.uint32).ravel(), mask.view(np.uint32).ravel(), lens


_TABLE: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def _cbor_uints(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical CBOR encodings of every token, concatenated, and each token's encoded length.

    Gathers from a 65536-entry table (4 bytes a token) then drops the unused bytes: several times
    faster than encoding token by token, and identical to ``cbor2.dumps(..., canonical=True)``.
    """
    global _TABLE
    if tokens.size and int(tokens.max()) < 65536:
        if _TABLE is None:
            _TABLE = _small_table()
        enc, mask, lens_of = _TABLE
        rows = enc[tokens].view(np.uint8)
        keep = mask[tokens].view(np.bool_)
        return rows[keep], lens_of[tokens]
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


def prefix_hashes(
    tokens,
    chunk_size: int,
    algorithm: str = DEFAULT_ALGORITHM,
    seed: str = DEFAULT_SEED,
    extra_keys: Sequence | None = None,
    *,
    include_partial: bool = False,
    parent: bytes | None = None,
) -> list[bytes]:
    """One digest per full chunk of ``tokens`` (plus the trailing partial chunk if ``include_partial``).

    Args:
        tokens: 1-D sequence of non-negative token ids.
        chunk_size: tokens per chunk (> 0). Equal to the engine block size, digests equal vLLM's block hashes.
        algorithm: one of ``ALGORITHMS`` (vLLM ``--prefix-caching-hash-algo`` names).
        seed: root-hash seed (vLLM uses ``$PYTHONHASHSEED`` or ``"vllm-none-hash"``).
        extra_keys: ``None`` or one entry per chunk (``None`` or a tuple: LoRA name, cache salt, ...).
        include_partial: also hash the last, shorter chunk (``save_unfull_chunk``).
        parent: digest preceding ``tokens[0]`` (default: the root hash).

    Returns:
        list of digests: 32 bytes (sha256*), 16 bytes (xxhash*), 8 bytes (sha256_cbor_64bit).

    Raises:
        InputError: bad tokens, ``chunk_size <= 0``, or ``extra_keys`` of the wrong length.
        ConfigError: unknown algorithm.
    """
    check_algorithm(algorithm)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise InputError(f"chunk_size must be a positive int, got {chunk_size!r}")
    arr = as_token_array(tokens)
    n_full = len(arr) // chunk_size
    n = n_full + (1 if include_partial and len(arr) % chunk_size else 0)
    if extra_keys is not None and len(extra_keys) < n:
        raise InputError(f"extra_keys has {len(extra_keys)} entries; need one per chunk ({n})")
    prev = parent if parent is not None else root_hash(algorithm, seed)
    out: list[bytes] = []
    if n == 0:
        return out
    cbor = algorithm in ("sha256_cbor", "xxhash_cbor")
    if cbor:
        enc, lens = _cbor_uints(arr[: n * chunk_size] if n == n_full else arr)
        # byte offset of each chunk boundary in enc
        per_chunk = np.add.reduceat(lens, np.arange(0, len(lens), chunk_size))
        bounds = np.concatenate([[0], np.cumsum(per_chunk)]).tolist()
        enc_bytes = enc.tobytes()
        # (parent, tuple(tokens), extra) is a CBOR 3-array: bstr parent, uint array, extra (nil)
        head = b"\x83" + _cbor_head(2, len(prev))
        full_array = _cbor_head(4, chunk_size)
        fn = hashlib.sha256 if algorithm == "sha256_cbor" else xxhash.xxh3_128
    else:
        as_list = arr.tolist()
    for i in range(n):
        lo, hi = i * chunk_size, min((i + 1) * chunk_size, len(arr))
        extra = None if extra_keys is None else extra_keys[i]
        if cbor:
            tail = b"\xf6" if extra is None else cbor2.dumps(extra, canonical=True)
            array_head = full_array if hi - lo == chunk_size else _cbor_head(4, hi - lo)
            prev = fn(b"".join((head, prev, array_head, enc_bytes[bounds[i]:bounds[i + 1]], tail))).digest()
        else:
            if algorithm == "sha256_cbor_64bit":
                data = cbor2.dumps((int.from_bytes(prev, "big"), tuple(as_list[lo:hi]), extra), canonical=True)
            else:
                data = pickle.dumps((prev, tuple(as_list[lo:hi]), extra), protocol=pickle.HIGHEST_PROTOCOL)
            prev = _digest(algorithm, data)
        out.append(prev)
    return out
