"""Lookups over an L2 that other servers write to: the server probes it before answering, off the request thread.

The request thread answers a ``Lookup`` from L1 and the L2 adapters' in-memory indexes, never from L2 I/O
(a slow adapter must not stall every client). An index can lag behind a shared store: a record that another
kvtier server wrote into the same Redis, bucket or container is unknown here until I/O finds it, so the first
lookup of a prompt stored through another node would miss and only a later one (after the background probe,
``l2.index``) would hit: a router and an engine would recompute a prompt the fleet holds. So a lookup is
*deferred* when all of these hold (``answer`` resolves the prompt and asks L1 and the indexes once, then either
answers or starts the probe):

- some adapter's index may lag (``L2Adapter.index_may_lag``: Redis, S3, Azure Blob; not local_disk or memory,
  whose writes this process sees);
- ``server.lookup_probe_timeout_seconds`` > 0;
- L1 plus the indexes answer short of the prompt's last chunk.

Then a job on the promotion pool (``server.promote``) asks the adapters about the next chunks (``L2Tier.probe``,
at most ``PROBE_NAMES``; what they find joins their indexes) and the request thread answers from L1 and the
indexes when the job is done or its deadline passes, whichever comes first. The answer is computed, and its
lookup metrics counted, once: at reply time (``reply``).

Faults: a probe past its deadline gets the indexes' answer and counts ``kvtier_lookup_probe_timeouts_total``;
while such a probe is still stuck in an adapter, later lookups are answered at once and counted in
``kvtier_lookup_probes_skipped_total{reason="stuck"}`` (a hung L2 costs one lookup the deadline, not every
lookup); a pool with ``max_promotions`` jobs gives ``reason="pool_full"``. Adapter errors are misses plus
``kvtier_l2_errors_total``.

Thread-safety: every method runs on the request thread (under the server's lock); the probe runs on a worker.
"""

from __future__ import annotations

import logging
import time

from kvtier import protocol as P
from kvtier.cache import Tiers
from kvtier.l2.index import PROBE_NAMES
from kvtier.metrics import Metrics
from kvtier.server.promote import Job, Promoter

log = logging.getLogger(__name__)


class LookupProber:
    """Defers lookups that a lagging L2 index may answer short (see the module docstring).

    Args:
        tiers: the server's tiers (L2 indexes and probes).
        promoter: the promotion pool the probes run on.
        timeout_seconds: ``server.lookup_probe_timeout_seconds``; 0 disables the probes.
        metrics: where probes, timeouts and skips are counted.
    """

    def __init__(self, tiers: Tiers, promoter: Promoter, timeout_seconds: float, metrics: Metrics):
        self.l2 = tiers.l2
        self.promoter = promoter
        self.timeout_seconds = timeout_seconds
        self.metrics = metrics
        self.enabled = timeout_seconds > 0 and self.l2.index_may_lag
        self._stuck: list[Job] = []  # probes answered by their deadline whose worker has not returned yet

    def answer(self, identity: bytes, session, msg: P.Lookup) -> P.LookupReply | None:
        """The reply to ``msg`` now, or None when a probe was started (then ``reply`` answers it later). The prompt
        is resolved once (``chunk_refs``, memoised), L1 and the indexes are asked once; the answer is counted in
        the lookup metrics. Without probes, a prompt not in the memo is first asked about by its first chunk
        alone (``head_refs``): when no tier holds it, the answer is 0 and the rest of the prompt is never hashed
        (a new prompt's lookup costs one chunk's hashing, not the whole prompt's). Raises InputError on bad
        input."""
        cache = session.cache
        hits = None
        if not self.enabled and msg.start < cache.chunk_size:  # a new prompt: its first chunk is asked about first
            arr, refs, whole = session.head_refs(msg)
            hits = cache.tier_hits(refs, msg.start)  # validates start
            if hits.num_tokens and not whole:  # held: every chunk is needed
                hits = None
        if hits is None:
            arr, refs = session.chunk_refs(msg)
            hits = cache.tier_hits(refs, msg.start, probe=not self.enabled)  # validates start
        rest = [r.key for r in refs[msg.start // cache.chunk_size:] if r.end > hits.num_tokens] if self.enabled else ()
        if rest:  # not held, over an L2 whose index may lag
            if self._probe(identity, session, msg, rest[:PROBE_NAMES]):
                return None
            hits = cache.tier_hits(refs, msg.start)  # the probe skipped: the index's own background probe then
        cache.count_lookup(len(arr), refs, msg.start, hits)
        return P.LookupReply(id=msg.id, num_tokens=hits.num_tokens, num_l1_tokens=hits.num_l1_tokens)

    def _probe(self, identity: bytes, session, msg: P.Lookup, keys: list) -> bool:
        """Ask the adapters about ``keys`` on the pool; False when a stuck probe or a full pool skips it."""
        self._stuck = [job for job in self._stuck if not job.finished]
        if self._stuck:
            self.metrics.inc("kvtier_lookup_probes_skipped_total", reason="stuck")
            return False
        now = time.monotonic()
        job = Job(identity, msg, session, now, now + self.timeout_seconds)
        if not self.promoter.submit(job, lambda: self.l2.probe(keys)):
            self.metrics.inc("kvtier_lookup_probes_skipped_total", reason="pool_full")
            return False
        self.metrics.inc("kvtier_lookup_probes_total")
        return True

    def reply(self, identity: bytes, session, msg: P.Lookup, started: float = 0.0) -> tuple[P.LookupReply, list]:
        """The answer from L1 and the indexes after a probe (counted in the lookup metrics); the promotion pool's
        reply signature (``identity`` and ``started`` unused)."""
        hits = session.cache.lookup_tiers(*session.prompt(msg), extra_keys=msg.extra_keys, start=msg.start)
        return P.LookupReply(id=msg.id, num_tokens=hits.num_tokens, num_l1_tokens=hits.num_l1_tokens), []

    def timed_out(self, job: Job) -> None:
        """``job``'s deadline passed before its probe returned: count it; remember it while its worker is busy."""
        self.metrics.inc("kvtier_lookup_probe_timeouts_total")
        if not job.finished:
            if not self._stuck:  # once per episode, not once per lookup
                log.warning("L2 probe for a lookup not done after %.3f s: answered from the indexes; lookups "
                            "skip the probe until it returns", self.timeout_seconds)
            self._stuck.append(job)
