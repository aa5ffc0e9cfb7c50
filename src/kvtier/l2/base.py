"""The L2 adapter contract, and the registry that builds adapters from ``--l2-adapter`` JSON.

An adapter stores whole encoded records (``record.encode_record``) under names from
``ChunkKey.name()`` (hex and ``-`` only). It does not interpret records: verification, prefix
semantics, error-to-miss conversion, metrics and events live in ``l2.tier.L2Tier``.
"""

from __future__ import annotations

import difflib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pydantic

from kvtier.units import StrictModel
from kvtier.errors import ConfigError

Buffer = bytes | bytearray | memoryview


class AdapterConfig(StrictModel):
    """Fields every adapter accepts. Subclasses add their own; unknown keys and former names are refused."""

    type: str
    name: str | None = None  # label in metrics and /status; defaults to the type
    codec: str = "none"  # kvtier.codecs spec records are written with (e.g. lz4, zstd, fp8_e4m3+zstd)


@dataclass(frozen=True, slots=True)
class Usage:
    """Bytes and records held by an adapter. ``capacity_bytes`` is None when unbounded."""

    used_bytes: int
    num_records: int
    capacity_bytes: int | None = None


class L2Adapter(ABC):
    """Contract every L2 adapter implements (see tests/contract/l2/).

    Rules:
      * ``put`` makes a record visible only once it is complete (temp name + fsync + rename, or one
        object PUT). Re-putting a stored name leaves usage unchanged.
      * ``get`` returns the exact bytes put, or None; never a torn or mixed record.
      * methods may raise; ``L2Tier`` turns any exception into a miss plus ``kvtier_l2_errors_total``.
      * adapters with a capacity evict by themselves and report evicted names through ``on_evict``.
      * an adapter that answers some names of a batch as misses because they could not be asked (a Redis
        Cluster node is down) reports it through ``on_errors`` (operation, how many names), and the tier
        counts them in ``kvtier_l2_errors_total``.
      * ``indexed`` never does I/O; every other method may.
    """

    config_class: type[AdapterConfig] = AdapterConfig
    # True where other writers (another kvtier server sharing the Redis, bucket or container) store records this
    # adapter's in-memory index learns of only through I/O: a server then probes it before answering a lookup
    # that its indexes answer short (server.lookup_probe_timeout_seconds). False: this process sees every write.
    index_may_lag: bool = False

    def __init__(self, config: AdapterConfig):
        self.config = config
        self.label = config.name or config.type
        self.on_evict: Callable[[list[str]], None] | None = None
        self.on_errors: Callable[[str, int], None] | None = None

    @abstractmethod
    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        """Store each (name, record parts); parts are concatenated in order. Returns stored flags."""

    @abstractmethod
    def get(self, names: Sequence[str]) -> list[Buffer | None]:
        """Whole records for ``names`` (None where missing), in order."""

    @abstractmethod
    def contains(self, names: Sequence[str]) -> list[bool]:
        """Which ``names`` are stored (from the index where the adapter keeps one)."""

    def indexed(self, names: Sequence[str]) -> list[bool] | None:
        """Which ``names`` the adapter's in-memory index holds, answered without I/O (no request to a service,
        no file-system call): what a lookup on the server's request thread may ask. None when the adapter keeps
        no index; ``L2Tier`` then keeps one for it (filled from ``list_names`` at start, updated on put,
        delete, eviction and reads). The index may lag: a record another writer stored is adopted by
        ``contains``, one deleted behind the adapter's back is forgotten when ``get`` misses it."""
        return None

    @abstractmethod
    def delete(self, names: Sequence[str]) -> int:
        """Remove ``names``; returns how many existed."""

    @abstractmethod
    def list_names(self) -> list[str]:
        """Every stored name (used to rebuild indexes on restart)."""

    @abstractmethod
    def usage(self) -> Usage:
        """Current usage."""

    def health(self) -> tuple[bool, str]:
        """(healthy, reason). Default: healthy."""
        return True, "ok"

    def clear(self) -> list[str]:
        """Delete everything; return the deleted names."""
        names = self.list_names()
        self.delete(names)
        return names

    def retain(self, items: Sequence[tuple[str, int]], hint) -> int:
        """Keep the records ``items`` ((name, bytes) just written) under ``hint`` (``kvtier.hints.RetentionHint``)
        in capacity eviction (``kvtier.l2.retention``); returns how many were accepted. Adapters that do not evict
        by themselves ignore it (0)."""
        return 0

    def close(self) -> None:
        """Release connections and threads."""

    def _evicted(self, names: list[str]) -> None:
        if names and self.on_evict is not None:
            self.on_evict(names)

    def _errors(self, op: str, num_names: int) -> None:
        if num_names and self.on_errors is not None:
            self.on_errors(op, num_names)


# type -> (module, class); aliases map LMCache's L2 names (and GDS variants) onto ours.
_REGISTRY = {
    "local_disk": ("kvtier.l2.local_disk", "LocalDiskAdapter"),
    "memory": ("kvtier.l2.memory", "MemoryAdapter"),
    "faulty": ("kvtier.l2.faulty", "FaultyAdapter"),
    "s3": ("kvtier.l2.s3", "S3Adapter"),
    "azure_blob": ("kvtier.l2.azure_blob", "AzureBlobAdapter"),
    "redis": ("kvtier.l2.redis", "RedisAdapter"),
}
ALIASES = {
    "posix": ("local_disk", {}),
    "hf3fs": ("local_disk", {}),
    "gds": ("local_disk", {"direct_io": True}),
    "gds_mt": ("local_disk", {"direct_io": True, "num_threads": 8}),
    "obj": ("s3", {}),
    "azure_blob": ("azure_blob", {}),
    "valkey": ("redis", {}),
}


def adapter_types() -> list[str]:
    """Every accepted ``type`` value (canonical names and aliases)."""
    return sorted(set(_REGISTRY) | {a.upper() for a in ALIASES})


def create_adapter(spec: dict) -> L2Adapter:
    """Build an adapter from its JSON/YAML spec, e.g. ``{"type": "local_disk", "path": "/data"}``.

    Raises:
        ConfigError: unknown type (with the nearest valid one), unknown or missing field, bad value,
            or the adapter's own startup check (e.g. a path that is not writable).
    """
    if not isinstance(spec, dict) or "type" not in spec:
        raise ConfigError(f"an L2 adapter spec must be a JSON object with a 'type'; got {spec!r}")
    raw_type = str(spec["type"])
    canonical, defaults = ALIASES.get(raw_type.lower(), (raw_type, {}))
    if canonical not in _REGISTRY:
        near = difflib.get_close_matches(raw_type, adapter_types(), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"unknown L2 adapter type {raw_type!r}{hint}. Valid types: {', '.join(sorted(_REGISTRY))} "
                          f"(LMCache names also accepted: {', '.join(sorted(a.upper() for a in ALIASES))})")
    module, cls_name = _REGISTRY[canonical]
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except ImportError as exc:
        raise ConfigError(f"L2 adapter {canonical!r} needs an extra package ({exc.name}); "
                          f"install it with: pip install 'kvtier[l2]'") from exc
    fields = {**defaults, **spec, "type": canonical}
    try:
        config = cls.config_class(**fields)
    except pydantic.ValidationError as exc:  # its text shows the spec's values (a password, a key): not chained
        raise ConfigError(f"L2 adapter {canonical!r}: {_describe(exc, cls.config_class)}") from None
    return cls(config)


def _describe(exc: pydantic.ValidationError, model: type[pydantic.BaseModel]) -> str:
    msgs = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            near = difflib.get_close_matches(field, list(model.model_fields), n=1)
            msgs.append(f"unknown field {field!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        elif err["type"] == "missing":
            msgs.append(f"missing required field {field!r}")
        elif not field:  # a check on the whole spec (a renamed key): its message names the keys
            msgs.append(str(err.get("ctx", {}).get("error") or err["msg"]))
        else:  # a validator's own message (its ValueError) without pydantic's "Value error, " prefix
            msgs.append(f"field {field!r}: {err.get('ctx', {}).get('error') or err['msg']}")
    return "; ".join(msgs)
