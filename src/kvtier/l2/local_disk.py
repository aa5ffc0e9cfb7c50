"""Local-disk L2 adapter: one file per record in a directory tree, published by atomic rename.

The LMCache / NIXL backend names map onto it (see ``l2.base.ALIASES``): ``POSIX``; ``HF3FS`` (point
``path`` at the mounted 3FS directory); ``GDS`` and ``GDS_MT`` (``direct_io``, and 8 threads for
``GDS_MT``). There is no GPU-direct storage on a CPU host: O_DIRECT through page-aligned host buffers
is the path to use where none exists.

On-disk layout (the file holds exactly the bytes put: an encoded ``record``)::

    <path>/<h0h1>/<h2h3>/.../<scope16hex>-<prefix hash hex>          a published record
    <path>/<h0h1>/.../.<name>.<host8hex>.<pid>.<seq>.tmp             a write in flight

``hNhN`` are successive 2-hex-character slices of the prefix-hash part of the name, ``shard_depth``
levels (0: every file directly under ``path``). Several processes may share one directory: a name
missing from this process's index is looked up on disk before it is called a miss. Files are created
0600 and folders 0700 (records hold token ids and KV); files and folders of earlier versions that other
users could read are tightened at startup, or a warning names them when that is not possible.

A full disk (ENOSPC, EDQUOT) keeps the head of a ``put``: its records are chunks of one prompt in prefix order and a
lookup stops at the first missing one, so when parallel writes let a later record take the space an earlier one
needed, the later ones this put stored are deleted and the rest written again in order until one does not fit.

This module holds the contract (``LocalDiskAdapter``) and its error policy: which errors fail one item and which
the whole directory. Writing and reading a record file (temp file, fsync, rename, O_DIRECT and its fallback) is
``l2.disk_files.RecordFiles``; the index of names and sizes, the layout, capacity eviction and the startup scan
are ``l2.disk_index.DiskIndex``. The adapter holds ``DiskIndex.lock`` around each check and its update; file
I/O runs outside it, except the unlinks of ``delete`` and of eviction.

Threads: a batch is read by ``num_threads`` ``kvtier-disk`` threads and written by as many ``kvtier-disk-put``
threads, which run at a lower OS priority and start each write when a server's request thread is idle
(``kvtier.foreground``): a write's two fsyncs cost about 0.75 ms of kernel CPU, which a lookup should not wait for.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash
from pydantic import Field

from kvtier.units import Bool, SizeGB
from kvtier.errors import ConfigError, StorageError
from kvtier.foreground import FOREGROUND, background_thread
from kvtier.l2 import fileio
from kvtier.l2.base import AdapterConfig, Buffer, L2Adapter, Usage
from kvtier.l2.disk_files import RecordFiles
from kvtier.l2.disk_index import DiskIndex
from kvtier.units import GB

log = logging.getLogger(__name__)

_ADAPTER_WIDE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


class LocalDiskConfig(AdapterConfig):
    """``{"type": "local_disk", "path": "/data/kv", "size_gb": "50GB", ...}``.

    ``size_gb`` is the capacity (``parse_size``: ``"50GB"``, ``"512MiB"``, or a number of GB);
    None means unbounded. ``shard_depth`` 0..4 levels of 2-hex-character directories.
    """

    path: str
    size_gb: SizeGB | None = Field(None, gt=0)
    direct_io: Bool = False
    num_threads: int = Field(4, ge=1, le=256)  # parallel file I/O for batch put/get
    shard_depth: int = Field(1, ge=0, le=4)
    fsync: Bool = True
    retention_max_share: float = Field(0.5, ge=0.0, le=1.0)  # of size_gb, for records under a retention hint

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.size_gb is None else round(self.size_gb * GB)


class LocalDiskAdapter(L2Adapter):
    """Records as files under ``config.path``; thread-safe; an LRU index of name -> bytes.

    * ``put`` writes a temp file in the target directory, fsyncs it, ``os.replace``s it onto the name
      and fsyncs the directory: a record is visible only when complete. A name already on disk is
      not rewritten (records are addressed by their key) and reports True; usage is unchanged.
      Per-item I/O errors (ENOSPC, EIO, ...) make that item False and are logged once per errno;
      StorageError is raised only when the whole directory is unusable (gone, read-only, EACCES).
    * ``get`` returns the whole file (``bytes``; with ``direct_io`` a ``memoryview`` over a
      page-aligned buffer). A file deleted by hand reads as None and leaves the index.
    * With ``size_gb`` set, a put evicts least recently used records (by put/get) until it fits and
      reports them through ``on_evict``; a record larger than the capacity is not stored (False).
    * The index is rebuilt from the files at construction and by ``list_names``; stale temp files of
      crashed writers are deleted; files whose names are not ``<16 hex>-<hex>`` are ignored.

    Raises:
        ConfigError (construction): ``path`` cannot be created or written.
        InputError: a name that is not ``ChunkKey.name()`` form (guards against path traversal).
        StorageError: the directory became unusable, or the adapter is closed.
    """

    config_class = LocalDiskConfig

    def __init__(self, config: LocalDiskConfig):
        super().__init__(config)
        self.root = os.path.abspath(os.path.expanduser(config.path))
        self.capacity_bytes = config.capacity_bytes
        self._host = xxhash.xxh32_hexdigest(socket.gethostname().encode())
        self._files = RecordFiles(self.root, self._host, config.fsync, config.direct_io)
        self._index = DiskIndex(self.root, config.shard_depth, self.capacity_bytes, self._host,
                                unlink=self._unlink, private=self._private,
                                retention_max_share=config.retention_max_share)
        self._logged_errnos: set[int] = set()
        self._warned_open = False
        self._closed = False
        self._pool = ThreadPoolExecutor(config.num_threads, thread_name_prefix="kvtier-disk") \
            if config.num_threads > 1 else None
        # writes on threads of their own at a lower OS priority: their fsyncs are kernel CPU time that a lookup
        # (on the request thread) should not wait behind; reads (a retrieve waits for them) keep theirs
        self._put_pool = ThreadPoolExecutor(config.num_threads, thread_name_prefix="kvtier-disk-put",
                                            initializer=background_thread) if config.num_threads > 1 else None
        self._check_writable()
        if config.shard_depth:  # first level up front: a lazily created shard costs two more journal commits per put
            try:
                self._files.make_dirs(*(os.path.join(self.root, f"{i:02x}") for i in range(256)))
            except OSError as exc:  # a full disk: the writes that need them are dropped (and counted) later
                log.warning("local_disk %s: cannot make its shard folders (%s)", self.root, exc.strerror or exc)
        self._index.scan()
        with self._index.lock:
            shrunk = self._index.evict_until(0)
        if shrunk:
            log.info("local_disk %s: evicted %d records to fit size_gb=%s", self.root, len(shrunk), config.size_gb)

    # ---- contract -------------------------------------------------------------------------------
    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        args = [(self._path(name), name, parts) for name, parts in items]
        flags = self._map(self._put_one, args, self._put_pool)  # None: the disk was full
        if None in flags:  # keep the head (module docstring)
            first = flags.index(None)
            self.delete([args[i][1] for i in range(first + 1, len(args)) if flags[i]])
            del flags[first:]
            for a in args[first:]:
                flags.append(self._put_one(*a) is True)
                if not flags[-1]:
                    break
            flags += [False] * (len(args) - len(flags))
        return flags

    def retain(self, items: Sequence[tuple[str, int]], hint) -> int:
        if self.capacity_bytes is None:
            return 0
        with self._index.lock:
            return sum(self._index.retention.set(name, hint, size) for name, size in items if name in self._index)

    def get(self, names: Sequence[str]) -> list[Buffer | None]:
        return self._map(self._get_one, [(self._path(name), name) for name in names], self._pool)

    def contains(self, names: Sequence[str]) -> list[bool]:
        out = []
        for name in names:
            path = self._path(name)
            if name in self._index:
                out.append(True)
                continue
            try:  # another process sharing the directory may have stored it
                size = os.stat(path).st_size
            except OSError:
                out.append(False)
                continue
            with self._index.lock:
                self._index.adopt(name, size)
            out.append(True)
        return out

    def indexed(self, names: Sequence[str]) -> list[bool]:
        with self._index.lock:
            return [name in self._index for name in names]

    def delete(self, names: Sequence[str]) -> int:
        paths = [(self._path(name), name) for name in names]
        count = 0
        with self._index.lock:  # under the lock so a concurrent put of the same name is not unlinked
            for path, name in paths:
                known = self._index.forget(name)
                count += self._unlink(path) or known
        return count

    def list_names(self) -> list[str]:
        """Rescan the directory (adopting files written by other processes) and return every name."""
        self._index.scan()
        with self._index.lock:
            return self._index.names()

    def usage(self) -> Usage:
        with self._index.lock:
            return Usage(self._index.used_bytes, len(self._index), self.capacity_bytes)

    def health(self) -> tuple[bool, str]:
        if not os.path.isdir(self.root):
            return False, f"directory {self.root} is missing"
        if not os.access(self.root, os.W_OK):
            return False, f"directory {self.root} is not writable"
        return True, "ok"

    def close(self) -> None:
        self._closed = True
        for pool in (self._pool, self._put_pool):
            if pool is not None:
                pool.shutdown(wait=True)

    # ---- put ------------------------------------------------------------------------------------
    def _put_one(self, path: str, name: str, parts: Sequence[Buffer]) -> bool:
        FOREGROUND.wait_idle()  # a write is never urgent: a server's request thread first
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        try:
            on_disk = os.stat(path).st_size
        except FileNotFoundError:
            on_disk = None
        except OSError as exc:
            return self._item_error("stat", path, exc, False)
        with self._index.lock:
            if on_disk is not None:
                self._index.adopt(name, on_disk)
                self._index.touch(name)
                return True
            self._index.forget(name)  # deleted by hand since it was indexed
            fits, evicted = self._index.reserve(size)
        self._evicted(evicted)
        if not fits:
            return False
        try:
            self._files.write(path, name, views, size)
        except OSError as exc:
            with self._index.lock:
                self._index.release(size)
            return self._item_error("write", path, exc, None if exc.errno in _FULL_ERRNOS else False)
        with self._index.lock:
            self._index.written(name, size)
        return True

    # ---- get ------------------------------------------------------------------------------------
    def _get_one(self, path: str, name: str) -> Buffer | None:
        try:
            buf = self._files.read(path)
        except FileNotFoundError:
            with self._index.lock:
                self._index.forget(name)
            return None
        except OSError as exc:
            return self._item_error("read", path, exc, None)
        with self._index.lock:
            self._index.adopt(name, memoryview(buf).nbytes)
            self._index.touch(name)
        return buf

    def _unlink(self, path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            return self._item_error("delete", path, exc, False)

    # ---- helpers ------------------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return self._index.path(name)

    @property
    def _direct(self) -> bool:
        """Whether O_DIRECT is in use now (off after the file system refused it)."""
        return self._files.direct

    def _map(self, fn, args: list[tuple], pool: ThreadPoolExecutor | None) -> list:
        if self._closed:
            raise StorageError(f"local_disk adapter on {self.root} is closed")
        if pool is None or len(args) < 2:
            return [fn(*a) for a in args]
        futures = [pool.submit(fn, *a) for a in args]
        results, failure = [], None
        for fut in futures:  # wait for every item before raising, so no write is left half-accounted
            try:
                results.append(fut.result())
            except Exception as exc:  # noqa: BLE001 - re-raised below
                failure = failure or exc
        if failure is not None:
            raise failure
        return results

    def _item_error(self, op: str, path: str, exc: OSError, result):
        if exc.errno in _ADAPTER_WIDE_ERRNOS or not os.path.isdir(self.root):
            raise StorageError(f"local_disk {op} failed for the whole directory {self.root}: "
                               f"{exc.strerror or exc}; check that it exists, is mounted and is writable") from exc
        if exc.errno not in self._logged_errnos:  # once per errno: a full disk must not flood the log
            self._logged_errnos.add(exc.errno)
            log.warning("local_disk %s failed on %s: %s (further errors of this kind are not logged)",
                        op, path, exc.strerror or exc)
        return result

    def _private(self, path: str, mode: int, want: int) -> None:
        """Tighten a file or folder other users can read (made by an earlier kvtier), or warn once."""
        done = fileio.tighten(path, mode, want)
        if done is False and not self._warned_open:
            self._warned_open = True
            log.warning("local_disk %s: %s is readable by other users (mode %04o) and cannot be changed by this "
                        "user; records hold token ids and KV: chmod it to %04o", self.root, path, mode & 0o777, want)

    def _check_writable(self) -> None:
        # also probes O_DIRECT when asked for, so a refusing file system is reported at startup
        probe = os.path.join(self.root, f".probe-{os.getpid()}-{threading.get_ident()}")
        try:
            os.makedirs(self.root, fileio.DIR_MODE, exist_ok=True)
            self._private(self.root, os.stat(self.root).st_mode, fileio.DIR_MODE)
            self._files.probe(probe)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS and os.path.isdir(self.root):  # its records can still be read
                log.warning("local_disk %s is full (%s): its records are served, new ones are dropped until space "
                            "is freed (set size_gb below the free space to let kvtier evict)", self.root, exc.strerror)
                return
            raise ConfigError(f"local_disk path {self.root!r} is not usable ({exc.strerror or exc}); "
                              "give 'path' a directory kvtier can create and write, or fix its "
                              "permissions or mount") from exc
        finally:
            fileio.remove(probe)
