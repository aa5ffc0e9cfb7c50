"""DiskIndex: which records the local-disk adapter holds, where their files are, and capacity eviction.

On-disk layout (the file holds exactly the bytes put: an encoded ``record``)::

    <path>/<h0h1>/<h2h3>/.../<scope16hex>-<prefix hash hex>          a published record
    <path>/<h0h1>/.../.<name>.<host8hex>.<pid>.<seq>.tmp             a write in flight

``hNhN`` are successive 2-hex-character slices of the prefix-hash part of the name, ``shard_depth``
levels (0: every file directly under ``path``). Several processes may share one directory: a name
missing from this process's index is looked up on disk before it is called a miss (by the adapter).

The index is an LRU of name -> bytes (least recently used first) with the bytes used and the bytes of writes
in flight (reserved against the capacity). With a capacity, a write evicts least recently used records until
it fits; a record larger than the capacity is not stored. The index is rebuilt from the files by ``scan``
(at construction and by ``list_names``), oldest mtime first; stale temp files of crashed writers are
deleted; files whose names are not ``<16 hex>-<hex>`` are ignored, and records under another
``shard_depth`` are ignored with a warning.

Lock: ``lock`` guards the index and the byte counts. Every method but ``scan`` and ``path`` (which need none
held) expects the caller to hold it, so the adapter makes a check and its update one step (a put's
stat-then-reserve, a delete's forget-then-unlink). ``in`` may be asked without it (the adapter's ``contains``):
one dict lookup, atomic under the GIL. Eviction unlinks the files it drops with the lock held, as the adapter's
``delete`` does.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvtier.errors import InputError
from kvtier.l1.retention import Retention
from kvtier.l2 import fileio
from kvtier.l2.retention import victims
from kvtier.proc import pid_alive

# the adapter's logger: these warnings are the adapter's, under the name operators already filter on
log = logging.getLogger("kvtier.l2.local_disk")

_NAME_RE = re.compile(r"[0-9a-f]{16}-[0-9a-f]{8,128}")
_TEMP_RE = re.compile(r"\.([0-9a-f]{16}-[0-9a-f]{8,128})\.([0-9a-f]{8})\.(\d+)\.(\d+)\.tmp")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_STALE_TEMP_SECONDS = 3600.0  # a temp file this old is a crashed write even if its pid looks alive


class DiskIndex:
    """The records under ``root``, their sizes in LRU order, and eviction to ``capacity_bytes``.

    Args:
        root: the adapter's directory (absolute).
        depth: ``shard_depth``.
        capacity_bytes: the capacity, or None (unbounded).
        host: this host's 8-hex tag in temp names (``RecordFiles.host``): only this host's pids can be checked.
        unlink: deletes a record file; True if it was there (the adapter's, which reports its errors).
        private: tightens a file or folder other users can read, ``(path, st_mode, wanted mode)``.
        retention_max_share: share of the capacity hinted records may hold (``kvtier.l2.retention``); clock: its
            seconds (the simulator's is the trace's).

    Attributes:
        retention: the hints of the records (``kvtier.l1.retention.Retention``), guarded by ``lock``.
    """

    def __init__(self, root: str, depth: int, capacity_bytes: int | None, host: str,
                 unlink: Callable[[str], bool], private: Callable[[str, int, int], None],
                 retention_max_share: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.root = root
        self.depth = depth
        self.capacity_bytes = capacity_bytes
        self.host = host
        self._unlink = unlink
        self._private = private
        self.lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recently used first
        self.used_bytes = 0
        self.reserved_bytes = 0  # writes in flight, counted against the capacity
        self.retention = Retention(capacity_bytes or 0, retention_max_share, clock=clock)

    def path(self, name: str) -> str:
        """The file of record ``name``; InputError for a name that is not ``ChunkKey.name()`` form (guards against
        path traversal)."""
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise InputError(f"L2 name {name!r} is not of the form ChunkKey.name() ('<16 hex>-<hex>'); "
                             "only names from ChunkKey.name() may be stored")
        digest = name[17:]
        shards = [digest[2 * i:2 * i + 2] for i in range(self.depth)]
        return os.path.join(self.root, *shards, name)

    # ---- bookkeeping (call with lock held) ------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def names(self) -> list[str]:
        return list(self._sizes)

    def adopt(self, name: str, size: int) -> None:
        """Count a record found on disk (no change if already indexed)."""
        if name not in self._sizes:
            self._sizes[name] = size
            self.used_bytes += size

    def touch(self, name: str) -> None:
        """``name`` was used: it becomes the most recently used."""
        self._sizes.move_to_end(name)

    def forget(self, name: str) -> bool:
        """Drop ``name`` from the index (not its file); True if it was indexed."""
        size = self._sizes.pop(name, None)
        if size is None:
            return False
        self.used_bytes -= size
        self.retention.drop(name)
        return True

    def reserve(self, size: int) -> tuple[bool, list[str]]:
        """Make room for a write of ``size`` bytes, evicting as needed. Returns whether it fits (then ``size`` is
        reserved until ``written`` or ``release``) and the names evicted."""
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            return False, []
        evicted = self.evict_until(size)
        if self.capacity_bytes is not None and self.used_bytes + self.reserved_bytes + size > self.capacity_bytes:
            return False, evicted  # the rest is taken by writes in flight
        self.reserved_bytes += size
        return True, evicted

    def release(self, size: int) -> None:
        """A reserved write of ``size`` bytes failed."""
        self.reserved_bytes -= size

    def written(self, name: str, size: int) -> None:
        """A reserved write of ``size`` bytes published ``name``."""
        self.reserved_bytes -= size
        self.forget(name)  # a concurrent writer of the same name may have landed first
        self._sizes[name] = size
        self.used_bytes += size

    def evict_until(self, size: int) -> list[str]:
        """Delete records until ``size`` more bytes fit, least recently used first, hinted ones last
        (``kvtier.l2.retention``); returns their names."""
        cap = self.capacity_bytes
        over = 0 if cap is None else self.used_bytes + self.reserved_bytes + size - cap
        evicted = victims(self._sizes.items(), over, self.retention) if over > 0 else []
        for name in evicted:
            self.forget(name)
            self._unlink(self.path(name))
        return evicted

    # ---- startup and rescan (takes lock) ------------------------------------------------------------
    def scan(self) -> None:
        """Rebuild the index from the files (adopting those other processes wrote); delete stale temp files."""
        found: dict[str, tuple[int, float]] = {}
        misplaced = 0
        now = time.time()
        for directory, depth, entry in self._walk(self.root, 0):
            fname = entry.name
            if _NAME_RE.fullmatch(fname):
                if depth == self.depth and directory == os.path.dirname(self.path(fname)):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    self._private(entry.path, st.st_mode, fileio.FILE_MODE)
                    found[fname] = (st.st_size, st.st_mtime)
                else:
                    misplaced += 1
            elif (m := _TEMP_RE.fullmatch(fname)) and self._is_stale_temp(m, entry, now):
                fileio.remove(entry.path)
        if misplaced:
            log.warning("local_disk %s: ignoring %d records stored under another shard_depth than %d; "
                        "move or delete them", self.root, misplaced, self.depth)
        with self.lock:
            for name in [n for n in self._sizes if n not in found]:
                self.forget(name)
            for name, (size, _) in sorted(found.items(), key=lambda kv: kv[1][1]):  # oldest mtime = LRU
                if name in self._sizes and self._sizes[name] != size:
                    self.forget(name)
                self.adopt(name, size)

    def _walk(self, directory: str, depth: int):
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if depth < 4 and _SHARD_RE.fullmatch(entry.name):
                    self._private(entry.path, entry.stat(follow_symlinks=False).st_mode, fileio.DIR_MODE)
                    yield from self._walk(entry.path, depth + 1)
            elif entry.is_file(follow_symlinks=False):
                yield directory, depth, entry

    def _is_stale_temp(self, m: re.Match, entry: os.DirEntry, now: float) -> bool:
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return False
        if age > _STALE_TEMP_SECONDS:
            return True
        return m.group(2) == self.host and not pid_alive(int(m.group(3)))
