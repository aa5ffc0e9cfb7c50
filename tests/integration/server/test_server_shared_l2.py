"""Two ``kvtier server`` processes over one real Redis L2 (redis-server on a free 127.0.0.1 port, a fresh key
prefix per test): a prompt stored through server A is found by server B on B's *first* lookup, although B's
index of the store was built before A wrote it (``server/lookup.py``: the lookup waits for a short L2 probe on
the promotion pool). The probe's faults: a Redis that hangs in ``contains`` (the fault-injecting wrapper around
the real adapter) costs one lookup the probe deadline and yields the indexes' answer, counted."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from support.server import CHUNK, ServerProc

from kvtier_harness import services
from kvtier.client import Client
from test_server_promotion import HANG_SECONDS, LAYOUT, counter, prompt

pytestmark = pytest.mark.services
TOKEN = "shared-l2-admin"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with services.redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield f"redis://127.0.0.1:{server.port}/0"


def redis_spec(url: str, prefix: str) -> dict:
    return {"type": "redis", "url": url, "prefix": prefix}


def start(tmp_path: Path, spec: dict, **server_keys) -> ServerProc:
    return ServerProc(tmp_path, token=TOKEN, extra=("--l2-adapter", json.dumps(spec)),
                      config={"server": server_keys} if server_keys else None)


def stored_through(srv: ServerProc, tokens, kv) -> None:
    with Client(srv.url, model="m", layout=LAYOUT) as client:
        assert client.store(tokens, kv) == len(tokens) // CHUNK
        assert client.flush(30)


def test_the_first_lookup_on_b_finds_what_a_wrote(tmp_path, redis_url):
    spec = redis_spec(redis_url, f"kvtier-test-{uuid.uuid4().hex}/")
    tokens, kv = prompt(21, 3)
    # a probe deadline no loaded machine reaches (the default, 0.1 s, is one scheduling delay of the pool thread or
    # of Redis on a busy 2-core machine): the answer is the probe's, never the deadline's
    # (test_a_hung_l2_costs_one_lookup_the_deadline_and_answers_from_the_index covers the deadline)
    with start(tmp_path, spec) as a, start(tmp_path, spec, lookup_probe_timeout_seconds=60.0) as b:
        with Client(b.url, model="m", layout=LAYOUT) as client:
            assert client.lookup(prompt(22, 2)[0]) == 0  # a prompt nobody stored: probed, a miss
            stored_through(a, tokens, kv)  # after B listed the store: only I/O tells B about it
            hits = client.lookup_tiers(tokens)
            assert (hits.num_tokens, hits.num_l1_tokens) == (len(tokens), 0)
            assert counter(b, "kvtier_lookup_probes_total") == 2
            # each lookup counted once, whether its answer waited for a probe or not
            assert counter(b, "kvtier_lookup_requests_total") == 2
            assert counter(b, "kvtier_lookup_hit_tokens_total", medium="STORAGE") == len(tokens)
            assert counter(b, "kvtier_lookup_hit_tokens_total", medium="CPU") == 0
            out, n = client.retrieve(tokens)  # the index now knows the records: promoted from Redis
            assert n == len(tokens) and torch.equal(out, kv)
            assert client.lookup(tokens) == len(tokens)  # in B's L1 now: answered at once, no probe
            assert counter(b, "kvtier_lookup_probes_total") == 2
        assert counter(b, "kvtier_lookup_probe_timeouts_total") == 0


def test_with_the_probe_off_the_first_lookup_answers_from_the_index(tmp_path, redis_url):
    spec = redis_spec(redis_url, f"kvtier-test-{uuid.uuid4().hex}/")
    tokens, kv = prompt(23, 2)
    with start(tmp_path, spec) as a, start(tmp_path, spec, lookup_probe_timeout_seconds=0) as b:
        stored_through(a, tokens, kv)
        with Client(b.url, model="m", layout=LAYOUT) as client:
            assert client.lookup(tokens) == 0  # B's index has not seen A's records
            assert counter(b, "kvtier_lookup_probes_total") == 0


def test_a_hung_l2_costs_one_lookup_the_deadline_and_answers_from_the_index(tmp_path, redis_url):
    prefix = f"kvtier-test-{uuid.uuid4().hex}/"
    hung = {"type": "faulty", "inner": redis_spec(redis_url, prefix), "latency_seconds": HANG_SECONDS, "ops": ["contains"]}
    tokens, kv = prompt(24, 2)
    other, other_kv = prompt(25, 2)
    with start(tmp_path, redis_spec(redis_url, prefix)) as a, \
            start(tmp_path, hung, lookup_probe_timeout_seconds=0.5, promote_timeout_seconds=30.0) as b:
        stored_through(a, tokens, kv)
        # the probe hangs in Redis; the answer comes at its deadline (far sooner than the client's timeout)
        with Client(b.url, model="m", layout=LAYOUT, timeout_seconds=10) as client:
            assert client.lookup(tokens) == 0
            assert counter(b, "kvtier_lookup_probe_timeouts_total") == 1
            assert client.ping()  # the client was not marked down: the server answered
            # while that probe is stuck, lookups skip probing and answer from L1 and the indexes at once
            assert client.lookup(tokens) == 0
            assert counter(b, "kvtier_lookup_probes_skipped_total", reason="stuck") == 1
            assert client.store(other, other_kv) == 2  # L1 serves as before
            assert client.lookup(other) == len(other)
            assert counter(b, "kvtier_lookup_requests_total") == 3
            assert counter(b, "kvtier_lookup_probes_total") == 1
