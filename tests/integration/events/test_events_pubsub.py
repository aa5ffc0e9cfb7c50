"""Publisher and subscriber on real ZMQ sockets over 127.0.0.1 and ipc:// (reference events-and-hashing.md §1.1)."""

import logging
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from kvtier_harness.service_proc import free_port
from kvtier.cache import KVCache
from kvtier.config import KVEventsConfig, build_config
from kvtier.errors import KVTierError
from kvtier.layout import KVLayout
from kvtier.hashing import event_id, sglang_event_id
from kvtier.events import (END_SEQ, BlockIndex, BlockStored, EventBatch, EventEmitter, EventPublisher, Gap,
                           Subscriber, decode_batch, encode_batch, should_bind)
from kvtier.metrics import Metrics
from kvtier.zmq_context import Context

TCP = "tcp://127.0.0.1:0"


def event(i: int) -> BlockStored:
    return BlockStored([i], None, [i, i + 1], 2, None, "CPU", None)


def config(**kw) -> KVEventsConfig:
    base = dict(endpoint=TCP, replay_endpoint=TCP, batch_max_events=1, batch_max_delay_seconds=0)
    base.update(kw)
    return KVEventsConfig(**base)


def wait_for(pred, timeout_seconds=10.0):
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def sync(pub: EventPublisher, sub: Subscriber, marker=10**9) -> int:
    """Publish probes until the subscriber sees one (ZMQ joins late), drain, and return the next seq."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish([event(marker)])
        if sub.recv(0.1) is not None:
            break
    else:
        raise AssertionError("subscriber never received a probe")
    assert wait_for(lambda: pub.stats()["queued_events"] == 0)
    while sub.recv(0.3) is not None:
        pass
    return pub.stats()["next_seq"]


@pytest.fixture
def pub():
    p = EventPublisher(config())
    yield p
    p.close()


def test_bind_rule():
    assert should_bind("tcp://*:5557") and should_bind("tcp://[::]:5557") and should_bind("ipc:///tmp/x")
    assert should_bind("inproc://x") and should_bind("tcp://127.0.0.1:5557") and should_bind("tcp://localhost:1")
    assert not should_bind("tcp://10.1.2.3:5557") and not should_bind("tcp://router.example:5557")


def test_frames_topic_contiguous_seq_from_zero_and_payload(pub):
    ctx = Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # probes until joined; seqs keep counting from 0
            pub.publish([event(-1 & 0xFFFF)])
            assert time.monotonic() < deadline
        for i in range(5):
            pub.publish([event(i)])
        frames = []
        while sub.poll(500):
            frames.append(sub.recv_multipart())
        assert all(len(f) == 3 and f[0] == b"kv-events" and len(f[1]) == 8 for f in frames)
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        tail = [decode_batch(f[2]) for f in frames[-5:]]
        assert [b.events for b in tail] == [[event(i)] for i in range(5)]
        assert all(b.data_parallel_rank == 0 for b in tail)
    finally:
        ctx.destroy(linger=0)
    assert pub.stats()["next_seq"] >= 5 and pub.stats()["published_events"] == pub.stats()["next_seq"]


def test_first_seq_is_zero_and_replay_protocol_layout(pub):
    for i in range(4):
        pub.publish([event(i)])
    assert wait_for(lambda: pub.stats()["next_seq"] == 4)
    ctx = Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart([b"", b"\x00" * 7])  # malformed (7 bytes): ignored, server keeps going
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000)
            replies.append(dealer.recv_multipart())
            if replies[-1][2] == END_SEQ:
                break
        assert replies[-1] == [b"", b"", END_SEQ, b""]
        assert [r[:3] for r in replies[:-1]] == [[b"", b"kv-events", (s).to_bytes(8, "big")] for s in (2, 3)]
        assert [decode_batch(r[3]).events for r in replies[:-1]] == [[event(2)], [event(3)]]
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        first = dealer.recv_multipart() if dealer.poll(5000) else None
        assert first is not None and first[2] == (0).to_bytes(8, "big")
    finally:
        ctx.destroy(linger=0)


def test_gap_recovered_through_replay_in_order(pub):
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, "kv-events")
    try:
        start = sync(pub, sub)
        sub.drop_next(7)
        for i in range(30):
            pub.publish([event(i)])
        got = []
        while len(got) < 30:
            item = sub.recv(10)
            assert item is not None, f"only {len(got)} of 30 batches arrived"
            got.append(item)
        assert [seq for seq, _ in got] == list(range(start, start + 30))
        assert [b.events[0].block_hashes[0] for _, b in got] == list(range(30))
        assert sub.stats.dropped_by_hook == 7 and sub.stats.replayed == 7 and sub.gaps == []
    finally:
        sub.close()


def test_late_subscriber_gets_buffered_batches_and_a_notice_of_the_rest():
    notices = []
    with EventPublisher(config(buffer_steps=5)) as pub:
        for i in range(12):
            pub.publish([event(i)])
        assert wait_for(lambda: pub.stats()["next_seq"] == 12)
        with Subscriber(pub.endpoint, pub.replay_endpoint, start_seq=0, on_gap=notices.append) as sub:
            got = list(sub.iter(0.5))
        assert [seq for seq, _ in got] == [7, 8, 9, 10, 11]
        assert [b.events[0].block_hashes[0] for _, b in got] == [7, 8, 9, 10, 11]
        assert [(g.first_missing, g.last_missing) for g in notices] == [(0, 6)]
        assert "replay buffer" in notices[0].reason and sub.stats.missed_batches == 7


def test_live_gap_larger_than_the_buffer_delivers_what_exists_and_reports_the_rest():
    with EventPublisher(config(buffer_steps=3)) as pub:
        with Subscriber(pub.endpoint, pub.replay_endpoint, on_gap=lambda g: None) as sub:
            start = sync(pub, sub)
            sub.drop_next(6)
            for i in range(7):
                pub.publish([event(i)])
            got = list(sub.iter(1.0))
            # the ring holds the last 3 batches (seq start+4..start+6); the live one is start+6
            assert [s for s, _ in got] == [start + 4, start + 5, start + 6]
            assert sub.gaps == [Gap(start, start + 3, "no longer in the publisher's replay buffer")]


def test_bad_frames_are_skipped_counted_and_the_subscriber_keeps_going():
    ctx = Context()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    good = encode_batch(EventBatch(1.0, [event(1)], 0))
    sub = Subscriber(f"tcp://127.0.0.1:{port}", topic="kv-events")
    try:
        seq = 0
        deadline = time.monotonic() + 10
        while sub.recv(0.1) is None:
            raw.send_multipart([b"kv-events", seq.to_bytes(8, "big"), good])
            seq += 1
            assert time.monotonic() < deadline
        while sub.recv(0.3) is not None:
            pass
        raw.send_multipart([b"kv-events-other", seq.to_bytes(8, "big"), good])  # passes ZMQ's prefix filter
        raw.send_multipart([b"kv-events", b"\x00" * 7, good])
        raw.send_multipart([b"kv-events", seq.to_bytes(8, "big"), b"\xc1\xc1 not msgpack"])
        raw.send_multipart([b"kv-events", seq.to_bytes(8, "big")])
        raw.send_multipart([b"kv-events", (seq + 1).to_bytes(8, "big"), good])
        item = sub.recv(5)
        assert item is not None and item[0] == seq + 1 and item[1].events == [event(1)]
        s = sub.stats
        assert (s.wrong_topic, s.bad_seq, s.bad_payload, s.bad_frames) == (1, 1, 1, 1)
        assert s.gaps == []
    finally:
        sub.close()
        ctx.destroy(linger=0)


def test_endpoint_in_use_is_a_clear_startup_error(pub):
    with pytest.raises(KVTierError, match="already uses it"):
        EventPublisher(config(endpoint=pub.endpoint, replay_endpoint=None))
    with pytest.raises(KVTierError, match="replay socket"):
        EventPublisher(config(replay_endpoint=pub.replay_endpoint))


def test_ipc_endpoints(tmp_path):
    with EventPublisher(config(endpoint=f"ipc://{tmp_path}/ev", replay_endpoint=f"ipc://{tmp_path}/replay")) as pub:
        with Subscriber(pub.endpoint, pub.replay_endpoint, "kv-events") as sub:
            start = sync(pub, sub)
            sub.drop_next(2)
            for i in range(4):
                pub.publish([event(i)])
            got = list(sub.iter(1.0))
            assert [s for s, _ in got] == list(range(start, start + 4)) and sub.stats.replayed == 2


def test_connect_mode_publisher_to_a_binding_subscriber():
    ctx = Context()
    probe = ctx.socket(zmq.PUB)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close()  # a free port for the subscriber to bind
    ctx.term()
    with Subscriber(f"tcp://127.0.0.1:{port}", bind=True) as sub:
        with EventPublisher(config(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=None), bind=False) as pub:
            sync(pub, sub)
            pub.publish([event(5)])
            item = sub.recv(5)
            assert item is not None and item[1].events == [event(5)]


def test_queue_overflow_is_counted_and_reported_with_the_next_batch(caplog):
    metrics = Metrics()
    cfg = config(replay_endpoint=None, max_queue_size=10, batch_max_events=1000, batch_max_delay_seconds=60)
    pub = EventPublisher(cfg, metrics=metrics)
    try:
        assert pub.publish([event(i) for i in range(25)]) == 10
        assert metrics.value("kvtier_events_dropped_total") == 15
        assert pub.stats()["dropped_events"] == 15
    finally:
        with caplog.at_level(logging.WARNING, logger="kvtier.events.publisher"):
            pub.close()
    assert pub.stats()["published_events"] == 10
    assert any("15 event(s) dropped before batch seq 0" in r.getMessage() for r in caplog.records)
    assert pub.publish([event(1)]) == 0  # after close: dropped, never raised
    assert metrics.value("kvtier_events_published_total") == 10


@pytest.mark.parametrize("encoding", ["vllm", "vllm-legacy", "sglang"])
def test_emitter_through_publisher_to_subscriber_index(encoding):
    kv = dict(endpoint=TCP, replay_endpoint=TCP, encoding=encoding, batch_max_delay_seconds=0.001)
    cfg = build_config({"chunk_size": 8, "block_size": 4, "hash_algorithm": "sha256_cbor", "hash_seed": "0",
                        "enable_kv_events": True, "kv_events": kv, "l1_size_gb": "1MiB"})
    tokens = list(range(1, 17))
    with KVCache(cfg, "m", KVLayout(1, 1, 4), publish_events=False) as cache:
        refs = cache.chunk_refs(tokens)[1]  # real chunk refs; this cache announces nothing itself
    with EventPublisher(cfg.kv_events) as pub:
        with Subscriber(pub.endpoint, pub.replay_endpoint, "kv-events") as sub:
            sync(pub, sub)
            emitter = EventEmitter(cfg, publisher=pub)
            emitter.stored(tokens, refs, "CPU")
            emitter.stored(tokens, refs, "CPU")  # deduplicated
            emitter.stored(tokens, refs[:1], "STORAGE")
            emitter.cleared("STORAGE")
            emitter.removed([refs[1].key.name()], "CPU")
            index, events = BlockIndex(), []
            while len(events) < 4:
                item = sub.recv(5)
                assert item is not None
                index.apply(item[1])
                events.extend(item[1].events)
            assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved"]
            ids = [2164874634404590027, 17270480062156288726]  # vLLM's rule: the digests' last 8 bytes
            if encoding == "sglang":  # SGLang's: their first 8 bytes (its hash_str_to_int64)
                ids = [sglang_event_id(d) for d in refs[0].blocks.digests[:2]]
                assert ids != [event_id(d) for d in refs[0].blocks.digests[:2]]
            assert events[0].block_hashes[:2] == ids
            assert events[2].medium == "STORAGE" and events[3].medium == "CPU"
            assert index.contains(ids[0], "CPU") and len(index) == 2
            assert sub.recv(0.3) is None


def test_cli_subscribe_prints_the_seed_form_and_json(pub):
    ev = BlockStored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU", None)
    for flags in ([], ["--json"]):
        cmd = [sys.executable, "-m", "kvtier", "events", "subscribe", "--endpoint", pub.endpoint,
               "--topic", "kv-events", "--max-batches", "1", "--timeout-seconds", "30", *flags]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            pub.publish([ev])
            time.sleep(0.1)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        lines = out.splitlines()
        if flags:
            [line] = lines
            obj = msgspec.json.decode(line)
            assert obj["events"][0]["type"] == "BlockStored" and obj["events"][0]["block_hashes"] == [11, 12]
            assert obj["events"][0]["medium"] == "CPU" and isinstance(obj["seq"], int)
        else:
            assert len(lines) == 2
            assert lines[0].startswith("Received event batch at ") and lines[0].endswith(":")
            float(lines[0][len("Received event batch at "):-1])
            assert lines[1] == ("- BlockStored(block_hashes=[11, 12], parent_block_hash=None, "
                                "token_ids=[1, 2, 3, 4, 5, 6, 7, 8], block_size=4, lora_id=None, medium='CPU')")


def test_malformed_endpoints_are_clear_errors():
    with pytest.raises(KVTierError, match="tcp://127.0.0.1:5557"):
        Subscriber("not-an-endpoint")
    with pytest.raises(KVTierError, match="endpoint's form"):
        EventPublisher(config(endpoint="tcp://127.0.0.1:notaport", replay_endpoint=None))


def test_the_replay_buffer_is_bounded_in_bytes():
    with EventPublisher(config(buffer_max_bytes=2000)) as pub:
        for i in range(200):
            pub.publish([BlockStored([i], None, list(range(i, i + 40)), 2, None, "CPU", None)])
        assert wait_for(lambda: pub.stats()["next_seq"] == 200)
        stats = pub.stats()
        assert 0 < stats["buffered_bytes"] <= 2000 and stats["buffered_batches"] < 200
        with Subscriber(pub.endpoint, pub.replay_endpoint, start_seq=0, on_gap=lambda g: None) as sub:
            got = [seq for seq, _ in sub.iter(0.5)]
        assert got and got == list(range(200 - len(got), 200))  # the newest batches, in order


def test_a_publisher_that_starts_after_its_subscriber_is_caught_up_even_when_its_only_batch_is_lost():
    port, replay = free_port(), free_port()
    with Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", start_seq=0,
                    replay_timeout_seconds=0.2) as sub:
        assert sub.recv(0.3) is None  # nobody answers the catch-up yet
        with EventPublisher(config(endpoint=f"tcp://127.0.0.1:{port}",
                                   replay_endpoint=f"tcp://127.0.0.1:{replay}")) as pub:
            sub.drop_next(1)  # the one batch is lost on the live socket (as when the SUB has not joined yet)
            pub.publish([event(7)])
            # no later batch reveals a gap: only asking the replay again finds it, once a try (a fresh connection
            # and an answer within 0.2 s, one a second) is not cut short by a loaded machine: many tries
            got = sub.recv(60.0)
            assert got is not None and got[0] == 0 and got[1].events[0].block_hashes == [7]
            assert sub.stats.replayed == 1 and not sub.gaps
