"""Prefix hashing, byte-compatible with vLLM's prefix-cache block hashes.

``prefix_hash[i] = H(serialize((prefix_hash[i-1] or root, tuple(chunk_i_tokens), extra_keys_i)))`` where
``H``/``serialize`` follow vLLM's ``--prefix-caching-hash-algo`` names and the root hash is ``H(seed)``
(vLLM's NONE_HASH; seed ``"vllm-none-hash"`` as in vLLM >= 0.29). With ``chunk_size`` equal to the
engine's block size the digests equal vLLM's block hashes (see shared reference
events-and-hashing.md §2). Python's ``hash()`` is never used, so every process agrees.
"""

from __future__ import annotations

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
    if arr.min() < 0:
        raise InputError(f"token ids must be non-negative; got {int(arr.min())}")
    return arr.astype(np.int64, copy=False)


def _cbor_uints(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical CBOR encodings of every token, concatenated; plus each token's start offset."""
    t = tokens.astype(np.uint64)
    lens = np.select([t < 24, t < 256, t < 65536, t < 2**32], [1, 2, 3, 5], 9).astype(np.int64)
    ends = np.cumsum(lens)
    starts = ends - lens
    out = np.zeros(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
    for width, head in ((1, None), (2, 0x18), (3, 0x19), (5, 0x1A), (9, 0x1B)):
        mask = lens == width
        if not mask.any():
            continue
        s, v = starts[mask], t[mask]
        if head is None:
            out[s] = v.astype(np.uint8)
            continue
        out[s] = head
        for b in range(width - 1):
            out[s + 1 + b] = ((v >> np.uint64(8 * (width - 2 - b))) & np.uint64(0xFF)).astype(np.uint8)
    return out, starts



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
        enc, starts = _cbor_uints(arr[: n * chunk_size] if n == n_full else arr)
        bounds = list(starts) + [len(enc)]
    else:
        as_list = arr.tolist()
    for i in range(n):
        lo, hi = i * chunk_size, min((i + 1) * chunk_size, len(arr))
        extra = None if extra_keys is None else extra_keys[i]
        if algorithm == "sha256_cbor_64bit":
            data = cbor2.dumps((int.from_bytes(prev, "big"), tuple(arr[lo:hi].tolist()), extra), canonical=True)
        elif cbor:
            tail = b"\xf6" if extra is None else cbor2.dumps(extra, canonical=True)
            # (parent, tuple(tokens), extra) as a 3-array: bstr parent, uint array, extra (nil)
            data = b"".join((b"\x83", _cbor_head(2, len(prev)), prev, _cbor_head(4, hi - lo),
                             enc[bounds[lo]:bounds[hi]].tobytes(), tail))
        else:
            data = pickle.dumps((prev, tuple(as_list[lo:hi]), extra), protocol=pickle.HIGHEST_PROTOCOL)
        prev = _digest(algorithm, data)
        out.append(prev)
    return out
