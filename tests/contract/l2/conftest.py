"""Adapters the contract suite runs against.

``ADAPTER_FACTORIES`` maps a test id to an ``AdapterFactory``. Calling one as
``factory(tmp_path, capacity_bytes=None, **fixtures)`` returns a new adapter over the storage
that belongs to ``tmp_path``: a second call reaches the same records (that is how the suite
tests recovery after a restart). Factories that need servers live in
``tests/contract/l2/remote_factories.py``; when that file exists its ``FACTORIES`` dict is merged in.
A factory names the pytest fixtures it needs (``fixtures``); they are passed as keyword arguments.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.l2.base import L2Adapter
from kvtier.l2.local_disk import LocalDiskAdapter, LocalDiskConfig
from kvtier.l2.memory import MemoryAdapter, MemoryConfig


@dataclass(frozen=True)
class AdapterFactory:
    """``make(tmp_path, capacity_bytes=None, **fixtures) -> L2Adapter``.

    ``has_capacity``: the adapter accepts ``capacity_bytes`` and evicts by itself.
    ``fixtures``: names of pytest fixtures (e.g. a running server) passed to ``make`` as keywords.
    """

    make: Callable[..., L2Adapter]
    has_capacity: bool = False
    fixtures: tuple[str, ...] = ()

    def __call__(self, tmp_path: Path, **kw) -> L2Adapter:
        return self.make(tmp_path, **kw)


def _gb(capacity_bytes: int | None) -> float | None:
    return None if capacity_bytes is None else capacity_bytes / 10**9


def _local_disk(direct_io: bool) -> Callable[..., L2Adapter]:
    def make(tmp_path: Path, capacity_bytes: int | None = None) -> L2Adapter:
        return LocalDiskAdapter(LocalDiskConfig(type="local_disk", path=str(tmp_path / "l2"),
                                                size_gb=_gb(capacity_bytes), direct_io=direct_io))
    return make


def _memory(tmp_path: Path, capacity_bytes: int | None = None) -> L2Adapter:
    # ``shared`` keyed by the test's directory: a second adapter sees the first one's records
    return MemoryAdapter(MemoryConfig(type="memory", size_gb=_gb(capacity_bytes), shared=str(tmp_path)))


ADAPTER_FACTORIES: dict[str, AdapterFactory] = {
    "local_disk": AdapterFactory(_local_disk(False), has_capacity=True),
    "local_disk_direct_io": AdapterFactory(_local_disk(True), has_capacity=True),
    "memory": AdapterFactory(_memory, has_capacity=True),
}

_REMOTE = Path(__file__).with_name("remote_factories.py")
if _REMOTE.exists():
    _spec = importlib.util.spec_from_file_location("kvtier_contract_remote_factories", _REMOTE)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _module  # dataclasses and pickling look modules up here
    _spec.loader.exec_module(_module)
    ADAPTER_FACTORIES.update(_module.FACTORIES)


class Maker:
    """What the ``adapter_factory`` fixture yields: ``make(capacity_bytes=None) -> L2Adapter``.

    Every adapter made is closed at teardown. ``name`` is the factory's id, ``has_capacity`` its flag.
    """

    def __init__(self, name: str, factory: AdapterFactory, tmp_path: Path, fixture_values: dict):
        self.name = name
        self.factory = factory
        self.has_capacity = factory.has_capacity
        self._tmp_path = tmp_path
        self._fixture_values = fixture_values
        self.made: list[L2Adapter] = []

    def __call__(self, capacity_bytes: int | None = None) -> L2Adapter:
        kw = dict(self._fixture_values)
        if capacity_bytes is not None:
            kw["capacity_bytes"] = capacity_bytes
        adapter = self.factory(self._tmp_path, **kw)
        self.made.append(adapter)
        return adapter


def _maker(request, tmp_path):
    """A Maker for the adapter named by ``request.param``; closes what it made afterwards."""
    factory = ADAPTER_FACTORIES[request.param]
    values = {name: request.getfixturevalue(name) for name in factory.fixtures}
    maker = Maker(request.param, factory, tmp_path, values)
    yield maker
    for adapter in maker.made:
        adapter.close()


@pytest.fixture(params=list(ADAPTER_FACTORIES))
def adapter_factory(request, tmp_path) -> Maker:
    yield from _maker(request, tmp_path)


@pytest.fixture(params=[n for n, f in ADAPTER_FACTORIES.items() if f.has_capacity])
def capacity_adapter_factory(request, tmp_path) -> Maker:
    """Like ``adapter_factory``, over the adapters that have a capacity."""
    yield from _maker(request, tmp_path)
