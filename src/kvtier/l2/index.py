"""L2Index: which chunks the L2 adapters hold, answered from memory so a lookup never waits for an adapter.

Each adapter's own in-memory index (``L2Adapter.indexed``) answers; for an adapter without one this class keeps
a name set, filled from ``list_names`` on a background thread at start and kept in step by ``note`` (the tier
calls it after writes, deletes, evictions and reads). An index may lag behind the store: a record another
writer stored (another server sharing the bucket) is not in it until I/O finds it. So where ``held`` stops
before the prompt ends, the leading names past it are *probed* in the background (``contains``, real I/O, on
the daemon thread ``kvtier-l2-probe``); adapters adopt what they find, and a later lookup counts it. At most
``MAX_PROBES`` probe batches wait; more are skipped and counted (``kvtier_l2_probes_skipped_total``).

Records the tier read and may not serve (signed with a key this server does not hold, a codec it lacks or
may not use: ``refuse``) stay in their store, but never count as held here, so a lookup never reports a chunk
retrieve would refuse; a write of the same name by this server lifts the refusal.

Thread-safe: ``held`` runs on request threads, ``note`` on the tier's threads, probes on their own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.l2.base import L2Adapter
from kvtier.metrics import Metrics

log = logging.getLogger(__name__)
MAX_PROBES = 16  # probe batches waiting; more lookups past the index are not probed (counted)
PROBE_NAMES = 32  # names asked per probe: the leading ones past the index
FRESH_MISS_SECONDS = 1.0  # a name I/O found missing this recently is not probed again in the background
MAX_FRESH_MISSES = 65536  # names remembered as freshly missing (forgotten all at once past it)
MAX_REFUSED = 65536  # refused names remembered per adapter (forgotten all at once past it: read and refused again)

# (adapter, op, names, missing value) -> one result per name; L2Tier._per_name (errors become misses + metric)
PerName = Callable[[L2Adapter, str, list, object], list]


class L2Index:
    """The cascade's in-memory view of what each adapter holds.

    Args:
        adapters: in cascade order (the tier's list).
        metrics: where index errors and skipped probes are counted.
        per_name: how to run an adapter operation name by name with errors as misses (``L2Tier._per_name``).
    """

    def __init__(self, adapters: Sequence[L2Adapter], metrics: Metrics, per_name: PerName):
        self.adapters = list(adapters)
        self.metrics = metrics
        self._per_name = per_name
        self._lock = threading.Lock()
        # adapters without an index of their own get one here: adapter position -> names
        self._own: dict[int, set[str]] = {i: set() for i, a in enumerate(self.adapters) if a.indexed([]) is None}
        self._probes: queue.Queue = queue.Queue()
        self._probing: set[str] = set()  # names queued for a probe (no duplicates)
        # name -> time.monotonic() when probe_now found no adapter holding it: the background probe a lookup
        # queues right after a foreground one (server/lookup.py) would only ask the same question again
        self._missed: dict[str, float] = {}
        self._refused: dict[int, set[str]] = {}  # adapter position -> names held there that are not servable here
        if self.adapters:
            threading.Thread(target=self._prober, name="kvtier-l2-probe", daemon=True).start()
        if self._own:
            threading.Thread(target=self._fill_own, name="kvtier-l2-index", daemon=True).start()

    def held(self, names: list[str], probe: bool = True) -> int:
        """How many leading ``names`` some adapter's index holds (no I/O); with ``probe``, probes the names past
        them in the background."""
        present = [False] * len(names)
        for i, adapter in enumerate(self.adapters):
            missing = [j for j, p in enumerate(present) if not p]
            if not missing:
                break
            for j, hit in zip(missing, self._indexed(i, adapter, [names[j] for j in missing])):
                present[j] = present[j] or bool(hit)
        count = _leading(present)
        if probe and count < len(names):
            self._probe(names[count:count + PROBE_NAMES])
        return count

    def held_each(self, names: list[str]) -> list[list[bool]]:
        """Per adapter (cascade order), which ``names`` its index holds (no I/O, no probe; refused names are not
        held): what the management API shows per tier."""
        return [self._indexed(i, adapter, names) for i, adapter in enumerate(self.adapters)]

    def probe_now(self, names: list[str]) -> int:
        """How many leading ``names`` some adapter holds, asking each adapter (``contains``: I/O). Adapters adopt
        what they find into their index; this class's own sets are updated here."""
        present = [False] * len(names)
        for adapter in self.adapters:
            missing = [i for i, p in enumerate(present) if not p]
            if not missing:
                break
            asked = [names[i] for i in missing]
            found = self._unrefused(adapter, asked, self._per_name(adapter, "contains", asked, False))
            self.note(adapter, [n for n, hit in zip(asked, found) if hit], True)
            for i, hit in zip(missing, found):
                present[i] = present[i] or bool(hit)
        now = time.monotonic()
        with self._lock:
            if len(self._missed) > MAX_FRESH_MISSES:
                self._missed.clear()
            for name, hit in zip(names, present):
                if hit:
                    self._missed.pop(name, None)
                else:
                    self._missed[name] = now
        return _leading(present)

    def note(self, adapter: L2Adapter, names, present: bool, written: bool = False) -> None:
        """Record that I/O found ``names`` (``present``) or not in ``adapter`` (for adapters indexed here);
        ``written``: this server wrote them, which lifts a refusal."""
        for i, a in enumerate(self.adapters):
            if a is not adapter:
                continue
            with self._lock:
                if written and i in self._refused:
                    self._refused[i].difference_update(names)
                if i in self._own:
                    if present:
                        self._own[i].update(names)
                    else:
                        self._own[i].difference_update(names)

    def refuse(self, adapter: L2Adapter, names) -> None:
        """``names`` are in ``adapter`` but not servable by this server: never count them as held."""
        for i, a in enumerate(self.adapters):
            if a is adapter:
                with self._lock:
                    refused = self._refused.setdefault(i, set())
                    if len(refused) >= MAX_REFUSED:
                        refused.clear()
                    refused.update(names)

    def _unrefused(self, adapter: L2Adapter, names: list[str], hits) -> list[bool]:
        for i, a in enumerate(self.adapters):
            if a is adapter and self._refused.get(i):
                with self._lock:
                    refused = self._refused[i]
                    return [bool(hit) and name not in refused for name, hit in zip(names, hits)]
        return [bool(hit) for hit in hits]

    def forget(self, adapter: L2Adapter) -> None:
        """``adapter`` was cleared."""
        for i, a in enumerate(self.adapters):
            if a is adapter and i in self._own:
                with self._lock:
                    self._own[i].clear()

    def close(self) -> None:
        """Stop the prober once the probes already queued are done."""
        self._probes.put(None)

    def _indexed(self, i: int, adapter: L2Adapter, names: list[str]) -> list[bool]:
        own = self._own.get(i)
        if own is not None:
            with self._lock:
                hits = [name in own for name in names]
        else:
            try:
                hits = adapter.indexed(names)
            except Exception as exc:  # noqa: BLE001 -- a miss plus a metric, like any adapter failure
                self.metrics.inc("kvtier_l2_errors_total", adapter=adapter.label, op="indexed")
                log.warning("L2 adapter %s indexed failed: %s", adapter.label, exc)
                return [False] * len(names)
        return self._unrefused(adapter, names, hits)

    def _probe(self, names: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            names = [n for n in names if n not in self._probing and now - self._missed.get(n, -1e9) > FRESH_MISS_SECONDS]
            if not names:
                return
            if self._probes.qsize() >= MAX_PROBES:
                self.metrics.inc("kvtier_l2_probes_skipped_total")
                return
            self._probing.update(names)
        self._probes.put(names)

    def _prober(self) -> None:
        while True:
            names = self._probes.get()
            if names is None:
                return
            try:
                self.probe_now(names)
            except Exception:  # noqa: BLE001 -- a probe is a hint; the prober must live on
                log.exception("L2 probe failed")
            finally:
                with self._lock:
                    self._probing.difference_update(names)

    def _fill_own(self) -> None:
        for i in list(self._own):
            adapter = self.adapters[i]
            try:
                names = adapter.list_names()
            except Exception as exc:  # noqa: BLE001 -- the index fills from writes and probes instead
                self.metrics.inc("kvtier_l2_errors_total", adapter=adapter.label, op="list_names")
                log.warning("L2 adapter %s list_names failed: %s", adapter.label, exc)
                continue
            with self._lock:
                self._own[i].update(names)


def _leading(flags: list[bool]) -> int:
    count = 0
    while count < len(flags) and flags[count]:
        count += 1
    return count
