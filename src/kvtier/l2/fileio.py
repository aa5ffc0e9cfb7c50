"""File I/O helpers of the local-disk adapter: full writes, buffered and O_DIRECT reads, aligned
buffers, directory fsync, private permissions. O_DIRECT needs buffer, offset and length aligned to the
block size. Records hold token ids and KV: files are 0600 and folders 0700 (``FILE_MODE``, ``DIR_MODE``)."""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvtier.l2.base import Buffer

ALIGN = mmap.PAGESIZE
FILE_MODE = 0o600
DIR_MODE = 0o700
O_DIRECT = getattr(os, "O_DIRECT", 0)


def write_all(fd: int, views: list[memoryview]) -> None:
    pending = [v for v in views if v.nbytes]
    while pending:
        n = os.writev(fd, pending[:1024])  # IOV_MAX
        while n and pending:
            if n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0


def read_buffered(path: str) -> Buffer:
    with open(path, "rb", buffering=0) as f:  # FileIO.readall: one read into a buffer of the file size
        return f.readall()


def read_direct(path: str) -> Buffer:
    fd = os.open(path, os.O_RDONLY | O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        view = aligned(round_up(size))  # the view keeps its buffer alive
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            got += n
            if n == 0 or n % ALIGN:  # end of file: an O_DIRECT read past it returns a short count
                break
    finally:
        os.close(fd)
    return view[:min(got, size)]


def aligned(nbytes: int) -> memoryview:
    """A page-aligned writable buffer of ``nbytes``. numpy's heap memory is reused across calls; a
    fresh mmap per read would pay a page fault per 4 KiB and run several times slower."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    offset = -raw.ctypes.data % ALIGN
    return memoryview(raw[offset:offset + nbytes]).cast("B")


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def tighten(path: str, mode: int, want: int) -> bool | None:
    """Make ``path`` (current ``st_mode`` ``mode``) private: drop group/other bits to ``want``. Returns None
    when it already was, True when tightened, False when it could not be (not ours, read-only)."""
    if not mode & 0o077:
        return None
    try:
        os.chmod(path, want)
        return True
    except OSError:
        return False
