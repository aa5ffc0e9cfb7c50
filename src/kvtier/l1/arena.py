"""Arena: one contiguous host-memory region with a first-fit allocator.

The region is an anonymous private ``mmap`` in-process, or a file under ``/dev/shm`` when a
``shm_name`` is given, so other processes (engine clients of the server) can map the same bytes
(``kvtier.client.dataplane.SharedMapping``). An anonymous arena is backed only when its pages are first
written. A ``/dev/shm`` arena has every page reserved at startup (``posix_fallocate``): tmpfs allocates
file pages lazily, and a page that cannot be allocated later (``/dev/shm`` filled by someone else meanwhile)
kills the writer, server or client, with SIGBUS; reserved up front, a full ``/dev/shm`` is a clear error at
startup instead. The reservation is tmpfs memory (shown as Shmem), not the server's RSS until pages are touched.

Allocator: free blocks are kept as a sorted list of offsets plus a dict offset -> size.
``alloc`` is first fit, a scan over the free blocks in address order (O(f), f = number of free
blocks, which stays small because neighbours coalesce); ``free`` finds both neighbours by bisection
(O(log f)) and coalesces them; inserting into the sorted list is a C-level memmove (O(f), tiny).
Offsets and sizes are multiples of ``ALIGN_BYTES`` (64, one cache line), so every block is aligned.

Not thread-safe: ``L1Store`` serialises calls under its lock.

We map ``/dev/shm`` files with ``os.open`` + ``mmap`` rather than
``multiprocessing.shared_memory``: on Python 3.11 its resource tracker unlinks the segment when an
*attaching* process exits, which would delete the server's L1 under it.
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import weakref

from kvtier.errors import ConfigError, InputError, KVTierError
from kvtier.shm import SHM_DIR, check_range, shm_path

ALIGN_BYTES = 64


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN_BYTES``."""
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _unlink_if_creator(path: str, creator_pid: int, inode: int) -> None:
    # Not in a forked child that inherited the finalizer, nor a newer file that replaced ours.
    try:
        if os.getpid() == creator_pid and os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _no_room(free_bytes: int, capacity_bytes: int) -> str:
    return (f"{SHM_DIR} has {free_bytes} bytes free but the L1 arena needs {capacity_bytes}: lower l1_size_gb "
            f"or enlarge {SHM_DIR} (e.g. docker --shm-size, or stop what fills it)")


def _check_capacity(capacity_bytes: int) -> int:
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < ALIGN_BYTES:
        raise ConfigError(f"arena capacity_bytes must be an int >= {ALIGN_BYTES}, got {capacity_bytes!r}")
    return capacity_bytes


class Arena:
    """A contiguous region of ``capacity_bytes`` with a first-fit, coalescing allocator.

    Args:
        capacity_bytes: size of the region in bytes (int >= 64). The allocator manages the largest
            multiple of 64 that fits.
        shm_name: when given, back the region with the new file ``/dev/shm/<shm_name>`` (created
            exclusively) so that other processes can map it (``kvtier.client.dataplane.SharedMapping``); None for anonymous memory.
        replace: with ``shm_name``, unlink a stale file of that name first (e.g. left by a crashed
            server) instead of raising.

    Raises:
        ConfigError: bad capacity or name; the shm file exists (and ``replace`` is False); not
            enough free space in ``/dev/shm`` to reserve every page (``posix_fallocate``).
    """

    def __init__(self, capacity_bytes: int, shm_name: str | None = None, *, replace: bool = False):
        self.capacity_bytes = _check_capacity(capacity_bytes)
        self.shm_name = shm_name
        if shm_name is None:
            self._mmap = mmap.mmap(-1, capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MiB pages where THP is "madvise": fewer faults, TLB misses
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
        else:
            self._mmap, inode = self._create_shm(shm_name, capacity_bytes, replace)
            # A creator that exits (or drops the arena) without unlink() must not leave the file behind.
            self._finalizer = weakref.finalize(self, _unlink_if_creator, shm_path(shm_name), os.getpid(), inode)
        self._buf = memoryview(self._mmap)
        self._init_allocator()

    def _init_allocator(self) -> None:
        usable = self.capacity_bytes // ALIGN_BYTES * ALIGN_BYTES
        self._free_offsets: list[int] = [0]
        self._free_sizes: dict[int, int] = {0: usable}
        self._used: dict[int, int] = {}
        self._used_bytes = 0
        self._closed = False

    @staticmethod
    def _create_shm(shm_name: str, capacity_bytes: int, replace: bool) -> tuple[mmap.mmap, int]:
        path = shm_path(shm_name)
        if replace:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        stat = os.statvfs(SHM_DIR)
        free_bytes = stat.f_bavail * stat.f_frsize
        if capacity_bytes > free_bytes:
            raise ConfigError(_no_room(free_bytes, capacity_bytes))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(
                f"shared-memory file {path} already exists: another kvtier server may be using it; "
                f"pick another shm_name, or remove the file if it is stale"
            ) from None
        try:
            try:  # every page now, so no write into the arena can ever hit a full tmpfs (SIGBUS)
                os.posix_fallocate(fd, 0, capacity_bytes)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EFBIG):
                    raise ConfigError(f"cannot reserve {capacity_bytes} bytes for the L1 arena in {path}: "
                                      f"{exc.strerror}") from exc
                stat = os.statvfs(SHM_DIR)
                raise ConfigError(_no_room(stat.f_bavail * stat.f_frsize, capacity_bytes)) from exc
            return mmap.mmap(fd, capacity_bytes, flags=mmap.MAP_SHARED), os.fstat(fd).st_ino
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    # -- allocator -------------------------------------------------------------------------------

    def _check_allocator(self) -> None:
        if self._closed:
            raise KVTierError("arena is closed")

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new block of at least ``nbytes`` (rounded up to 64), or None if no free block fits.

        First fit in address order. Raises InputError when ``nbytes`` is not a positive int.
        """
        self._check_allocator()
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InputError(f"alloc needs a positive int number of bytes, got {nbytes!r}")
        size = align_up(nbytes)
        sizes = self._free_sizes
        for i, off in enumerate(self._free_offsets):
            block = sizes[off]
            if block < size:
                continue
            del sizes[off]
            if block == size:
                del self._free_offsets[i]
            else:  # keep the tail free in place of the head: the list stays sorted
                self._free_offsets[i] = off + size
                sizes[off + size] = block - size
            self._used[off] = size
            self._used_bytes += size
            return off
        return None

    def free(self, offset: int) -> int:
        """Return the block at ``offset`` to the free list, merging free neighbours.

        Returns the size in bytes of the free block now containing it (callers use it to tell
        whether an allocation of some size can succeed). Raises InputError for an offset that is
        not an allocated block (double free or a foreign offset).
        """
        self._check_allocator()
        size = self._used.pop(offset, None)
        if size is None:
            raise InputError(f"free({offset}): not the offset of an allocated block (double free?)")
        self._used_bytes -= size
        offsets, sizes = self._free_offsets, self._free_sizes
        i = bisect.bisect_left(offsets, offset)
        start, end = offset, offset + size
        if i < len(offsets) and offsets[i] == end:  # merge with the following free block
            end += sizes.pop(end)
            del offsets[i]
        if i > 0 and offsets[i - 1] + sizes[offsets[i - 1]] == start:  # merge into the preceding one
            start = offsets[i - 1]
            sizes[start] = end - start
        else:
            offsets.insert(i, start)
            sizes[start] = end - start
        return end - start

    def block_size(self, offset: int) -> int:
        """Size in bytes (64-aligned) of the allocated block at ``offset``; InputError if none."""
        try:
            return self._used[offset]
        except KeyError:
            raise InputError(f"no allocated block at offset {offset}") from None

    def largest_free_bytes(self) -> int:
        """Size of the largest free block (O(f)); 0 when full."""
        return max(self._free_sizes.values(), default=0)

    def free_blocks(self) -> list[tuple[int, int]]:
        """(offset, size) of every free block in address order (for tests and diagnostics)."""
        return [(off, self._free_sizes[off]) for off in self._free_offsets]

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated blocks, including the round-up to 64."""
        return self._used_bytes

    # -- memory ----------------------------------------------------------------------------------

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Writable memoryview (format ``B``) of ``nbytes`` bytes at ``offset``; no copy.

        Raises InputError when the range is not inside the arena, KVTierError when closed.
        """
        if self._closed:
            raise KVTierError("arena is closed")
        check_range(offset, nbytes, self.capacity_bytes)
        return self._buf[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap the region. Idempotent.

        Views handed out keep the mapping alive until they are released (Python refuses to unmap
        memory that is still exported); after ``close`` the arena itself refuses new calls.
        """
        if self._closed:
            return
        self._closed = True
        self._buf.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # outstanding views: the mapping goes when the last one is garbage-collected

    def unlink(self) -> None:
        """Remove the ``/dev/shm`` file (no-op for anonymous arenas or if already gone).

        Processes that mapped it keep their mapping; new attaches fail. The arena removes only the
        file it created (not a newer one of the same name), and also does so when it is
        garbage-collected or the process exits without calling ``unlink``.
        """
        if self.shm_name is not None:
            self._finalizer()  # unlinks our file (not a replacement) once; later calls do nothing

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        where = f"shm={self.shm_name!r}" if self.shm_name else "anonymous"
        return f"Arena({self.capacity_bytes} bytes, {where}, used={self._used_bytes})"


class VirtualArena(Arena):
    """The allocator of ``Arena`` over no memory at all: offsets, first fit, coalescing and fragmentation as in a
    real arena of ``capacity_bytes``, but nothing is mapped, so any size costs only the bookkeeping.

    For the trace simulator (``kvtier.trace.simulate``), which replays eviction through ``L1Store`` at sizes larger
    than the machine. ``view`` returns an empty memoryview: there are no bytes to copy. An anonymous ``mmap``
    is lazy too (pages are backed when first written), but reserving the address space of a size larger than
    RAM + swap is refused under the kernel's default overcommit heuristic, and tests of large sizes would depend
    on the host's settings.
    """

    _EMPTY = memoryview(b"")

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = _check_capacity(capacity_bytes)
        self.shm_name = None
        self._init_allocator()

    def view(self, offset: int, nbytes: int) -> memoryview:
        """An empty view: no memory is behind the offsets (which the allocator alone hands out, in range)."""
        return self._EMPTY

    def close(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"VirtualArena({self.capacity_bytes} bytes, used={self._used_bytes})"
