"""L2 at the level of the whole system, over real servers on 127.0.0.1 (moto, SeaweedFS, Azurite, redis-server,
a 3-node Redis Cluster, Valkey) and real ``kvtier server`` processes:

* warm restart for every L2 kind: a server stores, is stopped with SIGTERM (which flushes L2 writes), a new
  server with an empty L1 and the same adapter hits the whole prefix with byte-identical KV;
* two servers at once sharing one Redis Cluster / S3 bucket / Azure container (the multi-machine deployment);
* cascade tiering through KVCache: write-through to both adapters, fall-through after an out-of-band delete,
  promotion into the faster L2, prefix semantics across adapters;
* faults at cache level: a store that is down at startup and comes back, a cluster node stopped mid-run,
  and a full disk (a small tmpfs).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from support.server import CHUNK, LAYOUT, ServerProc, metric_value

from kvtier_harness import services

from kvtier.cache import KVCache
from kvtier.config import KVTierConfig
from kvtier.l2.base import create_adapter
from kvtier.client import Client

pytestmark = pytest.mark.services
MODEL = "l2-system"
KINDS = ["local_disk", "s3_moto", "s3_seaweedfs", "azure_blob", "redis", "redis_cluster", "valkey"]
_STARTERS = {
    "moto": services.start_moto,
    "seaweedfs": services.start_seaweedfs,
    "azurite": services.start_azurite,
    "redis": services.start_redis,
    "valkey": lambda root: services.start_redis(root, binary="valkey-server"),
    "redis_cluster": services.start_redis_cluster,
}
# short timeouts and backoff: a store that is down must cost the test little time
FAST = {"connect_timeout_seconds": 1.0, "retry_backoff_seconds": 0.1, "retry_backoff_max_seconds": 0.5}


class Stores:
    """The module's storage servers, each started on first use and stopped (by pid) at module end."""

    def __init__(self, root: Path):
        self.root = root
        self.handles: dict[str, object] = {}

    def get(self, service: str):
        if service not in self.handles:
            self.handles[service] = _STARTERS[service](self.root)
        return self.handles[service]

    def spec(self, kind: str, tag: str) -> dict:
        """Adapter spec of ``kind`` whose records live under ``tag`` (a fresh tag: a fresh, empty store)."""
        if kind == "local_disk":
            return {"type": "local_disk", "path": str(self.root / "disk" / tag)}
        if kind.startswith("s3_"):
            s3 = self.get(kind.removeprefix("s3_"))
            return {"type": "s3", "bucket": "kvtier-system", "create": True, "prefix": f"{tag}/", "retries": 0,
                    "endpoint_url": s3.endpoint_url, "aws_access_key_id": s3.access_key_id,
                    "aws_secret_access_key": s3.secret_access_key, **FAST}
        if kind == "azure_blob":
            return {"type": "azure_blob", "container": "kvtier-system", "create": True, "prefix": f"{tag}/",
                    "connection_string": self.get("azurite").connection_string, **FAST}
        handle = self.get(kind)
        return {"type": "valkey" if kind == "valkey" else "redis", "url": handle.url, "prefix": f"{tag}:",
                "cluster": kind == "redis_cluster", "socket_timeout_seconds": 2.0, "retries": 0, **FAST}

    def stop(self) -> None:
        for handle in self.handles.values():
            handle.stop()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    holder = Stores(tmp_path_factory.mktemp("stores"))
    try:
        yield holder
    finally:
        holder.stop()


def new_tag() -> str:
    return "sys" + uuid.uuid4().hex[:12]


def prompt(num_chunks: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """Tokens of ``num_chunks`` full chunks and random fp32 KV of shape (2, 2, T, 1, 8) for them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1000, 50_000, (num_chunks * CHUNK,), generator=g).tolist()
    return tokens, torch.randn(LAYOUT.chunk_shape(len(tokens)), generator=g, dtype=torch.float32)


def adapter_args(spec: dict) -> tuple[str, ...]:
    return ("--l2-adapter", json.dumps(spec), "--log-level", "WARNING")


def cache_over(*specs: dict, promote_to_faster: bool = False) -> KVCache:
    config = KVTierConfig(chunk_size=CHUNK, l1_size_gb="64MB", l2_adapters=list(specs),
                          l2_promote_to_faster_l2=promote_to_faster)
    return KVCache(config, MODEL, LAYOUT)


def names_of(cache: KVCache, tokens) -> list[str]:
    return [ref.key.name() for ref in cache.chunk_refs(tokens)[1]]


def counter(cache: KVCache, metric: str, **labels) -> float:
    series = cache.stats().get(metric, {})
    if not labels:
        return sum(series.values())
    want = ",".join(f"{k}={v}" for k, v in labels.items())
    return series.get(want, 0.0)


def retrieve_cold(cache: KVCache, tokens):
    """Retrieve with an empty L1, so every hit comes from L2."""
    cache.clear("CPU")
    return cache.retrieve(tokens)


# ---- warm restart ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_restarted_server_hits_the_whole_prefix_from_l2(stores, tmp_path, kind):
    spec = stores.spec(kind, new_tag())
    tokens, kv = prompt(4, seed=KINDS.index(kind))
    with ServerProc(tmp_path, extra=adapter_args(spec)) as first, Client(first.url, model=MODEL, layout=LAYOUT) as c:
        assert c.store(tokens, kv) == 4
    assert first.proc.returncode == 0, first.log()  # SIGTERM: queued L2 writes finished, clean exit
    with ServerProc(tmp_path, extra=adapter_args(spec)) as second:
        assert second.status()["l1"]["num_chunks"] == 0
        with Client(second.url, model=MODEL, layout=LAYOUT) as client:
            assert client.lookup(tokens) == len(tokens)
            out, n = client.retrieve(tokens)
            assert n == len(tokens) and torch.equal(out, kv)
        assert second.status()["l1"]["num_chunks"] == 4  # the hits were promoted into the new L1
        assert metric_value(second.metrics_text(), "kvtier_l2_promoted_chunks_total") == 4


# ---- two servers sharing one store ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["redis_cluster", "s3_moto", "azure_blob"])
def test_two_servers_share_one_store(stores, tmp_path, kind):
    spec = stores.spec(kind, new_tag())
    tokens, kv = prompt(3, seed=40 + len(kind))
    with ServerProc(tmp_path, extra=adapter_args(spec)) as a, ServerProc(tmp_path, extra=adapter_args(spec)) as b:
        with Client(a.url, model=MODEL, layout=LAYOUT) as ca, Client(b.url, model=MODEL, layout=LAYOUT) as cb:
            assert cb.lookup(tokens) == 0
            assert ca.store(tokens, kv) == 3
            assert ca.flush(30)  # A's write-through reached the shared store
            # B answers lookups from its index; the first lookup past it probes the store in the background
            services.wait_for(lambda: cb.lookup(tokens) == len(tokens), 30, "B to find A's chunks")
            out, n = cb.retrieve(tokens)
            assert n == len(tokens) and torch.equal(out, kv)
            # and the other way: B extends the prompt, A reads B's chunk from the store
            more, more_kv = prompt(1, seed=99 + len(kind))
            longer, longer_kv = tokens + more, torch.cat([kv, more_kv], dim=2)
            assert cb.store(longer, longer_kv) == 1 and cb.flush(30)
            services.wait_for(lambda: ca.lookup(longer) == len(longer), 30, "A to find B's chunk")
            out, n = ca.retrieve(longer)
            assert n == len(longer) and torch.equal(out, longer_kv)
        assert b.status()["l1"]["num_chunks"] == 4 and a.status()["l1"]["num_chunks"] == 4


# ---- cascade tiering through KVCache --------------------------------------------------------
def _delete_out_of_band(stores: Stores, spec: dict, names: list[str]) -> None:
    """Remove records behind the cache's back: files, objects, or through another adapter instance."""
    if spec["type"] == "local_disk":
        removed = 0
        for path in Path(spec["path"]).rglob("*"):
            if path.is_file() and any(n in path.name for n in names):
                path.unlink()
                removed += 1
        assert removed == len(names)
    elif spec["type"] == "s3":
        client = stores.get("moto").client()
        for name in names:
            client.delete_object(Bucket=spec["bucket"], Key=spec["prefix"] + name)
    else:
        other = create_adapter(spec)
        assert other.delete(names) == len(names)
        other.close()


CASCADES = {"memory>local_disk": ("memory", "local_disk"), "local_disk>s3": ("local_disk", "s3_moto")}


def _cascade_specs(stores: Stores, pair: tuple[str, str]) -> list[dict]:
    tag = new_tag()
    return [{"type": "memory", "shared": tag} if kind == "memory" else stores.spec(kind, tag) for kind in pair]


@pytest.mark.parametrize("promote", [False, True], ids=["no_promote", "promote"])
@pytest.mark.parametrize("cascade", list(CASCADES))
def test_cascade_write_through_fall_through_and_promotion(stores, cascade, promote):
    specs = _cascade_specs(stores, CASCADES[cascade])
    tokens, kv = prompt(4, seed=7)
    with cache_over(*specs, promote_to_faster=promote) as cache:
        fast, slow = cache.l2.adapters
        names = names_of(cache, tokens)
        assert cache.store(tokens, kv) == 4 and cache.flush(30)
        assert fast.contains(names) == [True] * 4 and slow.contains(names) == [True] * 4
        assert counter(cache, "kvtier_l2_writes_total") == 8

        _delete_out_of_band(stores, specs[0], names[1:3])  # the fast adapter lost chunks 1 and 2
        out, n = retrieve_cold(cache, tokens)
        assert n == len(tokens) and torch.equal(out, kv)  # chunks 1 and 2 came from the slow adapter
        assert fast.contains(names) == [True, promote, promote, True]

        # a chunk missing in every adapter ends the prefix, even though the chunks after it exist
        _delete_out_of_band(stores, specs[0], [names[2]] if promote else [])
        _delete_out_of_band(stores, specs[1], [names[2]])
        out, n = retrieve_cold(cache, tokens)
        assert n == 2 * CHUNK and torch.equal(out, kv[:, :, :n])
        # the failed read told the adapters (an index may hold a name until a read finds it gone)
        assert slow.contains(names) == [True, True, False, True]
        cache.clear("CPU")
        assert cache.lookup(tokens) == 2 * CHUNK
        assert counter(cache, "kvtier_l2_errors_total") == 0


# ---- faults ----------------------------------------------------------------------------------
def _down_spec(kind: str, port: int, tag: str) -> dict:
    if kind == "s3":
        return {"type": "s3", "bucket": "kvtier-down", "create": True, "prefix": f"{tag}/", "retries": 0,
                "endpoint_url": f"http://127.0.0.1:{port}", "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing", **FAST}
    return {"type": "redis", "url": f"redis://127.0.0.1:{port}/0", "prefix": f"{tag}:", "retries": 0, **FAST}


def _start_on(kind: str, root: Path, port: int):
    return services.moto_server(root, port=port) if kind == "s3" else services.redis_server(root, port=port)


@pytest.mark.parametrize("kind", ["s3", "redis"])
def test_store_down_at_startup_then_back(tmp_path, kind):
    port = services.free_port()
    spec = _down_spec(kind, port, new_tag())
    tokens, kv = prompt(3, seed=21)
    later, later_kv = prompt(2, seed=22)
    with cache_over(spec) as cache, ServerProc(tmp_path, extra=adapter_args(spec)) as server:
        (l2_status,) = server.status()["l2"]
        assert l2_status["healthy"] is False and l2_status["reason"] != "ok"
        assert cache.lookup(tokens) == 0 and cache.retrieve(tokens)[1] == 0
        assert cache.store(tokens, kv) == 3 and cache.flush(30)  # into L1; the L2 writes are dropped
        assert counter(cache, "kvtier_l2_write_dropped_total") == 3
        out, n = cache.retrieve(tokens)  # L1 still serves them
        assert n == len(tokens) and torch.equal(out, kv)
        assert retrieve_cold(cache, tokens)[1] == 0

        with _start_on(kind, tmp_path, port):
            services.wait_for(lambda: server.status()["l2"][0]["healthy"], 30, "the server's adapter to reconnect")
            services.wait_for(lambda: cache.l2.status()[0]["healthy"], 30, "the cache's adapter to reconnect")
            assert cache.store(later, later_kv) == 2 and cache.flush(30)
            assert counter(cache, "kvtier_l2_writes_total") == 2
            out, n = retrieve_cold(cache, later)
            assert n == len(later) and torch.equal(out, later_kv)
            with Client(server.url, model=MODEL, layout=LAYOUT) as client:  # the server's L2 works again too
                # another writer's chunks: the first lookup past the server's index probes the store
                services.wait_for(lambda: client.lookup(later) == len(later), 30, "the server to find the chunks")
                out, n = client.retrieve(later)
                assert n == len(later) and torch.equal(out, later_kv)


def test_cluster_node_stopped_mid_run_gives_shorter_prefix_then_recovers(stores):
    cluster = stores.get("redis_cluster")
    spec = stores.spec("redis_cluster", new_tag())
    tokens, kv = prompt(8, seed=31)
    with cache_over(spec) as cache:
        names = names_of(cache, tokens)
        nodes = [cluster.node_of(f"{spec['prefix']}{{{name}}}") for name in names]
        victim = next(node for node in nodes if node not in (nodes[0], 0))  # keep chunk 0 and the seed node up
        first_lost = nodes.index(victim)
        assert cache.store(tokens, kv) == 8 and cache.flush(30)
        out, n = retrieve_cold(cache, tokens)
        assert n == len(tokens) and torch.equal(out, kv)
        cluster.stop_node(victim)
        try:
            out, n = retrieve_cold(cache, tokens)  # never an exception: a shorter prefix
            assert n == first_lost * CHUNK and torch.equal(out, kv[:, :, :n])
            assert counter(cache, "kvtier_l2_errors_total") >= 1
        finally:
            cluster.start_node(victim)
            cluster.wait_ok()
        services.wait_for(lambda: retrieve_cold(cache, tokens)[1] == len(tokens), 30, "hits after the node returns")
        out, n = retrieve_cold(cache, tokens)
        assert torch.equal(out, kv)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (needs root), unmounted on exit."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True, timeout=30)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True, timeout=30)


def test_full_disk_drops_writes_and_keeps_reads(tmp_path):
    with small_tmpfs(tmp_path / "l2", "64k") as mount:
        first, first_kv = prompt(4, seed=51)
        second, second_kv = prompt(40, seed=52)  # 40 records of 2 KiB + header: more than the 64 KiB disk
        spec = {"type": "local_disk", "path": str(mount / "kv")}
        with cache_over(spec) as cache:
            assert cache.store(first, first_kv) == 4 and cache.flush(30)
            assert cache.store(second, second_kv) == 40 and cache.flush(30)  # no exception
            written = counter(cache, "kvtier_l2_writes_total")
            dropped = counter(cache, "kvtier_l2_write_dropped_total")
            assert dropped > 0 and written + dropped == 44
            out, n = retrieve_cold(cache, first)
            assert n == len(first) and torch.equal(out, first_kv)
            out, n = retrieve_cold(cache, second)
            assert 0 < n < len(second) and torch.equal(out, second_kv[:, :, :n])


def test_a_put_on_a_full_disk_keeps_the_head_of_its_records(tmp_path):
    """Parallel writes may let a late record take the space an early one needed: the adapter gives it back to the
    head, so what a put stored is a prefix (a lookup stops at the first missing chunk)."""
    with small_tmpfs(tmp_path / "l2", "64k") as mount:
        adapter = create_adapter({"type": "local_disk", "path": str(mount / "kv"), "num_threads": 8})
        try:
            items = [(f"{i:016x}-{i:064x}", [bytes([i]) * 6000]) for i in range(24)]  # 2 pages each: 48 > 16
            for _ in range(3):
                flags = adapter.put(items)
                stored = flags.count(True)
                assert 0 < stored < len(items) and flags == [True] * stored + [False] * (len(items) - stored)
                assert sorted(adapter.list_names()) == [name for name, _ in items[:stored]]
                assert adapter.get([items[0][0]])[0] == items[0][1][0]
                adapter.delete([name for name, _ in items])
        finally:
            adapter.close()


def test_a_full_disk_opens_again_and_serves_its_records(tmp_path):
    with small_tmpfs(tmp_path / "l2", "64k") as mount:
        spec = {"type": "local_disk", "path": str(mount / "kv")}
        adapter = create_adapter(spec)
        items = [(f"{i:016x}-{i:064x}", [bytes([i]) * 6000]) for i in range(24)]
        stored = adapter.put(items).count(True)
        adapter.close()
        assert stored > 0
        with contextlib.suppress(OSError), open(mount / "filler", "wb") as filler:  # the last free page too
            while True:
                filler.write(b"f" * 4096)
                filler.flush()
        again = create_adapter(spec)  # a restart on a full disk: a warning, not a refusal
        try:
            assert sorted(again.list_names()) == [name for name, _ in items[:stored]]
            assert again.get([items[0][0]])[0] == items[0][1][0]
            assert again.put([(f"{99:016x}-{99:064x}", [b"x" * 6000])]) == [False]  # dropped, not raised
        finally:
            again.close()
