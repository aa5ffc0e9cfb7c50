"""Publishing kvtier's events through the vLLM engine's own KV event publisher (``EnginePublish``), for the
server-event feed (``kvtier.connectors.server_feed``) when the engine is idle: vLLM publishes connector events only
when a step produces output.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("vllm.kvtier_connector")


def _scheduler_publisher(connector):
    """The KV event publisher of the vLLM scheduler that owns ``connector`` (its ``kv_event_publisher``), or None.

    vLLM (0.31, 0.32) hands a connector no reference to its scheduler or publisher, and has no hook for either;
    the scheduler is the object whose ``connector`` attribute is this connector (found through the garbage
    collector's referrers). ``tests/integration/vllm/test_vllm_feed.py`` fails if an installed vLLM breaks this.
    """
    for ref in gc.get_referrers(connector):
        owners = [ref] if not isinstance(ref, dict) else [o for o in gc.get_referrers(ref)
                                                            if getattr(o, "__dict__", None) is ref]
        for owner in owners:
            if getattr(owner, "connector", None) is connector:
                publisher = getattr(owner, "kv_event_publisher", None)
                if callable(getattr(publisher, "publish", None)):
                    return publisher
    return None


class EnginePublish:
    """A ``ServerFeed`` ``publish``: publish through the engine's own publisher (``convert``: kvtier events to vLLM's).

    ``bind()`` finds the publisher; the connector calls it from ``bind_kv_cache_manager``, which vLLM calls once
    the scheduler has built its publisher. Unbound, the first call binds. Without a publisher every call returns
    False: the events stay for the engine's next step (logged once, as a warning).
    """

    def __init__(self, connector, convert):
        self.connector, self.convert = connector, convert
        self.publisher = None
        self.bound = False

    def bind(self) -> bool:
        """Find the engine's publisher (once); True when found."""
        if not self.bound:
            self.bound = True
            self.publisher = _scheduler_publisher(self.connector)
            if self.publisher is None:
                log.warning("kvtier: vLLM's KV event publisher was not found in the scheduler that owns this "
                            "connector (Scheduler.kv_event_publisher); the server's chunks are announced only "
                            "with the engine's steps, so a new or idle worker's view in the router lags")
        return self.publisher is not None

    def __call__(self, events) -> bool:
        if not self.bind():
            return False
        from vllm.distributed.kv_events import KVEventBatch

        self.publisher.publish(KVEventBatch(ts=time.time(), events=self.convert(events)))
        return True
