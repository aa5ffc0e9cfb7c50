"""Work off the request thread: a pool of daemon workers running the server's L2 jobs (promotions, lookup probes).

A job is one request a client waits for while a worker runs ``fn`` for it: an L2 -> L1 promotion of a retrieve's
or a prefetch's chunks (``server/dataops.py``), or a probe of a lagging L2 index for a lookup
(``server/lookup.py``). The pool knows nothing of what ``fn`` does. ``Wakeup`` is the pipe a worker thread
wakes the request loop with (the hashing worker, ``server/prehash.py``, uses one too).

Life of a job::

    request loop: submit(job, fn)   (False: max_promotions in flight, answer from L1 now)
    worker:       fn()              (L2 reads and L1 copies; never touches the socket or the server lock; started
                                     when the request thread is idle, or 5 ms later: kvtier.foreground)
                  -> ready queue + one byte on a pipe the loop polls
    request loop: take_ready()      (finished jobs not yet answered) or take_expired(now) (past the
                  deadline: answered without it, e.g. from L1 alone, counted by the caller)

A job is answered exactly once, by whichever of ``take_ready`` / ``take_expired`` sees it first; a worker that
finishes after its deadline still leaves its copies in L1 (useful to the next request) but sends nothing.
A job whose deadline passed before a worker picked it up is skipped. Workers are daemon threads: an adapter
that hangs forever holds its worker, never the process (``max_promotions`` bounds what piles up behind it).

Joining: a job submitted with a ``key`` (the first chunk it would read from L2) while an unfinished job with the
same key is queued or running is not queued: it *follows* that job and is handed back with it (``take_ready``),
so a retrieve arriving while its prompt's prefetch reads L2 waits for that read instead of reading the same
records again. A follower keeps its own deadline (``take_expired``) and does not count in ``max_jobs``.

Thread-safety: ``submit``, ``take_ready``, ``take_expired`` and ``close`` are called by the request loop only;
workers touch the job's ``fn`` and the ready queue. L1 and L2 are thread-safe on their own.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.foreground import FOREGROUND
from kvtier.metrics import Metrics

log = logging.getLogger(__name__)


class Wakeup:
    """A pipe a worker thread writes a byte to when it has results, for the request loop's ``zmq.Poller``."""

    def __init__(self):
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)

    def fileno(self) -> int:
        return self._rfd

    def notify(self) -> None:
        try:
            os.write(self._wfd, b"x")
        except OSError:  # the pipe is full of wake-ups already, or closed by close()
            pass

    def drain(self) -> None:
        try:
            while os.read(self._rfd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in (self._rfd, self._wfd):
            os.close(fd)


@dataclass(eq=False)
class Job:
    """One job a client waits for: who asked (routing ``identity``), the request, its session and deadline
    (``time.monotonic()`` seconds). ``result`` is what ``fn`` returned (None if it raised or was skipped)."""

    identity: bytes
    msg: Any
    session: Any
    started: float
    deadline: float
    result: Any = None
    answered: bool = False
    finished: bool = field(default=False, repr=False)
    key: Any = field(default=None, repr=False)  # what followers join on (``JobPool.submit``)
    followers: list[Job] = field(default_factory=list, repr=False)
    joined: bool = False  # True: this job followed another one and ran nothing itself


class JobPool:
    """The pool (module docstring).

    Args:
        threads: worker threads (``server.promote_threads``).
        max_jobs: jobs queued or running, abandoned ones included (``server.max_promotions``).
        metrics: where ``kvtier_l2_promotions_in_flight`` is kept.
    """

    def __init__(self, threads: int, max_jobs: int, metrics: Metrics):
        self.max_jobs = max_jobs
        self.metrics = metrics
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = Wakeup()
        self._lock = threading.Lock()
        self._in_flight = 0  # submitted and not finished (abandoned ones too: their worker may still be stuck)
        self._running: dict[Any, Job] = {}  # key -> the unfinished job followers join (under _lock)
        self.waiting: dict[int, Job] = {}  # id(job) -> job, submitted and not answered
        self._threads = [threading.Thread(target=self._work, name=f"kvtier-promote-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def fileno(self) -> int:
        """A file descriptor readable when finished jobs are waiting (for ``zmq.Poller``)."""
        return self._wakeup.fileno()

    def submit(self, job: Job, fn: Callable[[], Any], key: Any = None) -> bool:
        """Queue ``fn`` for ``job``, or make ``job`` follow the unfinished job submitted with the same ``key``
        (sets ``job.joined``; ``fn`` is not run). False (nothing queued) when ``max_jobs`` are in flight."""
        with self._lock:  # a worker marks its job finished under it: a follower never joins a job handed back
            leader = self._running.get(key) if key is not None else None
            if leader is not None:
                job.joined = True
                leader.followers.append(job)
                self.waiting[id(job)] = job
                return True
            if self._in_flight >= self.max_jobs:
                return False
            self._in_flight += 1
            self.metrics.set("kvtier_l2_promotions_in_flight", self._in_flight)
            if key is not None:
                job.key = key
                self._running[key] = job
        self.waiting[id(job)] = job
        self._todo.put((job, fn))
        return True

    def _work(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            job, fn = item
            try:
                if not job.answered and time.monotonic() < job.deadline:  # else nobody waits for it
                    FOREGROUND.wait_idle()  # the request thread first (a lookup is shorter than a promotion)
                    job.result = fn()
            except Exception:  # noqa: BLE001 -- a bug in a promotion is a miss, never a dead worker
                log.exception("L2 job failed")
            finally:
                with self._lock:
                    self._in_flight -= 1
                    self.metrics.set("kvtier_l2_promotions_in_flight", self._in_flight)
                    if job.key is not None and self._running.get(job.key) is job:
                        del self._running[job.key]
                    job.finished = True
                self._ready.put(job)
                self._wakeup.notify()

    def take_ready(self) -> list[Job]:
        """Finished jobs, and their followers, still waiting for their answer (marked answered)."""
        self._wakeup.drain()
        out = []
        while True:
            try:
                job = self._ready.get_nowait()
            except queue.Empty:
                return out
            for one in (job, *job.followers):
                if not one.answered:
                    one.answered = one.finished = True
                    self.waiting.pop(id(one), None)
                    out.append(one)

    def take_expired(self, now: float) -> list[Job]:
        """Unfinished jobs past their deadline (marked answered; their workers' results will be ignored)."""
        out = [job for job in self.waiting.values() if job.deadline <= now and not job.answered]
        for job in out:
            job.answered = True
            del self.waiting[id(job)]
        return out

    def poll_milliseconds(self, tick_milliseconds: int) -> int:
        """How long the request loop may wait for input: ``tick_milliseconds``, or less, up to the earliest deadline of a
        waiting job (so a short deadline, e.g. a lookup's probe, is answered on time)."""
        if not self.waiting:
            return tick_milliseconds
        left = min(job.deadline for job in self.waiting.values()) - time.monotonic()
        return max(0, min(tick_milliseconds, math.ceil(left * 1000)))

    @property
    def in_flight(self) -> int:
        """Jobs queued or running (abandoned ones whose worker is still busy included)."""
        with self._lock:
            return self._in_flight

    def close(self) -> None:
        """Stop idle workers (busy ones are daemons and die with the process) and close the pipe."""
        for _ in self._threads:
            self._todo.put(None)
        self._wakeup.close()
