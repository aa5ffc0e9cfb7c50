"""Python's garbage collector, run between requests instead of inside them.

CPython collects its youngest generation whenever 700 more objects were allocated than freed (``gc`` thresholds),
wherever that happens: inside a lookup, a collection of the young generations adds 0.1-1 ms to it, a full one
10 ms or more (measured in the server under ``benchmarks/bench_lookup_hol.py --modes paced``: 12 collections of
the middle generation took 0.7-1 ms each, one full collection 12 ms). The request loop calls
``between_requests`` when it has answered everything it read and nothing more is waiting: the collection due
next is run there, a little early, so the automatic one rarely comes due during a request. The automatic
collector stays on: a thread that allocates faster (an L2 writer, the admin HTTP) still triggers it.

At ``start`` the objects the server made while starting (modules, configuration, tiers, sockets) are moved out
of the collector's sight (``gc.freeze``): they live as long as the server, and a full collection no longer
walks them. ``stop`` gives them back (``gc.unfreeze``), for a server run inside another program.

Thread-safety: every method is called by the request loop only.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

FULL_MIN_INTERVAL_SECONDS = 1.0  # full collections started here: at most one a second (each walks the whole heap)


class IdleCollector:
    """Runs the collection that comes due next when the request loop is idle (module docstring). ``clock``: seconds,
    ``time.monotonic`` unless a test drives the time itself."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.thresholds = gc.get_threshold()
        self.clock = clock
        self._last_full = float("-inf")

    def start(self) -> None:
        """Freeze what exists now (``gc.freeze``): objects made while starting are never walked again."""
        gc.freeze()

    def between_requests(self, waiting: Callable[[], bool] = lambda: False) -> int | None:
        """Collect the generation the automatic collector would take next, when at least half of the young
        generation's threshold was allocated since the last collection and ``waiting()`` (asked only then: a
        request arrived meanwhile) is False; returns that generation (None: nothing collected). Nothing while
        the collector is off (``gc.disable``: the program's choice)."""
        t0, t1, t2 = self.thresholds
        c0, c1, c2 = gc.get_count()
        if not gc.isenabled() or t0 <= 0 or c0 < t0 // 2 or waiting():
            return None
        generation = 0
        if c1 + 1 >= t1:  # the next young collection would take the middle generation too
            generation = 1
            now = self.clock()
            if c2 + 1 >= t2 and now - self._last_full >= FULL_MIN_INTERVAL_SECONDS:
                generation, self._last_full = 2, now
        gc.collect(generation)
        return generation

    def stop(self) -> None:
        """Give the frozen objects back to the collector (``gc.unfreeze``)."""
        gc.unfreeze()
