"""LookupRequests: the server's part for ``Lookup`` requests (its handler, ``on_lookup``, is in the server's table).

The answer is ``KVCache``'s lookup policy (``cache/lookups.py``: the prompt's known chunks first, the rest hashed
only when every known chunk is held), computed on the request thread from L1 and the L2 adapters' in-memory
indexes, never from L2 I/O (a slow adapter must not stall every client). Two things defer a reply:

*Long prompts.* When the known chunks are all held and the rest of the prompt has at least
``server.hash_offload_min_tokens`` tokens to hash, the request is handed to the hashing worker
(``server/prehash.py``), as a long store or retrieve is before dispatch, and answered when its refs are memoised.

*An L2 that other servers write to.* An index can lag behind a shared store: a record that another kvtier server
wrote into the same Redis, bucket or container is unknown here until I/O finds it, so the first lookup of a
prompt stored through another node would miss and only a later one (after the background probe, ``l2.index``)
would hit: a router and an engine would recompute a prompt the fleet holds. So a lookup is *deferred* when all
of these hold:

- some adapter's index may lag (``L2Adapter.index_may_lag``: Redis, S3, Azure Blob; not local_disk or memory,
  whose writes this process sees);
- ``server.lookup_probe_timeout_seconds`` > 0;
- L1 plus the indexes answer short of the prompt's last chunk.

Then a job on the server's job pool (``server/jobs.py``) asks the adapters about the next chunks (``L2Tier.probe``,
at most ``PROBE_NAMES``; what they find joins their indexes) and the request thread answers from L1 and the
indexes when the job is done or its deadline passes, whichever comes first. Every answer is computed, and its
lookup metrics counted, once: at reply time; and recorded in the trace.

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
from kvtier.server.jobs import Job, JobPool
from kvtier.server.replies import limited_reply

log = logging.getLogger(__name__)


class LookupRequests:
    """Answers ``Lookup`` requests, deferring those a long prompt or a lagging L2 index needs (module docstring).

    Args:
        tiers: the server's tiers (L2 indexes and probes).
        pool: the job pool the probes run on.
        prehash: the hashing worker (``Prehasher``) long prompts are handed to.
        timeout_seconds: ``server.lookup_probe_timeout_seconds``; 0 disables the probes.
        metrics: where probes, timeouts and skips are counted.
        trace: the server's ``TraceRecorder``: told every answered lookup.
    """

    def __init__(self, tiers: Tiers, pool: JobPool, prehash, timeout_seconds: float, metrics: Metrics, trace):
        self.l2 = tiers.l2
        self.pool, self.prehash, self.trace = pool, prehash, trace
        self.timeout_seconds = timeout_seconds
        self.metrics = metrics
        self.enabled = timeout_seconds > 0 and self.l2.index_may_lag
        self._stuck: list[Job] = []  # probes answered by their deadline whose worker has not returned yet

    def on_lookup(self, identity: bytes, session, msg: P.Lookup, payload) -> tuple[P.LookupReply | None, list]:
        """The handler of ``Lookup``: its reply now, or None (deferred: ``Prehasher``, ``reply`` after a probe).
        Raises InputError on bad input."""
        reply = self.answer(identity, session, msg)
        if reply is not None:
            self.trace.lookup(identity, session, msg, reply)
        return reply, []

    def answer(self, identity: bytes, session, msg: P.Lookup) -> P.LookupReply | P.Error | None:
        """The reply to ``msg`` now, or None when it was deferred (module docstring). The answer is ``KVCache``'s
        lookup policy; with probes it is computed over every chunk's refs, the ones not held probed. Counted in
        the lookup metrics once. Raises InputError on bad input."""
        cache = session.cache
        tokens, namespace = session.prompt(msg)
        found = cache.lookups.match(tokens, namespace, extra_keys=msg.extra_keys, start=msg.start,
                                    probe=not self.enabled, whole=self.enabled, count=False, extend=False)
        if found.partial:  # every known chunk is held: the rest of the prompt is needed
            parked = self.prehash.park(identity, session, msg)
            if parked is True:
                return None
            if parked:
                return limited_reply(self.metrics, msg, "hash_jobs", parked)
            found = cache.lookups.match(tokens, namespace, extra_keys=msg.extra_keys, start=msg.start, count=False)
        hits, refs = found.hits, found.refs
        rest = [r.key for r in refs[msg.start // cache.chunk_size:] if r.end > hits.num_tokens] if self.enabled else ()
        if rest:  # not held, over an L2 whose index may lag
            if self._probe(identity, session, msg, rest[:PROBE_NAMES]):
                return None
            hits = cache.lookups.tier_hits(refs, msg.start)  # the probe skipped: the index's own background probe then
        cache.lookups.count(len(found.tokens), refs, msg.start, hits)
        return P.LookupReply(id=msg.id, num_tokens=hits.num_tokens, num_l1_tokens=hits.num_l1_tokens)

    def _probe(self, identity: bytes, session, msg: P.Lookup, keys: list) -> bool:
        """Ask the adapters about ``keys`` on the pool; False when a stuck probe or a full pool skips it."""
        self._stuck = [job for job in self._stuck if not job.finished]
        if self._stuck:
            self.metrics.inc("kvtier_lookup_probes_skipped_total", reason="stuck")
            return False
        now = time.monotonic()
        job = Job(identity, msg, session, now, now + self.timeout_seconds)
        if not self.pool.submit(job, lambda: self.l2.probe(keys)):
            self.metrics.inc("kvtier_lookup_probes_skipped_total", reason="pool_full")
            return False
        self.metrics.inc("kvtier_lookup_probes_total")
        return True

    def reply(self, identity: bytes, session, msg: P.Lookup, started: float = 0.0) -> tuple[P.LookupReply, list]:
        """The answer from L1 and the indexes after a probe (counted in the lookup metrics, recorded in the trace);
        the promotion pool's reply signature (``started`` unused)."""
        hits = session.cache.lookup_tiers(*session.prompt(msg), extra_keys=msg.extra_keys, start=msg.start)
        reply = P.LookupReply(id=msg.id, num_tokens=hits.num_tokens, num_l1_tokens=hits.num_l1_tokens)
        self.trace.lookup(identity, session, msg, reply)
        return reply, []

    def timed_out(self, job: Job) -> None:
        """``job``'s deadline passed before its probe returned: count it; remember it while its worker is busy."""
        self.metrics.inc("kvtier_lookup_probe_timeouts_total")
        if not job.finished:
            if not self._stuck:  # once per episode, not once per lookup
                log.warning("L2 probe for a lookup not done after %.3f s: answered from the indexes; lookups "
                            "skip the probe until it returns", self.timeout_seconds)
            self._stuck.append(job)
