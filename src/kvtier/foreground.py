"""Foreground: background threads start their next item of work while the server's request thread waits for input.

CPython runs one thread's Python at a time. A lookup is about 0.1 ms of Python on the request thread; a background
thread (the L2 writer, a disk adapter's I/O pool, a promotion) that is running Python when a request arrives keeps
the GIL for up to the switch interval, and with several of them busy the request thread can wait for each in turn.
Measured under an engine's L2 traffic (``benchmarks/bench_lookup_hol.py``), a ``StoreCommit``'s reply took 0.6 ms
to send because the L2 writer it had just woken took the GIL. So the request loop marks itself ``busy`` from the
moment it wakes with input until it waits again (``waiting``), and background threads call ``wait_idle`` before
each item: they start it while the request thread waits, or after ``MAX_WAIT_SECONDS`` at the latest (a loop that
never waits, a saturated server, delays background work by that much per item, never stops it).

The same for the OS scheduler: threads whose work is never urgent (the L2 writes) call ``background_thread`` once
and run at nice ``BACKGROUND_NICENESS``, so on busy cores a woken request thread (and libzmq's I/O thread) takes
a core from them rather than waiting for their time slice to end.

One per process (``FOREGROUND``): several request loops in one process (tests) count together; in a process
without a request loop nothing is ever busy and ``wait_idle`` returns at once.

Thread-safety: every method may be called from any thread; ``busy`` and ``waiting`` by request loops only.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import AbstractContextManager, nullcontext

MAX_WAIT_SECONDS = 0.005  # the longest a background item waits for a busy request thread
# in a process with a request loop: a busy background thread keeps the GIL this long at most when the request
# thread wakes needing it (the default, 5 ms, is fifty lookups)
SWITCH_INTERVAL_SECONDS = 0.0005
BACKGROUND_NICENESS = 10  # added to a background thread's nice, and to server/hashproc.py's child's


def background_thread() -> None:
    """Lower the calling thread's OS priority by ``BACKGROUND_NICENESS`` (Linux: each thread has its own nice;
    at most 19). Where the OS refuses or has no per-thread nice, nothing changes: only priority is lost."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICENESS))
    except (OSError, AttributeError):
        pass


class Foreground:
    """How many request loops are handling input now; background threads wait while any is.

    The request loop's side costs a lock and a counter per wake-up (``waiting``): the event background threads
    block on is only set when one of them waits (``wait_idle`` counts itself in and clears it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0
        self._waiters = 0  # threads inside wait_idle
        self._idle = threading.Event()  # set by the idle() that ends the last busy mark while a thread waits
        self._waiting = _Waiting(self)

    def loop_started(self) -> None:
        """A request loop starts: it is busy (call ``idle`` when it stops for good), and the process's GIL switch
        interval is at most ``SWITCH_INTERVAL_SECONDS`` from now on."""
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_SECONDS))
        self.busy()

    def busy(self) -> None:
        """A request loop starts handling input."""
        with self._lock:
            self._busy += 1

    def idle(self) -> None:
        """A request loop stops handling input: background threads may run."""
        with self._lock:
            self._busy = max(0, self._busy - 1)
            if not self._busy and self._waiters:
                self._idle.set()

    def waiting(self, idle: bool = True) -> AbstractContextManager[None]:
        """Around a request loop's wait for input: idle inside, busy again after (also on an exception); with
        ``idle`` False (a poll that does not wait: requests are queued), busy throughout."""
        return self._waiting if idle else _BUSY_THROUGHOUT

    def wait_idle(self, max_seconds: float = MAX_WAIT_SECONDS) -> bool:
        """Block (without the GIL) until no request loop is busy, at most ``max_seconds``; False on timeout."""
        with self._lock:
            if not self._busy:
                return True
            self._waiters += 1
            self._idle.clear()  # a set left from an earlier idle period
        try:
            return self._idle.wait(max_seconds)
        finally:
            with self._lock:
                self._waiters -= 1


class _Waiting:
    """``Foreground.waiting``'s context (a class, not a generator: the request loop enters it once per wake-up)."""

    __slots__ = ("_foreground",)

    def __init__(self, foreground: Foreground):
        self._foreground = foreground

    def __enter__(self) -> None:
        self._foreground.idle()

    def __exit__(self, *exc) -> None:
        self._foreground.busy()


_BUSY_THROUGHOUT = nullcontext()


FOREGROUND = Foreground()
