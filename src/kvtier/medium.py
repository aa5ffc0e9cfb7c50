"""``Medium``: the tier a chunk is in, as KV cache events and metrics name it (vLLM's ``medium`` strings)."""

from __future__ import annotations

import enum

from kvtier.errors import InputError


class Medium(enum.StrEnum):
    """``GPU``: the engine's own KV cache; ``CPU``: kvtier's L1; ``STORAGE``: kvtier's L2 (any adapter). A ``str``:
    each member equals (and encodes as) its wire value."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"

    @classmethod
    def of_kvtier(cls, value: str | None) -> Medium | None:
        """A medium kvtier holds chunks in (``CPU``, ``STORAGE``) or None (every tier). Raises InputError naming
        the valid values otherwise."""
        if value is None:
            return None
        if value not in (cls.CPU, cls.STORAGE):
            raise InputError(f"medium must be None, 'CPU' (L1) or 'STORAGE' (L2), got {value!r}")
        return cls(value)
