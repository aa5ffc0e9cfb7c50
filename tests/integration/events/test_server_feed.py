"""The connector's server-event feed against a real ``kvtier server`` (no vLLM, seconds).

The feed turns what the server holds into one engine's KV events (``kvtier.connectors.server_feed``): a feed
started after the server replays what it already holds, copies of the same blocks are announced once, the
engine's ``AllBlocksCleared`` is answered by a re-announcement, and a server that is down at start, cleared or
restarted is followed (removals for what it lost, never stale credit).
"""

from __future__ import annotations

import time

import numpy as np
from support.server import LAYOUT, ServerProc, free_port, wait_for

from kvtier.auth.secret_file import secret_file_for
from kvtier.client import Client
from kvtier.config import KVEventsConfig
from kvtier.connectors.server_feed import ServerFeed
from kvtier.events import AllBlocksCleared, BlockRemoved, BlockStored, EventPublisher

BLOCK = 8  # the engine's block size here: two blocks per 16-token chunk
TOKEN = "feed-admin-token"


def start_server(tmp_path, port=None, events=None):
    events = events or (free_port(), free_port())
    server = ServerProc(tmp_path, port=port, token=TOKEN, extra=(
        "--enable-kv-events", "--kv-events-endpoint", f"tcp://127.0.0.1:{events[0]}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{events[1]}", "--block-size", str(BLOCK)))
    return server, events


def open_feed(server_port, events, **kw) -> ServerFeed:
    secret, _ = secret_file_for(f"tcp://127.0.0.1:{server_port}")
    return ServerFeed(f"tcp://127.0.0.1:{events[0]}", f"tcp://127.0.0.1:{events[1]}", BLOCK,
                      secret_file=str(secret), **kw)


def store(url, tokens, namespace=""):
    with Client(url, model="m", layout=LAYOUT, namespace=namespace) as client:
        kv = np.random.default_rng(len(tokens)).random((2, 2, len(tokens), 1, 8), dtype=np.float32)
        assert client.store(tokens, kv) >= 1  # chunks newly stored (the held ones are skipped)


class Collector:
    """Everything a feed handed to its engine so far."""

    def __init__(self, feed: ServerFeed):
        self.feed, self.events = feed, []

    def until(self, pred, what: str):
        def check():
            self.events += self.feed.take_events()
            return pred(self.events)
        wait_for(check, 20, what)

    def blocks(self, kind, medium="CPU") -> list:
        return [h for e in self.events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


def test_late_feeds_replay_what_the_server_holds_and_announce_each_block_once(tmp_path):
    prompt = list(range(1000, 1032))  # two chunks, four blocks
    server, events = start_server(tmp_path)
    feeds = []
    try:
        store(server.url, prompt)  # before any feed exists
        feeds = [open_feed(server.port, events), open_feed(server.port, events)]  # two workers sharing a server
        seen = [Collector(f) for f in feeds]
        for c in seen:
            c.until(lambda ev: len(c.blocks(BlockStored)) == 4, "the replayed store")
        stored = [e for e in seen[0].events if isinstance(e, BlockStored)]
        assert [t for e in stored for t in e.token_ids] == prompt and all(e.block_size == BLOCK for e in stored)
        assert all(isinstance(h, int) for h in seen[0].blocks(BlockStored))
        store(server.url, prompt, namespace="tenant-b")  # another copy of the same blocks
        store(server.url, prompt + list(range(5000, 5016)))  # one new chunk after the held prefix
        for c in seen:
            c.until(lambda ev: len(c.blocks(BlockStored)) == 6, "the new chunk's blocks")
        assert sorted(seen[0].blocks(BlockStored)) == sorted(set(seen[0].blocks(BlockStored)))  # no duplicates
        last = [e for e in seen[0].events if isinstance(e, BlockStored)][-1]
        assert last.token_ids == list(range(5000, 5016)) and last.parent_block_hash == seen[0].blocks(BlockStored)[3]
        # the server drops its L1: every CPU block is removed once, whatever the number of copies
        reply = server_clear(server)
        assert reply["num_l1_chunks"] == 5, reply  # 3 chunks + 2 in tenant-b
        seen[0].until(lambda ev: len(seen[0].blocks(BlockRemoved)) == 6, "the removals after POST /clear")
        assert sorted(seen[0].blocks(BlockRemoved)) == sorted(seen[0].blocks(BlockStored))
        assert feeds[0].num_blocks("CPU") == 0
    finally:
        for f in feeds:
            f.close()
        server.stop()


def server_clear(server) -> dict:
    import httpx

    reply = httpx.post(f"{server.admin}/clear", json={"medium": "CPU"},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_engines_clear_is_answered_by_a_reannouncement(tmp_path):
    prompt = list(range(2000, 2016))
    server, events = start_server(tmp_path)
    engine = EventPublisher(KVEventsConfig(endpoint=f"ipc://{tmp_path}/engine", batch_max_delay_seconds=0))
    feed = None
    try:
        feed = open_feed(server.port, events, engine_endpoint=engine.endpoint)
        c = Collector(feed)
        store(server.url, prompt)
        c.until(lambda ev: len(c.blocks(BlockStored)) == 2, "the store")
        first = list(c.events)
        # vLLM's reset_prefix_cache without a connector reset: the feed sees the clear on the engine's stream
        wait_for(lambda: engine.publish([BlockRemoved([1], "GPU")]) and feed.stats["engine_batches"], 20,
                 "the watcher to join the engine's stream")
        engine.publish([AllBlocksCleared()])
        c.until(lambda ev: len(c.blocks(BlockStored)) >= 4, "the re-announcement")
        assert c.events[len(first):] == [e for e in first if isinstance(e, BlockStored)]
        # with a connector reset, reset_cache() re-announces in the same batch and the clear is not answered twice
        clears = feed.stats["engine_clears"]
        feed.reannounce()
        announced = feed.stats["reannounced"]
        engine.publish([AllBlocksCleared()])
        wait_for(lambda: feed.stats["engine_clears"] > clears, 20, "the second clear")
        assert feed.stats["reannounced"] == announced
    finally:
        if feed is not None:
            feed.close()
        engine.close()
        server.stop()


def test_a_server_down_at_start_is_caught_up_and_a_restart_removes_what_it_lost(tmp_path):
    port, events = free_port(), (free_port(), free_port())
    feed = open_feed(port, events, replay_timeout_seconds=0.5)  # no server yet
    server = None
    try:
        server, _ = start_server(tmp_path, port=port, events=events)
        c = Collector(feed)
        for i in range(8):  # separate batches: the old server's sequence goes well past the new one's start
            store(server.url, list(range(3000 + 16 * i, 3016 + 16 * i)))
            c.until(lambda ev, i=i: len(c.blocks(BlockStored)) == 2 * (i + 1), "the stores after the server came up")
        old = c.blocks(BlockStored)
        assert server.stop() == 0
        server, _ = start_server(tmp_path, port=port, events=events)  # a new server: its L1 starts empty
        # the feed learns of the restart from the new server's next batch (its sequence starts again at 0)
        n = iter(range(4000, 10**6, 16))
        wait_for(lambda: store(server.url, list(range(next(n), next(n) + 16))) or feed.stats["restarts"], 30,
                 "the restart to be seen")
        c.until(lambda ev: len(c.blocks(BlockRemoved)) == 16, "the removals of what the restart lost")
        assert sorted(c.blocks(BlockRemoved)) == sorted(old) and feed.stats["restarts"] == 1
        assert not set(old) & set(feed.mirror.blocks["CPU"]) and feed.num_blocks("CPU") >= 2
    finally:
        feed.close()
        if server is not None:
            server.stop()



def test_an_idle_engine_has_the_servers_changes_published_for_it(tmp_path):
    server, events = start_server(tmp_path)
    published: list = []
    feed = open_feed(server.port, events, publish=lambda evs: published.append(evs) or True, idle_publish_seconds=0.2)
    try:
        assert feed.take_events() == []  # the engine's first step: from now on its stream has listeners
        store(server.url, list(range(6000, 6016)))
        # nobody calls take_events() (an idle engine): the feed publishes the store itself
        wait_for(lambda: published, 20, "the idle publish")
        assert [h for batch in published for e in batch for h in e.block_hashes] == list(feed.mirror.blocks["CPU"])
        assert feed.take_events() == [] and feed.stats["idle_publishes"] == 1
    finally:
        feed.close()
        server.stop()


def view_after(batches) -> dict[int, int]:
    """A router's view (block hash -> times it is counted) after applying ``batches`` in order from empty."""
    held: dict[int, int] = {}
    for batch in batches:
        for ev in batch:
            for h in ev.block_hashes:
                if isinstance(ev, BlockStored):
                    held[h] = held.get(h, 0) + 1
                elif h in held:
                    held[h] -= 1
                    if not held[h]:
                        del held[h]
    return held


def test_before_the_engines_first_step_the_router_is_resynced_from_when_the_publisher_exists(tmp_path):
    server, events = start_server(tmp_path)
    store(server.url, list(range(9000, 9016)))  # the state a new worker learns by replay at start-up
    published: list = []
    feed = open_feed(server.port, events, publish=lambda evs: published.append(evs) or True, idle_publish_seconds=0.1)
    try:
        wait_for(lambda: feed.num_blocks("CPU") == 2, 20, "the replay")
        held = list(feed.mirror.blocks["CPU"])
        time.sleep(0.5)  # several idle periods
        assert published == []  # no publisher yet (vLLM builds it after the connector): nothing is published
        feed.engine_started()
        wait_for(lambda: len(published) >= 2, 20, "the first two resyncs")  # at once, then after 0.5 s
        # each resync removes, then stores, every held block: a subscriber that joined before any of them, between
        # them, or after the first sees each block once
        for start in range(len(published)):
            assert view_after(published[start:]) == {h: 1 for h in held}
        assert all(isinstance(e, (BlockRemoved, BlockStored)) for batch in published for e in batch)
        store(server.url, list(range(9100, 9116)))  # a change between resyncs: published as it happens
        wait_for(lambda: feed.num_blocks("CPU") == 4, 20, "the second store")
        wait_for(lambda: view_after(published) == {h: 1 for h in feed.mirror.blocks["CPU"]}, 20, "the change's publish")
        # the engine's first step: one more resync in its own batch, then the resyncs stop
        first = feed.take_events()
        assert view_after([first]) == {h: 1 for h in feed.mirror.blocks["CPU"]}
        count = len(published)
        time.sleep(1.5)  # longer than the next gaps (1 s, 2 s from the start): no resync after the first step
        assert len(published) == count and feed.stats["resyncs"] == count - feed.stats["idle_publishes"] + 1
    finally:
        feed.close()
        server.stop()


def test_a_reannouncement_waits_for_the_engines_clear_before_an_idle_publish(tmp_path):
    server, events = start_server(tmp_path)
    engine = EventPublisher(KVEventsConfig(endpoint=f"ipc://{tmp_path}/engine", batch_max_delay_seconds=0))
    published: list = []
    feed = open_feed(server.port, events, engine_endpoint=engine.endpoint, idle_publish_seconds=0.2,
                     publish=lambda evs: published.append(evs) or True)
    try:
        assert feed.take_events() == []  # the engine's first step
        store(server.url, list(range(7000, 7016)))
        wait_for(lambda: published, 20, "the store's idle publish")
        wait_for(lambda: engine.publish([BlockRemoved([1], "GPU")]) and feed.stats["engine_batches"], 20,
                 "the watcher to join the engine's stream")
        feed.reannounce()  # vLLM's reset_cache(): the engine's AllBlocksCleared is still to come
        time.sleep(0.5)  # longer than idle_publish_seconds: an idle publish now would land before the clear
        assert len(published) == 1
        engine.publish([AllBlocksCleared()])
        wait_for(lambda: len(published) == 2, 20, "the re-announcement after the clear")
        assert [e.block_hashes for e in published[1]] == [e.block_hashes for e in published[0]]
    finally:
        feed.close()
        engine.close()
        server.stop()


def test_the_engines_publisher_is_found_through_the_scheduler_that_owns_the_connector():
    from kvtier.connectors.engine_publish import _scheduler_publisher

    class Connector:
        pass

    class Scheduler:  # the two attributes vLLM's Scheduler has
        def __init__(self, connector, publisher):
            self.connector, self.kv_event_publisher = connector, publisher

    connector, other = Connector(), Connector()
    with EventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0")) as publisher:
        keep = Scheduler(connector, publisher)
        assert _scheduler_publisher(connector) is publisher
        assert _scheduler_publisher(other) is None
        del keep


def test_open_feed_follows_the_engines_kv_events_config(tmp_path):
    from types import SimpleNamespace

    from kvtier.connectors.server_feed import open_feed as connector_feed

    def engine(enabled, endpoint="tcp://*:5557"):  # the fields of vLLM's KVEventsConfig the feed reads
        return SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=enabled, publisher="zmq",
                                                                endpoint=endpoint))

    events = f"tcp://127.0.0.1:{free_port()}"
    assert connector_feed(engine(True), BLOCK, endpoint=None) is None  # no kvtier.server_events: no feed
    assert connector_feed(engine(False), BLOCK, endpoint=events) is None  # the engine publishes nothing
    feed = connector_feed(engine(True, f"ipc://{tmp_path}/engine"), BLOCK, endpoint=events,
                          server_url="tcp://127.0.0.1:1")
    try:
        assert feed is not None and feed._engine is not None and feed.mirror.block_size == BLOCK
    finally:
        feed.close()
