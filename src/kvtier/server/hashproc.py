"""A child process that hashes long prompts for the server, at a lower CPU priority, without the server's GIL.

The hashing worker (``server/prehash.py``) hands every long prompt's block hashing (``hashing.prefix_hashes``)
to this process. Hashed on a thread of the server, a stream of long prompts held the GIL most of the time and
every short request waited for it; here the server's worker thread only waits on a pipe, and the child runs at
nice ``BACKGROUND_NICENESS`` (``kvtier.foreground``, as the L2 writes), so the kernel runs the request thread
first whenever both want a core.

Wire format (stdin / stdout of the child, nothing pickled): each message is a 4-byte little-endian length and a
msgspec MessagePack body: ``HashJob`` to the child, ``HashDone`` or ``HashFailed`` back, one reply per job, in
order. ``HashJob.tokens`` is the prompt as int64 little-endian bytes; ``extra_keys`` were checked by the server
(``extra_keys.check_extra_keys``); MessagePack turns their tuples into lists and shared keys into copies; the child rebuilds
that form (``extra_keys.refreeze_extra_keys``: pickle-based hashes depend on both).

Life cycle: started by ``start()`` (the server's hashing worker calls it when the server starts) or by the first
``prefix_hashes`` call; its first frame is ``HashReady``, once its imports are done. Until then ``prefix_hashes``
waits at most ``startup_wait_seconds`` and then raises ``HashProcessError`` (the caller hashes in process): on a
busy machine a child at a lower priority takes seconds to import, and the first long prompts must not wait for
it (they did: a store refused after 5 s with a 7 s start). A child not ready within ``STARTUP_LIMIT_SECONDS`` is
killed. The child exits when its stdin closes (the server stopped or died). A child that dies, answers garbage
or does not answer within ``reply_timeout_seconds`` (stopped, swapped out, stuck: it is killed) is restarted by
the next call after ``RESTART_BACKOFF_SECONDS``; until then ``prefix_hashes`` raises ``HashProcessError`` and the
caller hashes in process.
Thread-safety: one caller at a time (the hashing worker thread).
"""

from __future__ import annotations

import logging
import os
import select
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import msgspec
import numpy as np

from kvtier.errors import InputError
from kvtier.extra_keys import refreeze_extra_keys
from kvtier.foreground import BACKGROUND_NICENESS
from kvtier.hashing import prefix_hashes

log = logging.getLogger(__name__)
RESTART_BACKOFF_SECONDS = 5.0
STARTUP_LIMIT_SECONDS = 60.0  # a child that has not imported by then is stuck, not slow
CHILD_COMMAND = (sys.executable, "-m", "kvtier.server.hashproc")
MAX_FRAME_BYTES = 1 << 30
_LEN = struct.Struct("<I")


class HashJob(msgspec.Struct, tag="job"):
    tokens: bytes  # int64 little-endian
    block_size: int
    algorithm: str
    seed: str
    extra_keys: list | None = None
    include_partial: bool = False
    parent: bytes | None = None  # the digest before tokens[0] (None: the root hash)


class HashReady(msgspec.Struct, tag="ready"):
    """The child's first frame: its imports are done, jobs are answered from now on."""


class HashDone(msgspec.Struct, tag="done"):
    digests: list[bytes]


class HashFailed(msgspec.Struct, tag="failed"):
    message: str


class HashProcessError(RuntimeError):
    """The hashing process is not available (not started, died, or answered out of protocol)."""


def _write(stream, body: bytes) -> None:
    stream.write(_LEN.pack(len(body)) + body)
    stream.flush()


def _read(stream) -> bytes | None:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (size,) = _LEN.unpack(head)
    body = stream.read(size) if size <= MAX_FRAME_BYTES else b""
    return body if len(body) == size else None


def _ready(fd: int, deadline: float, write: bool = False) -> None:
    wait = deadline - time.monotonic()
    readable, writable, _ = select.select([] if write else [fd], [fd] if write else [], [], max(0.0, wait))
    if not (writable if write else readable):
        raise TimeoutError("the hashing process did not keep up")


def _write_by(fd: int, body: bytes, deadline: float) -> None:
    """``_write`` on the non-blocking pipe ``fd`` (its file object left unused) by ``time.monotonic()``
    ``deadline``. Raises TimeoutError."""
    data = memoryview(_LEN.pack(len(body)) + body)
    while data:
        _ready(fd, deadline, write=True)
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:  # no room after all: wait again
            continue


def _read_by(fd: int, deadline: float) -> bytes | None:
    """One frame from the pipe ``fd`` (its file object left unused) by ``deadline``; None at end of file.
    Raises TimeoutError."""
    def exactly(size: int) -> bytes | None:
        parts, left = [], size
        while left:
            _ready(fd, deadline)
            part = os.read(fd, min(left, 1 << 20))
            if not part:
                return None
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    head = exactly(_LEN.size)
    if head is None or _LEN.unpack(head)[0] > MAX_FRAME_BYTES:
        return None
    return exactly(_LEN.unpack(head)[0])


class HashProcess:
    """The server's end of the hashing child (see the module docstring).

    Args:
        reply_timeout_seconds: the longest wait for one answer; then the child is killed and replaced.
        startup_wait_seconds: how long ``prefix_hashes`` waits for a child still starting before it raises
            ``HashProcessError`` (the server passes 0: its first long prompts are hashed in process meanwhile).
        clock: seconds, for the restart backoff; ``time.monotonic`` unless a test drives that time itself (the
            wait for an answer is always real time).
    """

    def __init__(self, reply_timeout_seconds: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 startup_wait_seconds: float = 30.0) -> None:
        self.reply_timeout_seconds = reply_timeout_seconds
        self.startup_wait_seconds = startup_wait_seconds
        self.clock = clock
        self._proc: subprocess.Popen | None = None
        self._ready = False  # the current child has sent HashReady
        self._started_at = 0.0  # time.monotonic() of the current child's start
        self._failed_at = float("-inf")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(HashDone | HashFailed)
        self._ready_decoder = msgspec.msgpack.Decoder(HashReady)

    def start(self) -> None:
        """Start the child now if none runs (it gets ready in the background). Raises HashProcessError when it
        cannot be started."""
        self._running()

    def prefix_hashes(self, tokens: np.ndarray, block_size: int, algorithm: str, seed: str, extra_keys=None, *,
                      include_partial: bool = False, parent: bytes | None = None) -> list[bytes]:
        """``hashing.prefix_hashes`` computed by the child; ``tokens`` is an int64 array, ``extra_keys`` as checked
        by ``extra_keys.check_extra_keys``. Raises InputError as ``prefix_hashes`` does, HashProcessError when the
        child is not available (the caller hashes in process)."""
        proc = self._running()
        if not self._ready:
            self._await_ready(proc)
        job = HashJob(np.ascontiguousarray(tokens, "<i8").tobytes(), block_size, algorithm, seed,
                      None if extra_keys is None else list(extra_keys), include_partial, parent)
        try:
            deadline = time.monotonic() + self.reply_timeout_seconds
            _write_by(proc.stdin.fileno(), self._encoder.encode(job), deadline)
            body = _read_by(proc.stdout.fileno(), deadline)
            reply = None if body is None else self._decoder.decode(body)
        except TimeoutError:
            proc.kill()
            self._fail(f"no answer within {self.reply_timeout_seconds:g} s (killed)")
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
        if reply is None:
            self._fail("it exited")
        if isinstance(reply, HashFailed):  # only bad input gets here: the same error as hashing in process
            raise InputError(reply.message)
        return reply.digests

    def _await_ready(self, proc: subprocess.Popen) -> None:
        """Wait up to ``startup_wait_seconds`` for the child's ``HashReady``. Raises HashProcessError when it has
        not come (still starting: the child is kept; past ``STARTUP_LIMIT_SECONDS`` or out of protocol: killed)."""
        try:
            body = _read_by(proc.stdout.fileno(), time.monotonic() + self.startup_wait_seconds)
            if body is None:
                self._fail("it exited while starting")
            self._ready_decoder.decode(body)
        except TimeoutError:
            if time.monotonic() - self._started_at < STARTUP_LIMIT_SECONDS:
                raise HashProcessError("the hashing process is still starting; hashing in process") from None
            proc.kill()
            self._fail(f"not ready within {STARTUP_LIMIT_SECONDS:g} s (killed)")
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
        self._ready = True

    def _running(self) -> subprocess.Popen:
        if self._proc is not None:
            if self._proc.poll() is None:
                return self._proc
            self._fail(f"it exited with status {self._proc.returncode}")
        if self.clock() - self._failed_at < RESTART_BACKOFF_SECONDS:
            raise HashProcessError("the hashing process failed recently; hashing in process")
        try:
            self._proc = subprocess.Popen(list(CHILD_COMMAND), stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, close_fds=True)
            os.set_blocking(self._proc.stdin.fileno(), False)  # a stopped child must not block a write
            self._ready, self._started_at = False, time.monotonic()
            _lower_priority(self._proc.pid)
        except OSError as exc:
            self._fail(f"cannot start it: {exc}")
        return self._proc

    def _fail(self, why: str):
        self._failed_at = self.clock()
        self.close()
        log.warning("hashing process: %s; long prompts are hashed in the server process for %.0f s",
                    why, RESTART_BACKOFF_SECONDS)
        raise HashProcessError(why)

    def close(self) -> None:
        """Stop the child (it exits when its stdin closes; killed if it does not within 2 s)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _lower_priority(pid: int) -> None:
    """Nice the child by ``BACKGROUND_NICENESS`` from here, at once: set by the child itself, it came only after its
    imports, seconds on a busy machine."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICENESS))
    except OSError:
        pass  # only priority is lost


def main() -> None:
    """The child: answer ``HashJob`` frames on stdin until it closes. A server gone (its pipes closed: it stopped,
    or refused to start after starting this child) ends it quietly: it shares the server's stderr."""
    try:
        _serve(sys.stdin.buffer, sys.stdout.buffer)
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass
    finally:
        try:
            sys.stdout.close()
        except OSError:
            pass  # the server is gone: nothing left to flush to


def _serve(stdin, stdout) -> None:
    decoder, encoder = msgspec.msgpack.Decoder(HashJob), msgspec.msgpack.Encoder()
    _write(stdout, encoder.encode(HashReady()))
    while (body := _read(stdin)) is not None:
        try:
            job = decoder.decode(body)
            extra = None if job.extra_keys is None else refreeze_extra_keys(job.extra_keys)
            reply = HashDone(prefix_hashes(np.frombuffer(job.tokens, "<i8"), job.block_size, job.algorithm, job.seed, extra,
                                           include_partial=job.include_partial, parent=job.parent))
        except Exception as exc:  # noqa: BLE001 -- every job gets its answer; the server raises it as InputError
            reply = HashFailed(f"{exc}")
        _write(stdout, encoder.encode(reply))


if __name__ == "__main__":
    main()
