"""ChunkKey: the one key type of kvtier (model, KV layout, namespace, prefix hash)."""

from __future__ import annotations

from dataclasses import dataclass

import xxhash


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Identity of one stored chunk.

    Attributes:
        model: model id (e.g. ``"HuggingFaceTB/SmolLM2-135M-Instruct"``).
        layout_id: ``KVLayout.layout_id`` (dtype, layers, KV heads, head dim, TP split).
        namespace: isolates KV that must not be shared: LoRA adapter name and/or ``cache_salt``;
            ``""`` for the base model.
        prefix_hash: digest of the token prefix up to and including this chunk (``hashing.prefix_hashes``).
    """

    model: str
    layout_id: str
    namespace: str
    prefix_hash: bytes

    @property
    def scope(self) -> str:
        """16 hex chars for (model, layout_id, namespace): every chunk of one cache shares it."""
        return scope_of(self.model, self.layout_id, self.namespace)

    def name(self) -> str:
        """Filename- and object-name-safe form ``<scope>-<prefix hash hex>`` (hex only)."""
        return f"{self.scope}-{self.prefix_hash.hex()}"


def scope_of(model: str, layout_id: str, namespace: str = "") -> str:
    """Hex scope of (model, layout_id, namespace); fields are length-prefixed so none can collide."""
    parts = [model.encode(), layout_id.encode(), namespace.encode()]
    return xxhash.xxh3_64_hexdigest(b"".join(len(p).to_bytes(4, "big") + p for p in parts))


def namespace_of(lora_name: str | None = None, cache_salt: str | None = None) -> str:
    """Namespace string for a LoRA adapter and/or a cache salt ("" when neither is set)."""
    parts = []
    if lora_name:
        parts.append(f"lora={lora_name}")
    if cache_salt:
        parts.append(f"salt={cache_salt}")
    return ";".join(parts)


def parse_name(name: str) -> tuple[str, bytes]:
    """Split ``ChunkKey.name()`` into (scope, prefix_hash). Raises ValueError if malformed."""
    scope, _, digest = name.partition("-")
    if len(scope) != 16 or not digest:
        raise ValueError(f"not a chunk name: {name!r}")
    return scope, bytes.fromhex(digest)
