"""kvtier as SGLang 0.5.23's HiCache storage backend, with SGLang's real parts (``.venv-sglang``) and a real server.

SGLang runs in subprocesses of its own environment (``sglang_driver.py``): real MHA and MLA host pools on CPU
tensors, the backend made by SGLang's ``dynamic`` factory from the JSON extra config, called as SGLang's cache
controller calls it. A real ``kvtier server`` (this environment) is shared by those processes; its KV events reach a
real ZMQ subscriber here, decoded with vLLM's event classes trimmed of ``medium`` and ``lora_name`` (what LMCache
documents for SGLang subscribers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import msgspec
import pytest
import zmq

from kvtier_harness.kvtier_server import ServerProcess
from kvtier_harness.metrics import metric_value
from kvtier_harness.service_proc import free_port
from kvtier_harness.sglang import require_sglang, run_json, sglang_env

DRIVER = "tests/integration/sglang/sglang_driver.py"
TOKEN = "sglang-test-admin"
POOLS = {"mha-page_first": {"kind": "mha", "layout": "page_first", "num_pages": 256},
         "mha-layer_first": {"kind": "mha", "layout": "layer_first", "num_pages": 256},
         "mla-page_first": {"kind": "mla", "layout": "page_first", "num_pages": 256},
         "mla-layer_first": {"kind": "mla", "layout": "layer_first", "num_pages": 256}}
NUM_PAGES = 200  # two of SGLang's storage batches (128 pages each)


class BlockStored(msgspec.Struct, tag=True):  # vLLM's classes without medium and lora_name
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def extra(url: str | None, **more) -> dict:
    out = {"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang", "class_name": "KVTierStorage",
           "interface_v1": 1, **more}
    if url:
        out["kvtier.server_url"] = url
    return out


def run(cases: list[dict], timeout_seconds: float = 300) -> list[dict]:
    return run_json([DRIVER, json.dumps(cases)], timeout_seconds)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_sglang()
    work = tmp_path_factory.mktemp("sglang-server")
    events = f"tcp://127.0.0.1:{free_port()}"
    config = {"kv_events": {"auth": False, "batch_max_delay_seconds": 0.001}}
    with ServerProcess(work, 256, "512MB", token=TOKEN, l2={"type": "local_disk", "path": str(work / "l2")},
                       config=config, extra=("--enable-kv-events", "--kv-events-encoding", "sglang",
                                             "--kv-events-endpoint", events)) as srv:
        srv.events = events
        yield srv


@pytest.fixture(scope="module")
def stored(server):
    """The pages of every pool kind stored by one SGLang process, with the events the server published meanwhile."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(server.events)
    sub.subscribe(b"")
    time.sleep(0.5)  # a SUB misses what is published before it is connected (slow joiner)
    cases = [{"pool": pool, "extra": extra(server.url), "storage": {"tp_size": 2, "tp_rank": 0},
              "ops": [{"op": "store", "pages": NUM_PAGES, "seed": i, "tokens_seed": 100 + i}]}
             for i, pool in enumerate(POOLS.values())]
    results = dict(zip(POOLS, (case["ops"][0] for case in run(cases))))
    # distinct ids: a page written through to L2 is announced again (medium STORAGE), and those second
    # announcements of the first pools may arrive before the last pool's first ones
    batches = receive(sub, until=lambda evs: len({h for e in evs if isinstance(e, BlockStored)
                                                  for h in e.block_hashes}) >= len(POOLS) * NUM_PAGES)
    yield results, batches, sub
    sub.close(0)


def receive(sub, until, timeout_seconds: float = 60) -> list:
    events, deadline = [], time.monotonic() + timeout_seconds
    while not until(events) and time.monotonic() < deadline:
        if sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            events += msgspec.msgpack.decode(payload, type=EventBatch).events
    return events


def test_pages_stored_by_one_sglang_process_load_bit_exact_in_another(server, stored):
    results, _, _ = stored
    for name, got in results.items():
        assert got["stored"] == [True] * NUM_PAGES, name
        assert len(set(got["keys"])) == NUM_PAGES and len(set(got["sha"])) == NUM_PAGES
    cases = [{"pool": POOLS[name], "extra": extra(server.url), "storage": {"tp_size": 2, "tp_rank": 0},
              "ops": [{"op": "load", "keys": results[name]["keys"]}]} for name in POOLS]
    for name, case in zip(POOLS, run(cases)):
        load = case["ops"][0]
        assert load["exists"] == NUM_PAGES and load["loaded"] == [True] * NUM_PAGES, name
        assert load["sha"] == results[name]["sha"], name


def test_batch_exists_counts_the_leading_pages_held(server, stored):
    results, _, _ = stored
    keys = results["mha-page_first"]["keys"]
    unknown = [k[::-1] for k in keys[:5]]
    probes = [keys[:50], keys + unknown, unknown[:1] + keys[1:], keys[:130] + unknown + keys[130:], []]
    case = {"pool": POOLS["mha-page_first"], "extra": extra(server.url), "storage": {"tp_size": 2, "tp_rank": 0},
            "ops": [{"op": "exists", "keys": probe} for probe in probes[:-1]]}
    before = metric_value(server.metrics_text(), "kvtier_lookup_requests_total")
    answers = [op["exists"] for op in run([case])[0]["ops"]]
    assert answers == [50, NUM_PAGES, 0, 130]
    # one lookup per batch SGLang asks about: 1, 2 (128 + 77), 1 (its first page is missing), 2 (128, then 2 + a miss)
    assert metric_value(server.metrics_text(), "kvtier_lookup_requests_total") - before == 6


def test_another_model_rank_or_layout_never_hits(server, stored):
    results, _, _ = stored
    mha, mla = results["mha-page_first"]["keys"], results["mla-page_first"]["keys"]
    readers = [  # (pool, storage config, keys, hits expected)
        ("mha-page_first", {"tp_size": 2, "tp_rank": 1}, mha, 0),  # another TP rank holds other heads
        ("mha-page_first", {"tp_size": 2, "tp_rank": 0, "model": "other-model"}, mha, 0),
        ("mha-layer_first", {"tp_size": 2, "tp_rank": 0}, mha, 0),  # same keys, another byte order
        ("mla-page_first", {"tp_size": 2, "tp_rank": 1}, mla, NUM_PAGES),  # MLA KV is the same on every rank
        ("mla-page_first", {"tp_size": 2, "tp_rank": 1, "model": "other-model"}, mla, 0),
    ]
    cases = [{"pool": POOLS[pool], "extra": extra(server.url), "storage": storage, "ops": [{"op": "exists", "keys": keys}]}
             for pool, storage, keys, _ in readers]
    salted = {"pool": POOLS["mha-page_first"], "extra": extra(server.url, **{"kvtier.cache_salt": "tenant-b"}),
              "storage": {"tp_size": 2, "tp_rank": 0}, "ops": [{"op": "exists", "keys": mha}]}
    got = [case["ops"][0]["exists"] for case in run(cases + [salted])]
    assert got == [hits for *_, hits in readers] + [0]


def test_events_carry_sglangs_own_block_ids_and_parents(server, stored):
    results, events, sub = stored
    by_id = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            assert ev.token_ids == [] and ev.block_size == 16  # SGLang hands the backend page keys, no tokens
            for i, block in enumerate(ev.block_hashes):
                by_id[block] = ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1]
    for name, got in results.items():
        ids = got["ids"]  # SGLang's hash_str_to_int64 of its keys, computed in the SGLang process
        assert all(-2**63 <= i < 2**63 for i in ids)
        assert [by_id.get(i, "missing") for i in ids] == [None] + ids[:-1], name  # the parents across batches too
    server.clear_l1()
    removed = receive(sub, until=lambda evs: len({h for e in evs if isinstance(e, BlockRemoved) for h in e.block_hashes})
                      >= len(by_id))
    gone = {h for e in removed if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert set(results["mla-layer_first"]["ids"]) <= gone and set(by_id) <= gone


def test_the_flat_tensor_path_stores_the_same_bytes_under_the_same_keys(server):
    keys = [f"{i:064x}" for i in range(1, 6)]
    case = {"pool": POOLS["mha-layer_first"], "extra": extra(server.url), "storage": {"model": "flat-model"},
            "ops": [{"op": "flat", "keys": keys}, {"op": "load", "keys": keys}]}
    flat, load = run([case])[0]["ops"]
    assert flat["set"] == flat["exists"] == flat["equal"] == [True] * 5
    assert load["loaded"] == [True] * 5 and load["sha"] == flat["sha"]


def test_an_in_process_cache_shares_pages_through_its_l2(tmp_path):
    local = extra(None, **{"kvtier.local_disk": str(tmp_path / "l2"), "kvtier.l1_size_gb": "64MB"})
    write = {"pool": POOLS["mla-page_first"], "extra": local,
             "ops": [{"op": "store", "pages": 20, "seed": 7, "tokens_seed": 8}]}
    got = run([write])[0]["ops"][0]  # closing the backend waits for its L2 writes
    read = {"pool": POOLS["mla-page_first"], "extra": local, "ops": [{"op": "load", "keys": got["keys"]}]}
    load = run([read])[0]["ops"][0]
    assert got["stored"] == [True] * 20 and load["exists"] == 20 and load["loaded"] == [True] * 20
    assert load["sha"] == got["sha"]


BAD_CONFIGS = [  # (what is wrong, what the message must name)
    ({"interface_v1": None}, ["interface_v1 is missing"]),
    ({"interface_v1": 0}, ["interface_v1 is 0"]),
    ({"kvtier.server_url": "localhost:5555"}, ["kvtier.server_url", "tcp://host:port"]),
    ({"kvtier.l1_sise_gb": 1}, ["'kvtier.l1_sise_gb'", "did you mean 'kvtier.l1_size_gb'"]),
    ({"file_storage_path": "/tmp/x"}, ["unknown key 'file_storage_path'"]),
    ({"kvtier.use_layerwise": True}, ["kvtier.use_layerwise applies to the vLLM connector only"]),
    ({"kvtier.timeout_seconds": -1}, ["kvtier.timeout_seconds"]),
]


@pytest.fixture(scope="module")
def refusals() -> list[dict]:
    """What SGLang's attach raised for each of ``BAD_CONFIGS`` (one SGLang process)."""
    cases = []
    for bad, _ in BAD_CONFIGS:
        config = {**extra("tcp://127.0.0.1:1"), **bad}
        cases.append({"pool": POOLS["mha-page_first"], "extra": {k: v for k, v in config.items() if v is not None}})
    return run(cases)


@pytest.mark.parametrize("index", range(len(BAD_CONFIGS)), ids=[next(iter(b)) for b, _ in BAD_CONFIGS])
def test_a_bad_extra_config_fails_the_attach_naming_the_key(refusals, index):
    result = refusals[index]
    assert result.get("error") == "ConfigError", result
    for name in BAD_CONFIGS[index][1]:
        assert name in result["message"]


def test_a_stopped_then_killed_server_gives_misses_within_the_deadline(tmp_path):
    timeout = 1.0
    with ServerProcess(tmp_path, 256, "64MB") as srv:
        ops = [{"op": "store", "pages": 10, "seed": 1, "tokens_seed": 2}, {"op": "wait"},
               {"op": "load"}, {"op": "store", "pages": 10, "seed": 3, "tokens_seed": 4}, {"op": "wait"},
               {"op": "load"}, {"op": "store", "pages": 10, "seed": 5, "tokens_seed": 6}]
        case = {"pool": POOLS["mha-page_first"], "extra": extra(srv.url, **{"kvtier.timeout_seconds": timeout}),
                "ops": ops}
        proc = subprocess.Popen([require_sglang(), DRIVER, json.dumps([case])], env=sglang_env(), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert _wait_line(proc) == "WAIT"
            os.kill(srv.proc.pid, signal.SIGSTOP)  # slow: it holds the connection and never answers
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert _wait_line(proc) == "WAIT"
            os.kill(srv.proc.pid, signal.SIGKILL)  # gone
            srv.proc.wait(10)
            proc.stdin.write("\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
    result = json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:])[0]["ops"]
    assert result[0]["stored"] == [True] * 10
    for load, store in ((result[2], result[3]), (result[5], result[6])):
        assert load["exists"] == 0 and load["loaded"] == [False] * 10
        assert store["stored"] == [False] * 10
        # each call waits at most the deadline per reply: exists + retrieve, begin store + the lookup after it
        assert load["seconds"] < 2 * timeout + 5 and store["seconds"] < 2 * timeout + 5, result


def _wait_line(proc) -> str:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"driver ended early: {proc.stderr.read()[-3000:]}")
        if line.strip() == "WAIT":
            return "WAIT"
