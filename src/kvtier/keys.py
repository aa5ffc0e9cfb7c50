"""ChunkKey: the one key type of kvtier (model, KV layout, namespace, prefix hash)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import cbor2
import xxhash

from kvtier.hashing import as_token_array


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Identity of one stored chunk.

    Attributes:
        model: the weights' identity (``identity.model_identity``, e.g. ``"smollm2-135m-instruct@1f0c..."``), or a
            model id the user sets and changes whenever the weights change; never a served name alone.
        layout_id: ``chunk_layout_id(KVLayout.layout_id, chunk_size)``: dtype, layers, KV heads, head dim, TP
            split, and the chunk size (a chunk's key names where its tokens end, the chunk size where they start).
        namespace: ``namespace_of(...)``: isolates KV that must not be shared (LoRA adapter identity, cache salt);
            ``""`` for the base model.
        prefix_hash: digest of the chunk's last block (``hashing.prefix_hashes``): identifies the token prefix
            up to the chunk's end, with the engine's extra keys (LoRA, salt, multimodal items).

    A key is immutable; its hash is computed once and its ``name()`` on first use (a prompt's keys are memoised
    with its chunk refs, so a lookup asks L1 and the L2 indexes without hashing or formatting again).
    """

    model: str
    layout_id: str
    namespace: str
    prefix_hash: bytes
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _name: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.model, self.layout_id, self.namespace, self.prefix_hash)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def scope(self) -> str:
        """16 hex chars for (model, layout_id, namespace): every chunk of one cache shares it."""
        return scope_of(self.model, self.layout_id, self.namespace)

    def name(self) -> str:
        """Filename- and object-name-safe form ``<scope>-<prefix hash hex>`` (hex only); made once per key."""
        if not self._name:
            object.__setattr__(self, "_name", f"{self.scope}-{self.prefix_hash.hex()}")
        return self._name


@functools.lru_cache(maxsize=4096)  # a server's caches and namespaces: every new key of one asks again
def scope_of(model: str, layout_id: str, namespace: str = "") -> str:
    """Hex scope of (model, layout_id, namespace); fields are length-prefixed so none can collide."""
    parts = [model.encode(), layout_id.encode(), namespace.encode()]
    return xxhash.xxh3_64_hexdigest(b"".join(len(p).to_bytes(4, "big") + p for p in parts))


def chunk_layout_id(layout_id: str, chunk_size: int) -> str:
    """The ``layout_id`` of a ChunkKey: the KV layout's id and the chunk size (``"<layout id>-<chunk size>"``)."""
    return f"{layout_id}-{chunk_size}"


def namespace_of(lora: str | None = None, cache_salt: str | None = None) -> str:
    """The namespace of a LoRA adapter and/or a cache salt: ``""`` when neither is set, else 32 hex chars of
    SHA-256 over the canonical CBOR array ``[lora, cache_salt]`` (absent parts as null).

    Injective in its parts (no string joining: ``("x;salt=y", None)`` and ``("x", "y")`` differ) and it never
    shows the salt. ``lora``: the adapter's identity (``identity.lora_identity``: name, path and a digest of its
    files), so a re-trained adapter under an old name gets a new namespace. This is the one place a namespace is
    built: any further isolating part (a tenant) joins the array here.
    """
    if not lora and not cache_salt:
        return ""
    return hashlib.sha256(cbor2.dumps([lora or None, cache_salt or None], canonical=True)).hexdigest()[:32]


SEGMENT_TAG = "segment:"
SEGMENT_SEED_SUFFIX = "/kvtier-segment-v1"


def segment_namespace(namespace: str = "", context=None) -> str:
    """The namespace a segment's chunks are stored under (``kvtier.blend``): ``"segment:" + namespace``, plus
    ``"/after:" + context digest`` when the segment's KV was computed after ``context`` tokens.

    This is the segment domain tag: ``namespace_of`` gives ``""`` or hex and ``tenant_namespace`` starts with
    ``tenant:``, so no prefix chunk's namespace starts with it, and ``KVCache`` also chains a segment's block
    hashes from another root (``hash_seed + SEGMENT_SEED_SUFFIX``): a segment key never equals a prefix key.

    ``context``: token ids (anything ``hashing.as_token_array`` takes) the document's KV was computed after (the
    prompt's prefix, at positions ``0 .. len(context) - 1``), or None / empty for a document computed alone from
    position 0. A document's KV depends on what it attended to, so that context is part of its key: the digest is
    SHA-256 (128 bits kept) over the tokens as little-endian int64, their count included. Raises InputError on
    bad context tokens.
    """
    if context is None or len(context) == 0:
        return SEGMENT_TAG + namespace
    arr = as_token_array(context).astype("<i8", copy=False)
    digest = hashlib.sha256(len(arr).to_bytes(8, "little") + arr.tobytes()).hexdigest()[:32]
    return f"{SEGMENT_TAG}{namespace}/after:{digest}"


def is_segment_namespace(namespace: str) -> bool:
    """Whether ``namespace`` (a tenant's included: ``tenant:<t>/segment:...``) is a segment namespace."""
    if namespace.startswith("tenant:"):
        namespace = namespace.partition("/")[2]
    return namespace.startswith(SEGMENT_TAG)


def parse_name(name: str) -> tuple[str, bytes]:
    """Split ``ChunkKey.name()`` into (scope, prefix_hash). Raises ValueError if malformed."""
    scope, _, digest = name.partition("-")
    if len(scope) != 16 or not digest:
        raise ValueError(f"not a chunk name: {name!r}")
    return scope, bytes.fromhex(digest)


def tenant_namespace(tenant: str, namespace: str) -> str:
    """The namespace a tenant-scoped client's ``namespace`` maps to: ``tenant:<tenant>/<namespace>``.

    Injective in (tenant, namespace) because tenant names contain no ``/`` (``kvtier.auth``), and never
    equal to a namespace of ``namespace_of``, which never starts with ``tenant:``. So a tenant naming
    another tenant's namespace reaches a namespace of its own, never the other's chunks.
    """
    return f"tenant:{tenant}/{namespace}"


def namespace_tenant(namespace: str) -> str | None:
    """The tenant of a namespace ``tenant_namespace`` made, or None for a namespace of no tenant."""
    if not namespace.startswith("tenant:"):
        return None
    return namespace[len("tenant:"):].partition("/")[0]
