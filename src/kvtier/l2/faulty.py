"""Fault-injecting wrapper around any L2 adapter: errors, latency, torn writes, corruption.

``{"type": "faulty", "inner": {"type": "local_disk", "path": "/tmp/kv"}, "seed": 7,
"error_rate": 0.1, "torn_write_rate": 0.05}``. Every decision comes from ``random.Random(seed)``
drawn in call order, so a single-threaded run is reproducible. The wrapped adapter does the real
storing; this is the only "fake" in kvtier and it exists to test the cache's fault handling.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from kvtier.errors import StorageError
from kvtier.l2.base import AdapterConfig, Buffer, L2Adapter, Usage, create_adapter

Op = Literal["put", "get", "contains", "delete", "list_names", "clear"]
ALL_OPS: tuple[str, ...] = ("put", "get", "contains", "delete", "list_names", "clear")


class FaultyConfig(AdapterConfig):
    """Rates are probabilities in [0, 1] per call (``error_rate``) or per stored record (torn, corrupt)."""

    renamed_fields = {"latency_ms": "latency_seconds"}

    inner: dict  # the wrapped adapter's spec, built with create_adapter
    seed: int = 0
    error_rate: float = Field(0.0, ge=0, le=1)  # raise StorageError instead of doing the operation
    latency_seconds: float = Field(0.0, ge=0)  # sleep before each affected operation
    torn_write_rate: float = Field(0.0, ge=0, le=1)  # store only a prefix of the record
    corrupt_rate: float = Field(0.0, ge=0, le=1)  # flip one byte of the stored record
    ops: list[Op] = Field(default_factory=lambda: list(ALL_OPS))  # operations faults apply to


class FaultyAdapter(L2Adapter):
    """Wraps ``inner`` (built from ``config.inner``, or given) and injects faults before delegating.

    ``injected`` counts what was injected: ``"error:<op>"``, ``"torn"``, ``"corrupt"``. Torn and
    corrupt records are written through the inner adapter's own ``put`` (the damage is in the stored
    bytes, found by ``record.decode_record``). Eviction callbacks of the inner adapter are forwarded.
    Attributes not defined here (``capacity_bytes``, ``root``, ...) are read from the inner adapter.

    Raises:
        StorageError: an injected error (message names the operation and the seed).
    """

    config_class = FaultyConfig

    def __init__(self, config: FaultyConfig, inner: L2Adapter | None = None):
        super().__init__(config)
        self.inner = inner if inner is not None else create_adapter(config.inner)
        self.inner.on_evict = self._evicted
        self.inner.on_errors = self._errors
        self._rng = random.Random(config.seed)
        self._rng_lock = threading.Lock()
        self._ops = frozenset(config.ops)
        self.injected: Counter[str] = Counter()

    @classmethod
    def wrap(cls, inner: L2Adapter, **fields) -> FaultyAdapter:
        """Wrap an adapter that already exists, e.g. ``FaultyAdapter.wrap(adapter, seed=1, error_rate=0.5)``."""
        config = FaultyConfig(type="faulty", inner=inner.config.model_dump(mode="json"), **fields)
        return cls(config, inner=inner)

    def __getattr__(self, attr: str):
        if attr == "inner":  # not set yet: avoid recursing
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def _before(self, op: str) -> None:
        if op not in self._ops:
            return
        if self.config.latency_seconds:
            time.sleep(self.config.latency_seconds)
        with self._rng_lock:
            fail = self._rng.random() < self.config.error_rate
            if fail:
                self.injected[f"error:{op}"] += 1
        if fail:
            raise StorageError(f"injected {op} failure (faulty adapter, seed {self.config.seed})")

    def _damage(self, parts: Sequence[Buffer]) -> Sequence[Buffer]:
        cfg = self.config
        with self._rng_lock:
            torn = self._rng.random() < cfg.torn_write_rate
            corrupt = self._rng.random() < cfg.corrupt_rate
            if not (torn or corrupt):
                return parts
            data = bytearray(b"".join(memoryview(p).cast("B") for p in parts))
            if torn and data:
                del data[self._rng.randrange(len(data)):]
                self.injected["torn"] += 1
            if corrupt and data:
                data[self._rng.randrange(len(data))] ^= 0xFF
                self.injected["corrupt"] += 1
        return [bytes(data)]

    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        self._before("put")
        if "put" in self._ops and (self.config.torn_write_rate or self.config.corrupt_rate):
            items = [(name, self._damage(parts)) for name, parts in items]
        return self.inner.put(items)

    def get(self, names: Sequence[str]) -> list[Buffer | None]:
        self._before("get")
        return self.inner.get(names)

    def contains(self, names: Sequence[str]) -> list[bool]:
        self._before("contains")
        return self.inner.contains(names)

    @property
    def index_may_lag(self) -> bool:
        return self.inner.index_may_lag

    def indexed(self, names: Sequence[str]) -> list[bool] | None:
        return self.inner.indexed(names)  # in memory: no I/O to delay or fail

    def delete(self, names: Sequence[str]) -> int:
        self._before("delete")
        return self.inner.delete(names)

    def retain(self, items: Sequence[tuple[str, int]], hint) -> int:
        return self.inner.retain(items, hint)  # in memory: no I/O to delay or fail

    def list_names(self) -> list[str]:
        self._before("list_names")
        return self.inner.list_names()

    def clear(self) -> list[str]:
        self._before("clear")
        return self.inner.clear()

    def usage(self) -> Usage:
        return self.inner.usage()

    def health(self) -> tuple[bool, str]:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()
