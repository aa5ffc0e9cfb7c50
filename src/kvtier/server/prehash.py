"""Long prompts are hashed on a worker thread, so short requests are not queued behind them.

Hashing a prompt (``KVCache.chunk_refs``) costs about 0.25 µs per token on the request thread; one hostile (or
just long) prompt would hold every other client for that long. A request whose prompt has at least
``server.hash_offload_min_tokens`` tokens to hash (those after its longest prefix in the lookup memo:
``PromptKeys.unhashed_tokens``) is parked here instead: the worker
computes its chunk refs (which puts them in the memo) and the request loop then handles the request as usual,
now without hashing. The block hashing itself runs in a child process at a lower CPU priority
(``server/hashproc.py``): the worker thread waits on its pipe without the GIL, so a stream of long prompts does
not hold the request thread (hashed on the thread, it did: with 4 processes flooding new 8,192-token prompts,
honest lookups' p99 was 38 ms, 2.9 ms with the child; benchmarks/RESULTS.md). When the child is not available
the worker hashes in process.

Fairness: parked requests are queued per principal and the worker takes them round-robin, so a principal
flooding long prompts delays its own, not another's. Bounds: each parked request counts as in flight for its
session and principal (``server.max_inflight_requests_*``); at most ``server.max_hash_jobs`` are parked in all
(more: ``Error(limit_exceeded)``); one not hashed within ``server.promote_timeout_seconds`` is answered
``Error(limit_exceeded)`` too (a miss for the client, never a stall for the others).

Thread-safety: ``park``, ``take_ready``, ``take_expired`` and ``close`` are called by the request loop only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque

from kvtier import protocol as P
from kvtier.errors import KVTierError
from kvtier.hashing import prefix_hashes
from kvtier.server.hashproc import HashProcess, HashProcessError
from kvtier.server.jobs import Job, Wakeup

log = logging.getLogger(__name__)


class Prehasher:
    """The hashing worker and its per-principal queues.

    Args:
        min_tokens: prompts at least this long (and not memoised) are parked (``server.hash_offload_min_tokens``).
        max_jobs: requests parked at once (``server.max_hash_jobs``).
        timeout_seconds: a parked request not hashed by then is refused (``server.promote_timeout_seconds``).
        metrics: where ``kvtier_prehashed_requests_total`` counts the parked requests.
        store_min_tokens: the bound for a ``StoreBegin`` (``server.store_hash_offload_min_tokens``), when lower
            than ``min_tokens``: a store follows a forward pass over those tokens (milliseconds to seconds), so
            the hand-off's fraction of a millisecond costs it little, while its hashing on the request thread
            would delay every lookup that arrives meanwhile.
    """

    def __init__(self, min_tokens: int, max_jobs: int, timeout_seconds: float, metrics,
                 store_min_tokens: int | None = None):
        self.metrics = metrics
        self.min_tokens = min_tokens
        self.store_min_tokens = min(min_tokens, store_min_tokens or min_tokens)
        self.max_jobs = max_jobs
        self.timeout_seconds = timeout_seconds
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()  # principal -> parked jobs, rotated
        self._cond = threading.Condition()
        self._ready: deque[Job] = deque()
        self.waiting: dict[int, Job] = {}  # id(job) -> job, parked and not answered
        self._wakeup = Wakeup()
        self._stopped = False
        # a later answer would be refused anyway; a child still starting is not waited for
        self._hashproc = HashProcess(timeout_seconds, startup_wait_seconds=0.0)
        self._thread = threading.Thread(target=self._work, name="kvtier-prehash", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """A file descriptor readable when hashed requests are waiting (for ``zmq.Poller``)."""
        return self._wakeup.fileno()

    def park(self, identity: bytes, session, msg) -> bool | str:
        """Park ``msg`` (a request with ``tokens``) when its prompt has many tokens to hash: True (the caller
        answers later, from ``take_ready``), False (handle it now), or a refusal message (too many parked)."""
        tokens = getattr(msg, "tokens", None)
        min_tokens = self.store_min_tokens if isinstance(msg, P.StoreBegin) else self.min_tokens
        if tokens is None or len(tokens) // 8 < min_tokens:
            return False
        try:
            if session.cache.unhashed_tokens(*session.prompt(msg), extra_keys=msg.extra_keys) < min_tokens:
                return False
        except KVTierError:
            return False  # the handler answers the bad input
        if len(self.waiting) >= self.max_jobs:
            return (f"{len(self.waiting)} long prompts are waiting to be hashed, the bound (server.max_hash_jobs); "
                    "retry later, or raise that key")
        now = time.monotonic()
        job = Job(identity, msg, session, now, now + self.timeout_seconds)
        self.waiting[id(job)] = job
        session.usage.add(inflight=1)
        self.metrics.inc("kvtier_prehashed_requests_total")
        with self._cond:
            self._queues.setdefault(session.principal, deque()).append(job)
            self._cond.notify()
        return True

    def _next(self) -> Job | None:
        """The next job, round-robin over principals (call with the condition held)."""
        while not self._queues and not self._stopped:
            self._cond.wait()
        if self._stopped:
            return None
        principal, queue = next(iter(self._queues.items()))
        job = queue.popleft()
        del self._queues[principal]
        if queue:
            self._queues[principal] = queue  # to the back of the rotation
        return job

    def _work(self) -> None:
        try:
            self._hashproc.start()  # now, so that it is ready when the first long prompt comes
        except HashProcessError:
            pass  # logged; prompts are hashed in process until it can be started
        while True:
            with self._cond:
                job = self._next()
            if job is None:
                return
            try:
                if not job.answered and time.monotonic() < job.deadline:
                    self._hash(job.msg, job.session)
            except Exception:  # noqa: BLE001 -- bad input is answered by the handler; never a dead worker
                log.debug("prehash failed", exc_info=True)
            job.finished = True
            self._ready.append(job)
            self._wakeup.notify()

    def _hash(self, msg, session) -> None:
        """Put ``msg``'s chunk refs in its cache's memo."""
        session.chunk_refs(msg, hasher=self._prefix_hashes)

    def _prefix_hashes(self, *args, **kwargs) -> list[bytes]:
        """``hashing.prefix_hashes`` by the child process, or here while it is not available."""
        try:
            return self._hashproc.prefix_hashes(*args, **kwargs)
        except HashProcessError:
            return prefix_hashes(*args, **kwargs)

    def take_ready(self) -> list[Job]:
        """Hashed requests to handle now (their in-flight count released)."""
        self._wakeup.drain()
        out = []
        while self._ready:
            job = self._ready.popleft()
            if not job.answered:
                out.append(self._done(job))
        return out

    def take_expired(self, now: float) -> list[Job]:
        """Parked requests past their deadline (to refuse; their in-flight count released)."""
        return [self._done(job) for job in list(self.waiting.values()) if job.deadline <= now and not job.answered]

    def late(self, job: Job) -> str:
        """The refusal of a parked request not hashed in time."""
        return (f"the prompt of {len(job.msg.tokens) // 8} tokens was not hashed within "
                f"server.promote_timeout_seconds ({self.timeout_seconds} s): {len(self.waiting)} long prompts wait; "
                "retry later")

    def _done(self, job: Job) -> Job:
        job.answered = True
        self.waiting.pop(id(job), None)
        job.session.usage.add(inflight=-1)
        return job

    def close(self) -> None:
        """Stop the worker (after the job it is on) and close the pipe."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(5.0)
        self._hashproc.close()
        self._wakeup.close()
