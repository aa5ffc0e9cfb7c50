"""PageChain: a prompt named by its pages' prefix hashes, computed by the engine, instead of by its tokens.

SGLang's HiCache hands a storage backend page keys, never tokens: ``key[i]`` is the hex SHA-256 of
``key[i-1] || page i's tokens as uint32 LE`` (seeded by the request's namespace digest), so each key already
identifies the token prefix up to its page's end, as kvtier's prefix hashes do. A ``PageChain`` carries such keys
where every ``KVBackend`` method takes ``tokens``: each page is one chunk whose ``ChunkKey.prefix_hash`` is the
page's digest (model, KV layout and namespace are added by the backend, as for a token prompt), and nothing is
hashed again. Token counts in the answers are pages times ``page_size``.

A chain names no token ids: where a cache needs a prompt's token array it gets ``UNKNOWN_TOKEN`` (-1, never a
real id) for each of the chain's tokens, so a page's L2 record says how many tokens it holds (and matches only a
record of a page, whose key is checked too), and ``BlockStored`` events of its chunks carry no ``token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.errors import InputError

UNKNOWN_TOKEN = -1  # a PageChain's token ids in a cache's token array: unknown (real ids are >= 0)
MAX_DIGEST_BYTES = 64  # SGLang's keys are SHA-256 (32 bytes); room for a longer hash, never for a payload


@dataclass(frozen=True, slots=True)
class PageChain:
    """Consecutive pages of one sequence, by their prefix hashes.

    Attributes:
        hashes: the pages' digests in sequence order (bytes, 1-64 each; SGLang: ``bytes.fromhex(key)``, 32).
        page_size: tokens per page (SGLang's ``--page-size``), > 0.
        parent: the digest of the page just before ``hashes[0]``, or None when ``hashes[0]`` is the sequence's
            first page or the engine did not say (SGLang passes it only with ``hicache_storage_pass_prefix_keys``);
            events name it as the first page's parent.

    Raises:
        InputError: a digest that is not 1-64 bytes, a bad page size, or a bad parent (from the constructor).
    """

    hashes: tuple[bytes, ...]
    page_size: int
    parent: bytes | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size <= 0:
            raise InputError(f"PageChain.page_size must be a positive int (tokens per page), got {self.page_size!r}")
        for what, digest in [*(("hashes", h) for h in self.hashes), *([("parent", self.parent)] if self.parent else [])]:
            if not isinstance(digest, bytes) or not 0 < len(digest) <= MAX_DIGEST_BYTES:
                raise InputError(f"PageChain.{what}: a page digest must be 1-{MAX_DIGEST_BYTES} bytes, got {digest!r:.80}")

    @classmethod
    def from_hex(cls, keys, page_size: int, prefix_keys=None) -> "PageChain":
        """The chain of SGLang's hex page keys ``keys``; ``prefix_keys``: the keys before them (SGLang's
        ``HiCacheStorageExtraInfo.prefix_keys``), or None. Raises InputError on a key that is not hex."""
        try:
            hashes = tuple(bytes.fromhex(k) for k in keys)
            parent = bytes.fromhex(prefix_keys[-1]) if prefix_keys else None
        except (TypeError, ValueError) as exc:
            raise InputError(f"SGLang page keys must be hex strings: {exc}") from None
        return cls(hashes, page_size, parent)

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def num_tokens(self) -> int:
        """Tokens the chain covers: pages times ``page_size``."""
        return len(self.hashes) * self.page_size

    def token_array(self) -> np.ndarray:
        """``num_tokens`` times ``UNKNOWN_TOKEN`` (int64): the chain's token array in a cache."""
        return np.full(self.num_tokens, UNKNOWN_TOKEN, dtype=np.int64)
