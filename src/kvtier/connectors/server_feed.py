"""What a shared ``kvtier server`` holds, as KV events of one engine: the connector's server-event feed.

A router such as NVIDIA Dynamo's takes exactly one KV event source per worker (the engine's own ZMQ stream;
a second source for the same worker makes it ignore that worker), so a worker attached to a kvtier server
must announce the server's chunks *inside its own stream*. ``ServerFeed`` subscribes to the server's event
publisher (``kvtier.events.Subscriber``: replay of what was published before it started, gap recovery,
restart detection) and keeps a mirror of the blocks the server holds per medium (``CPU`` = L1, ``STORAGE``
= L2). The connector drains ``take_events()`` from vLLM's scheduler (``KVConnectorBase_V1.take_events``), so
the events leave in the engine's own batches with the engine's block size and integer hashes; the server
hashes with the engine's settings (the connector's handshake checks that), so the hashes need no change.

Rules of the feed (why; the mirror's own forwarding rules are in ``kvtier.connectors.block_mirror``):

- The engine's ``AllBlocksCleared`` (``reset_prefix_cache``) wipes *every* tier of the worker in the router,
  but kvtier keeps its data: ``reannounce()`` queues a ``BlockStored`` for every mirrored block. The
  connector calls it from ``reset_cache()`` (the events then leave in the same batch, after the clear);
  without a connector reset, a watcher on the engine's own stream sees the clear and re-announces.
- A server restart is recognised when its sequence numbers start again below the last one seen (the
  subscriber's rule); the old server's blocks are then removed.
- A feed started after the server replays the server's buffer from seq 0 (``kv_events.buffer_steps``
  batches), so a new worker announces what the server already holds; a server that is down at start is
  caught up from seq 0 when it answers.

The mirror: ``kvtier.connectors.block_mirror``; publishing through the engine's own
publisher: ``kvtier.connectors.engine_publish``.

Timing: vLLM publishes connector events only when a step produces output (``Scheduler.update_from_output``),
so an idle engine would hold them until its next request. With ``publish`` (``EnginePublish``: the engine's own
publisher, found in the scheduler that owns the connector once it is built) events the engine has not taken
within ``idle_publish_seconds`` are published directly in the same stream, except while a ``reannounce()`` waits
for the engine's ``AllBlocksCleared`` (it must follow the clear).

A new worker's router must know the server's chunks before the worker's first request, but a ZMQ PUB drops
what it publishes before a subscriber joins, and ``dynamo.vllm`` subscribes to the engine's stream only after
the engine started (no replay). So from the moment the engine's publisher exists (``engine_started()``) until
the engine's first step, the feed *resyncs* the router with backoff (at once, then after 0.5 s, 1 s, 2 s, ...
up to ``MAX_RESYNC_SECONDS``): one batch holding ``BlockRemoved`` for every mirrored block, then ``BlockStored``
for each. A router that saw an earlier resync ends with the same view (each block removed, then stored once), one
that joined late gets the whole view, and neither counts a block twice. The engine's first ``take_events()`` is
one more resync, so the state is complete by the first step whenever the subscriber joined. Resyncs are not
``AllBlocksCleared``: that would wipe the worker's GPU tier, and the watcher would take it for the engine's.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time

from kvtier.auth.secret_file import secret_file_for
from kvtier.connectors.block_mirror import BlockMirror
from kvtier.events.model import AllBlocksCleared, Event
from kvtier.events.subscriber import Subscriber

log = logging.getLogger("vllm.kvtier_connector")
FIRST_RESYNC_GAP_SECONDS = 0.5  # before the engine's first step: the second resync, then doubling ...
MAX_RESYNC_SECONDS = 30.0  # ... up to this gap between resyncs
_WILDCARD = re.compile(r"^tcp://(\*|0\.0\.0\.0|\[::\]|::):")


def engine_subscribe_endpoint(endpoint: str | None) -> str | None:
    """Where to subscribe to an engine publisher that binds ``endpoint`` (vLLM's rule); None if it cannot be."""
    if not endpoint or endpoint.startswith("inproc://"):
        return None
    if endpoint.startswith("ipc://"):
        return endpoint
    if _WILDCARD.match(endpoint):
        return _WILDCARD.sub("tcp://127.0.0.1:", endpoint)
    return endpoint if endpoint.startswith("tcp://127.0.0.1:") else None


class ServerFeed:
    """A thread mirroring a kvtier server's events for one engine (see the module docstring).

    Args:
        endpoint: the server's KV event PUB address (``--kv-events-endpoint``).
        replay_endpoint: its replay ROUTER (``--kv-events-replay-endpoint``); None: live events only (a worker
            started after the server then misses what the server already held).
        block_size: the engine's block size, in tokens.
        engine_endpoint: the engine's own KV event PUB address to watch for its ``AllBlocksCleared``; None
            re-announces only on ``reannounce()``.
        secret_file: the server's secret file, for a replay port that requires authentication; read once it
            exists (a server started after the feed creates it).
        replay_timeout_seconds: longest wait for one replay answer.
        publish: ``publish(events) -> bool`` publishes events the engine has not taken within ``idle_publish_seconds``
            (False: it cannot, the events stay queued for the engine); None: only the engine publishes.

    ``take_events()`` is called from vLLM's scheduler thread; ``close()`` stops the thread.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, block_size: int, *,
                 engine_endpoint: str | None = None, secret_file: str | None = None,
                 replay_timeout_seconds: float = 2.0, publish=None, idle_publish_seconds: float = 0.5) -> None:
        self.mirror = BlockMirror(block_size)
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        self._pending_since = 0.0  # monotonic time the oldest queued event was queued
        self._publish, self._idle_publish_seconds = publish, idle_publish_seconds
        self._engine_took = False  # the engine drained take_events() at least once (its stream has listeners)
        self._engine_up = False  # the engine's publisher exists (engine_started): resync until its first step
        self._resynced = False  # a resync was published before the engine's first step
        self._next_resync, self._resync_gap = 0.0, FIRST_RESYNC_GAP_SECONDS
        self._expect_engine_clear = 0  # clears already answered by reannounce(); the watcher skips them
        self._stop = threading.Event()
        self.stats = {"server_batches": 0, "restarts": 0, "reannounced": 0, "engine_batches": 0, "engine_clears": 0,
                      "idle_publishes": 0, "resyncs": 0}
        self._secret_file = secret_file if secret_file and not os.path.exists(secret_file) else None
        self._sub = Subscriber(endpoint, replay_endpoint, start_seq=0 if replay_endpoint else None,
                               replay_timeout_seconds=replay_timeout_seconds,
                               secret_file=secret_file if secret_file and self._secret_file is None else None)
        self._engine = Subscriber(engine_endpoint) if engine_endpoint else None
        self._thread = threading.Thread(target=self._run, name="kvtier-server-feed", daemon=True)
        self._thread.start()
        log.info("kvtier: forwarding the server's KV events from %s (replay %s) in this engine's stream%s",
                 endpoint, replay_endpoint or "off",
                 f"; watching {engine_endpoint} for the engine's AllBlocksCleared" if engine_endpoint else "")

    def _run(self) -> None:
        restarts = 0
        while not self._stop.is_set():
            try:
                if self._secret_file is not None and os.path.exists(self._secret_file):
                    path, self._secret_file = self._secret_file, None  # tried once: a bad file is one error
                    self._sub.use_secret_file(path)
                got = self._sub.recv(timeout_seconds=0.1)
                if got is not None:
                    with self._lock:
                        if self._sub.stats.restarts != restarts:  # a new server: the old one's blocks are gone
                            restarts = self._sub.stats.restarts
                            self.stats["restarts"] += 1
                            self._queue(self.mirror.forget())
                        self.stats["server_batches"] += 1
                        self._queue(self.mirror.apply(got[1].events))
                while self._engine is not None and (batch := self._engine.recv(timeout_seconds=0)) is not None:
                    self.stats["engine_batches"] += 1
                    if any(isinstance(ev, AllBlocksCleared) for ev in batch[1].events):
                        self._on_engine_clear()
                self._idle_publish()
            except Exception:  # noqa: BLE001 - the feed must never take the engine down
                if self._stop.is_set():
                    return
                log.exception("kvtier: server event feed error; continuing")
                self._stop.wait(1.0)  # a persistent fault logs once a second, not in a tight loop

    def _on_engine_clear(self) -> None:
        with self._lock:
            self.stats["engine_clears"] += 1
            if self._expect_engine_clear:
                self._expect_engine_clear -= 1
                return
            self._announce()

    def _queue(self, events: list[Event]) -> None:  # with self._lock held
        if events and not self._pending:
            self._pending_since = time.monotonic()
        self._pending += events

    def _idle_publish(self) -> None:
        if self._publish is None:
            return
        with self._lock:
            if self._expect_engine_clear:
                return
            now = time.monotonic()
            idle = bool(self._pending) and now - self._pending_since >= self._idle_publish_seconds
            if not self._engine_took and self._engine_up and now >= self._next_resync:
                events, resync = self._resync(), True
                self._next_resync = now + self._resync_gap
                self._resync_gap = min(2 * self._resync_gap, MAX_RESYNC_SECONDS)
            elif idle and (self._engine_took or self._resynced):
                events, resync = self._pending, False
                self._pending = []
            else:  # before the first resync, nobody has the state the pending events change
                return
            if self._publish(events):
                if resync:
                    self._resynced = True
                else:
                    self.stats["idle_publishes"] += 1
            else:  # the engine publishes them at its next step
                self._pending, self._publish = events, None

    def _resync(self) -> list[Event]:  # with self._lock held
        events, self._pending = self._pending + self.mirror.resync(), []
        self.stats["resyncs"] += 1
        return events

    def engine_started(self) -> None:
        """The engine's publisher exists (``publish`` can reach it): resync the router until the first step."""
        with self._lock:
            self._engine_up = True

    def _announce(self) -> None:  # with self._lock held
        events = self.mirror.announce()
        self.stats["reannounced"] += sum(len(e.block_hashes) for e in events)
        self._queue(events)

    def reannounce(self, *, engine_clears: bool = True) -> None:
        """Queue a ``BlockStored`` for everything the server holds (the engine is clearing its prefix cache).

        ``engine_clears``: the engine publishes an ``AllBlocksCleared`` before these events (vLLM's
        ``reset_prefix_cache`` with a connector reset), so the watcher must not answer that clear again.
        """
        with self._lock:
            if engine_clears and self._engine is not None:
                self._expect_engine_clear += 1
            self._announce()

    def take_events(self) -> list[Event]:
        """Drain the events queued for the engine's stream (``kvtier.events.model`` types)."""
        with self._lock:
            if not self._engine_took and self._resynced:  # complete whenever the engine's subscriber joined
                out = self._resync()
            else:
                out, self._pending = self._pending, []
            self._engine_took = True
        return out

    def num_blocks(self, medium: str) -> int:
        with self._lock:
            return self.mirror.num_blocks(medium)

    def close(self) -> None:
        """Stop the thread and close the sockets. Idempotent."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close()
        if self._engine is not None:
            self._engine.close()


def open_feed(vllm_config, block_size: int, *, endpoint: str | None, replay_endpoint: str | None = None,
              server_url: str = "", secret_file: str | None = None, publish=None) -> ServerFeed | None:
    """The scheduler-side feed of a connector configured with ``kvtier.server_events`` (``endpoint``; None: no feed).

    ``vllm_config``: the engine's config (its ``kv_events_config`` names the stream to watch for the engine's own
    clears); ``replay_endpoint``: ``kvtier.server_events_replay``; ``server_url`` / ``secret_file``: the
    connector's server and ``kvtier.auth_secret_file`` (the replay port wants the server's secret);
    ``publish``: see ``ServerFeed``.
    """
    if not endpoint:
        return None
    kv_events = getattr(vllm_config, "kv_events_config", None)
    if kv_events is None or not kv_events.enable_kv_cache_events:
        log.warning("kvtier.server_events is set but the engine publishes no KV events (--kv-events-config "
                    "enable_kv_cache_events); the server's chunks are not announced")
        return None
    engine = engine_subscribe_endpoint(kv_events.endpoint if kv_events.publisher == "zmq" else None)
    # the replay port of a server with authentication wants the same secret as its requests port
    secret, _ = secret_file_for(server_url or "", secret_file)
    return ServerFeed(endpoint, replay_endpoint, block_size, engine_endpoint=engine,
                      secret_file=str(secret) if secret is not None else None, publish=publish)
