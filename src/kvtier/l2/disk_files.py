"""RecordFiles: how the local-disk adapter writes and reads one record file.

A record is written to a temp file in its target directory, fsynced, ``os.replace``d onto its name and the
directory fsynced: a record is visible only when complete. The temp name is
``.<name>.<host8hex>.<pid>.<seq>.tmp`` (``l2.disk_index`` recognises it at startup and deletes those of
crashed writers). With ``direct_io`` the file is written and read with O_DIRECT through page-aligned host
buffers; a file system that refuses O_DIRECT (EINVAL) turns it off for the adapter, with one warning, and
buffered I/O is used from then on. Files are created 0600 and folders 0700 (records hold token ids and KV).
Folders are made level by level, never with makedirs: a vanished root must fail, not be silently recreated.

No lock: each call's state is its own. The temp-name counter is an ``itertools.count`` (its ``next`` is atomic
under the GIL) and the O_DIRECT write buffer is per thread. ``direct`` only ever turns off; a write racing
that still reads it on, fails with EINVAL and falls back like the first one did.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading

from kvtier.l2 import fileio
from kvtier.l2.base import Buffer

# the adapter's logger: these warnings are the adapter's, under the name operators already filter on
log = logging.getLogger("kvtier.l2.local_disk")

_MAX_CACHED_BUFFER_BYTES = 64 << 20  # per-thread O_DIRECT write buffer kept for reuse up to this size


class RecordFiles:
    """Record files under ``root``.

    Args:
        root: the adapter's directory (absolute).
        host: this host's 8-hex tag in temp names, so a scan tells this host's crashed writers from other hosts'.
        fsync: fsync each file and the folders a write changed.
        direct: use O_DIRECT where the platform has it (``direct``: whether it is in use now).
    """

    def __init__(self, root: str, host: str, fsync: bool, direct: bool):
        self.root = root
        self.host = host
        self.fsync = fsync
        self.direct = direct and bool(fileio.O_DIRECT)
        self._seq = itertools.count()
        self._local = threading.local()

    def write(self, path: str, name: str, views: list[memoryview], size: int) -> None:
        """Publish ``views`` (``size`` bytes in all) as the record file ``path``; raises OSError."""
        directory = os.path.dirname(path)
        self.make_dirs(directory)
        tmp = os.path.join(directory, f".{name}.{self.host}.{os.getpid()}.{next(self._seq)}.tmp")
        try:
            self._with_direct_fallback(lambda: self._write_direct(tmp, views, size),
                                       lambda: self._write_buffered(tmp, views))
            os.replace(tmp, path)
        except BaseException:
            fileio.remove(tmp)
            raise
        if self.fsync:
            fileio.fsync_dir(directory)

    def read(self, path: str) -> Buffer:
        """The whole file; raises FileNotFoundError or another OSError."""
        return self._with_direct_fallback(lambda: fileio.read_direct(path), lambda: fileio.read_buffered(path))

    def probe(self, path: str) -> None:
        """Write a throwaway file at ``path`` as records are written (the caller removes it), so a file system
        that refuses O_DIRECT or writes is found at startup; raises OSError."""
        self._with_direct_fallback(lambda: self._write_direct(path, [memoryview(bytes(fileio.ALIGN))], fileio.ALIGN),
                                   lambda: self._write_buffered(path, [memoryview(b"kvtier")]))

    def make_dirs(self, *directories: str) -> None:
        """Make the folders from ``root`` down to each of ``directories`` that are missing; raises OSError."""
        # mkdir level by level (never makedirs): a vanished root must fail, not be silently recreated
        synced = set()
        for directory in directories:
            current = self.root
            for part in os.path.relpath(directory, self.root).split(os.sep) if directory != self.root else ():
                parent, current = current, os.path.join(current, part)
                try:
                    os.mkdir(current, fileio.DIR_MODE)
                except FileExistsError:
                    continue
                synced.add(parent)
        for parent in sorted(synced, key=len, reverse=True) if self.fsync else ():
            fileio.fsync_dir(parent)

    def _write_buffered(self, tmp: str, views: list[memoryview]) -> None:
        # O_TRUNC, not O_EXCL: a refused O_DIRECT attempt may have created this (unique) temp name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, fileio.FILE_MODE)
        try:
            fileio.write_all(fd, views)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _write_direct(self, tmp: str, views: list[memoryview], size: int) -> None:
        aligned = fileio.round_up(size)
        buf = self._aligned_buffer(aligned)
        offset = 0
        for v in views:  # O_DIRECT cannot take the caller's unaligned buffers: one copy
            buf[offset:offset + v.nbytes] = v
            offset += v.nbytes
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | fileio.O_DIRECT, fileio.FILE_MODE)
        try:
            if aligned:
                fileio.write_all(fd, [buf[:aligned]])
            if aligned != size:
                os.ftruncate(fd, size)  # drop the alignment padding
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _aligned_buffer(self, nbytes: int) -> memoryview:
        if nbytes > _MAX_CACHED_BUFFER_BYTES:
            return fileio.aligned(nbytes)
        cached = getattr(self._local, "buf", None)
        if cached is None or cached.nbytes < nbytes:
            cached = self._local.buf = fileio.aligned(max(nbytes, fileio.ALIGN))
        return cached

    def _with_direct_fallback(self, direct, buffered):
        if self.direct:
            try:
                return direct()
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this file system refuses O_DIRECT
                    raise
                self._disable_direct_io(exc)
        return buffered()

    def _disable_direct_io(self, exc: OSError) -> None:
        if self.direct:
            self.direct = False
            log.warning("local_disk %s: the file system refuses O_DIRECT (%s); using buffered I/O instead",
                        self.root, exc.strerror or exc)
