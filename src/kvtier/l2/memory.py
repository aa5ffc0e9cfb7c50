"""In-process memory L2 adapter: the reference implementation of the adapter contract.

Useful as a fast L2 in tests and as the inner adapter of ``faulty``. Adapters built with the same
``shared`` id in one process use one store (while any of them exists), which stands in for a
server that outlives a restart of the cache or is shared by two caches in one process.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

from pydantic import Field

from kvtier.units import SizeGB
from kvtier.l1.retention import Retention
from kvtier.l2.base import AdapterConfig, Buffer, L2Adapter, Usage
from kvtier.l2.retention import victims
from kvtier.units import GB


class MemoryConfig(AdapterConfig):
    """``{"type": "memory", "size_gb": "1GB", "shared": "test-1"}``; no ``size_gb``: unbounded."""

    size_gb: SizeGB | None = Field(None, gt=0)
    shared: str | None = None  # adapters with the same id in one process share one store
    retention_max_share: float = Field(0.5, ge=0.0, le=1.0)  # of size_gb, for records under a retention hint

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.size_gb is None else round(self.size_gb * GB)


class _Store:
    """Records (immutable bytes) in least-recently-used order, under one lock."""

    def __init__(self, capacity_bytes: int | None, retention_max_share: float):
        self.capacity_bytes = capacity_bytes
        self.lock = threading.Lock()
        self.records: OrderedDict[str, bytes] = OrderedDict()
        self.used_bytes = 0
        self.retention = Retention(capacity_bytes or 0, retention_max_share)  # kvtier.l2.retention

    def pop(self, name: str) -> bytes | None:
        data = self.records.pop(name, None)
        if data is not None:
            self.used_bytes -= len(data)
            self.retention.drop(name)
        return data


_SHARED: weakref.WeakValueDictionary[str, _Store] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


class MemoryAdapter(L2Adapter):
    """Records held as ``bytes`` in a dict; same semantics as ``LocalDiskAdapter``.

    * ``put`` copies the parts into one ``bytes`` object; a name already stored is not rewritten
      (reports True, usage unchanged). With ``size_gb`` set, the least recently used records (by
      put/get) are evicted until the new one fits and reported through ``on_evict``; a record larger
      than the capacity is not stored (False).
    * ``get`` returns the stored ``bytes`` object itself (immutable, so sharing it is safe).
    * Names are not interpreted (no file system), so any string is accepted.
    """

    config_class = MemoryConfig

    def __init__(self, config: MemoryConfig):
        super().__init__(config)
        if config.shared is None:
            self._store = _Store(config.capacity_bytes, config.retention_max_share)
        else:
            with _SHARED_LOCK:
                store = _SHARED.get(config.shared)
                if store is None:
                    store = _SHARED[config.shared] = _Store(config.capacity_bytes, config.retention_max_share)
                store.capacity_bytes = config.capacity_bytes  # the latest configuration wins
                self._store = store
        self.capacity_bytes = config.capacity_bytes

    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        s = self._store
        out, evicted = [], []
        for name, parts in items:
            if name in s.records:  # unlocked peek: skips the copy for re-puts
                with s.lock:
                    if name in s.records:
                        s.records.move_to_end(name)
                        out.append(True)
                        continue
            data = b"".join(memoryview(p).cast("B") for p in parts)
            with s.lock:
                if name in s.records:
                    s.records.move_to_end(name)
                    out.append(True)
                    continue
                cap = s.capacity_bytes
                if cap is not None and len(data) > cap:
                    out.append(False)
                    continue
                over = 0 if cap is None else s.used_bytes + len(data) - cap
                for victim in victims(((n, len(b)) for n, b in s.records.items()), over, s.retention) if over > 0 else ():
                    s.pop(victim)
                    evicted.append(victim)
                s.records[name] = data
                s.used_bytes += len(data)
                out.append(True)
        self._evicted(evicted)
        return out

    def get(self, names: Sequence[str]) -> list[Buffer | None]:
        s = self._store
        out = []
        with s.lock:
            for name in names:
                data = s.records.get(name)
                if data is not None:
                    s.records.move_to_end(name)
                out.append(data)
        return out

    def contains(self, names: Sequence[str]) -> list[bool]:
        records = self._store.records
        return [name in records for name in names]

    def indexed(self, names: Sequence[str]) -> list[bool]:
        return self.contains(names)  # the records are the index: no I/O

    def delete(self, names: Sequence[str]) -> int:
        s = self._store
        count = 0
        with s.lock:
            for name in names:
                count += s.pop(name) is not None
        return count

    def retain(self, items: Sequence[tuple[str, int]], hint) -> int:
        s = self._store
        if s.capacity_bytes is None:
            return 0
        with s.lock:
            return sum(s.retention.set(name, hint, size) for name, size in items if name in s.records)

    def list_names(self) -> list[str]:
        with self._store.lock:
            return list(self._store.records)

    def usage(self) -> Usage:
        s = self._store
        with s.lock:
            return Usage(s.used_bytes, len(s.records), s.capacity_bytes)
