"""The configuration tree: ``KVTierConfig`` and its sections (pydantic models; unknown and renamed keys refused).

The value types (``SizeGB``, ``SizeBytes``, ``Bool``) and the section base (``StrictModel``) are ``kvtier.units``',
which the L2 adapters' configs use too. Where values come from (file, environment, flags) is
``kvtier.config.load``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import BeforeValidator, Field

from kvtier.hashing import ALGORITHMS, DEFAULT_ALGORITHM, DEFAULT_SEED
from kvtier.units import GB, Bool, SizeBytes, SizeGB, StrictModel

EVICTION_POLICIES = ("LRU", "ARC", "S3FIFO")


def _policy(value: Any) -> str:
    name = str(value).upper().replace("-", "").replace("_", "")
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {value!r}; valid: {', '.join(EVICTION_POLICIES)}")
    return name


def _algorithm(value: Any) -> str:
    if value not in ALGORITHMS:
        raise ValueError(f"unknown hash algorithm {value!r}; valid: {', '.join(ALGORITHMS)}")
    return value


class _Section(StrictModel):
    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)


class KVEventsConfig(_Section):
    """KV cache event publishing (vLLM ``--kv-events-config`` names where they exist)."""

    renamed_fields = {"batch_max_delay_ms": "batch_max_delay_seconds", "replay_auth": "auth"}

    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = "kv-events"
    encoding: Literal["vllm", "vllm-legacy", "sglang"] = "vllm"
    hash_format: Literal["int", "bytes"] = "int"
    hwm: int = Field(100_000, ge=0)
    buffer_steps: int = Field(10_000, gt=0)  # replay ring size, in batches
    buffer_max_bytes: int = Field(64 << 20, gt=0)  # replay ring size, in encoded bytes (the oldest batches go first)
    # the replay port per principal (a tenant; the operator; everybody without auth): events/replay.py
    max_replays_per_principal: int = Field(4, gt=0)  # replays in progress; more are refused at once
    max_replay_bytes_per_principal: SizeBytes = Field(16 << 20, gt=0)  # sent to its requesters, not yet delivered
    replay_timeout_seconds: float = Field(30.0, gt=0)  # a replay not finished by then is dropped
    max_queue_size: int = Field(100_000, gt=0)  # events queued before the publisher thread; overflow is dropped and counted
    batch_max_events: int = Field(1_000, gt=0)
    batch_max_delay_seconds: float = Field(0.01, ge=0)
    data_parallel_rank: int = Field(0, ge=0)
    # with server.auth: live and replay consumers need a key (CurveZMQ) and see only their tenant's events;
    # false: plain ZMQ, vLLM-compatible, every local subscriber reads every event (token ids included)
    auth: Bool = True
    include_token_ids: Bool = True  # BlockStored carries the blocks' token ids (Dynamo's router needs them)


class ServerConfig(_Section):
    """``kvtier server`` sockets, data plane and admin HTTP."""

    host: str = "127.0.0.1"
    port: int = Field(5555, ge=0, le=65535)
    admin_host: str = "127.0.0.1"
    admin_port: int = Field(8080, ge=0, le=65535)
    # DNS names the admin HTTP answers to besides IP addresses and localhost (against DNS rebinding: server/admin/http.py)
    admin_allowed_hosts: list[str] = []
    admin_token: pydantic.SecretStr | None = None
    allow_unauthenticated_admin: Bool = False  # with no admin_token: accept mutations (clear) from anyone who connects
    auth: Bool = True  # clients prove they hold the secret (CurveZMQ); false only on a trusted network
    auth_secret_file: str | None = None  # default: $XDG_RUNTIME_DIR/kvtier/server-<port>.secret
    shared_memory: Bool = True  # same-host clients copy KV through shared memory
    lease_seconds: float = Field(30.0, gt=0)  # pins held for a client expire after this
    max_message_bytes: int = Field(1 << 30, gt=0)
    shutdown_timeout_seconds: float = Field(10.0, ge=0)  # bounded wait for queued L2 writes
    # L2 -> L1 promotions (retrieve of chunks only in L2, Prefetch) run on a pool, off the request thread
    promote_timeout_seconds: float = Field(5.0, gt=0)  # a promotion not done by then is answered from L1 alone
    promote_threads: int = Field(4, ge=1, le=256)  # worker threads of the promotion pool
    max_promotions: int = Field(64, ge=1)  # promotions queued or running; more are answered from L1 alone
    # a lookup its L1 + L2 indexes answer short, over an L2 other servers write to, waits this long for an L2
    # probe on the promotion pool (server/lookup.py); 0: the indexes' answer at once
    lookup_probe_timeout_seconds: float = Field(0.1, ge=0)
    # per-client bounds (server/limits.py); client_limits false turns them off (one trusted engine)
    client_limits: Bool = True
    max_prompt_tokens: int = Field(1 << 20, gt=0)  # tokens in one Lookup / StoreBegin / RetrieveBegin
    # identities the server keeps (Hello's model id and namespace, a request's namespace), in UTF-8 bytes; always on
    max_model_id_bytes: int = Field(1024, gt=0)
    max_namespace_bytes: int = Field(1024, gt=0)
    known_caches_max_bytes: SizeBytes = Field(4 << 20, gt=0)  # caches the management API reaches after their sessions
    hash_offload_min_tokens: int = Field(4096, gt=0)  # longer prompts not memoised are hashed on a worker thread
    # the same for a StoreBegin: it follows a forward pass over those tokens, so the hand-off costs it little
    store_hash_offload_min_tokens: int = Field(1024, gt=0)
    max_hash_jobs: int = Field(256, gt=0)  # requests waiting for that worker; more: Error(limit_exceeded)
    max_reserved_fraction_per_client: float = Field(0.25, gt=0, le=1)  # of L1: open reservations + quarantined slots
    max_leases_per_client: int = Field(64, gt=0)  # open store and retrieve leases
    max_inflight_requests_per_client: int = Field(64, gt=0)  # requests accepted and not yet answered
    max_unread_replies_per_client: int = Field(1000, gt=0)  # replies queued for a client that does not read
    max_unread_reply_bytes_per_client: int = Field(16 << 20, gt=0)  # KV frames queued for a client that does not read
    # the same for all connections of one principal (its key, or with auth off its uid / IP: server/principals.py)
    max_connections_per_principal: int = Field(256, gt=0)  # sessions open at once
    max_reserved_fraction_per_principal: float = Field(0.5, gt=0, le=1)  # of L1: reservations + quarantined slots
    max_leases_per_principal: int = Field(256, gt=0)
    max_inflight_requests_per_principal: int = Field(256, gt=0)
    max_unread_reply_bytes_per_principal: int = Field(64 << 20, gt=0)
    max_reserved_fraction_all_clients: float = Field(0.75, gt=0, le=1)  # of L1, every client together
    # request trace for `kvtier simulate` (server/trace.py, kvtier.trace.format); None: off
    trace_file: str | None = None
    trace_max_bytes: SizeBytes = Field(1 << 30, gt=0)  # the file stops growing here (later records dropped, counted)
    trace_token_ids: Bool = False  # records carry the prompts' token ids (else chunk digests only)
    trace_queue_size: int = Field(65536, gt=0)  # records waiting for the writer thread; more are dropped, counted


class ConnectorConfig(_Section):
    """An engine connector (the vLLM ``KVTierConnector``): how it reaches kvtier and how long it waits.

    In vLLM's ``kv_connector_extra_config`` each key is written ``kvtier.<key>`` (``kvtier.server_url``);
    keys of the rest of the tree are written the same way (``kvtier.l1_size_gb``) and configure an
    in-process cache. The engine's block size, hash algorithm and seed always come from the engine.
    """

    renamed_fields = {"timeout_s": "timeout_seconds"}

    server_url: str | None = None  # tcp://host:port of `kvtier server`; None: an in-process cache
    local_disk: str | None = None  # in-process only: folder of a local_disk L2 the engine's processes share
    model: str | None = None  # model id in chunk keys (default: the weights' identity); change it with the weights
    use_layerwise: Bool = False  # load and save layer by layer inside the forward pass
    timeout_seconds: float = Field(5.0, gt=0)  # server only: longest wait for one reply (also the startup wait)
    load_timeout_seconds: float = Field(5.0, gt=0)  # longest wait for one request's load; later: recomputed
    auth_secret_file: str | None = None  # server only: the secret file (default: the same-user server's for the URL)
    server_events: str | None = None  # server only: the server's KV event PUB address; what it holds is announced in
    # this engine's KV event stream (CPU / STORAGE blocks; connectors/server_feed.py)
    server_events_replay: str | None = None  # server only: the server's replay address (catch up at start)
    store_after_seen: int = Field(1, ge=1)  # store a chunk once this many prompts held it (1: at first sight)


class KVTierConfig(_Section):
    """The whole configuration tree. Every key, unit and default is listed in docs/configuration.md."""

    chunk_size: int = Field(256, gt=0)  # tokens per chunk; a multiple of the engine's block size
    block_size: int | None = Field(None, gt=0)  # the engine's block size: hashes chain per block; None: chunk_size
    hash_algorithm: Annotated[str, BeforeValidator(_algorithm)] = DEFAULT_ALGORITHM
    hash_seed: str = DEFAULT_SEED
    save_unfull_chunk: Bool = False
    l1_size_gb: SizeGB = 1.0
    eviction_policy: Annotated[str, BeforeValidator(_policy)] = "LRU"
    # share of L1 that chunks under a retention hint (priority, TTL, session, management pin) may hold
    l1_retention_max_share: float = Field(0.5, ge=0.0, le=1.0)
    # of L1, what the hints of one principal (a server's client key, tenant, uid or IP) may hold of that share
    l1_retention_max_share_per_principal: float = Field(0.25, ge=0.0, le=1.0)
    # longest ttl_seconds a store's hint may ask for, and the expiry of a priority hint that names none
    retention_max_ttl_seconds: float = Field(86400.0, gt=0)
    session_ttl_seconds: float = Field(300.0, gt=0)  # TTL of a store's session hint that names no ttl_seconds
    l2_adapters: list[dict] = Field(default_factory=list)  # in cascade order; see l2.create_adapter
    l2_write_queue_size: int = Field(64, ge=0)  # chunks waiting for L2; a full queue drops the write
    l2_promote_to_faster_l2: Bool = False  # also copy hits into L2 adapters ahead of the one that had it
    l2_record_key: pydantic.SecretStr | None = None  # key authenticating L2 records (KVTIER_L2_RECORD_KEY)
    l2_record_auth: Literal["blake3", "hmac-sha256"] = "blake3"  # the MAC new records are signed with
    # further keys whose records are read (a rotation's old key, another deployment on the same store)
    l2_record_verify_keys: list[pydantic.SecretStr] = []
    l2_accept_signed_records: Bool = False  # without any record key: serve signed records unchecked
    # model id or glob -> lossy codec names (kvtier.codecs) its L2 records may be served from; none: lossless only
    lossy_codecs_allowed: dict[str, list[str]] = {}
    lookup_memo_max_bytes: int = Field(64 << 20, ge=0)  # chunk refs of recent prompts kept to skip re-hashing
    enable_kv_events: Bool = False
    kv_events: KVEventsConfig = Field(default_factory=KVEventsConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    connector: ConnectorConfig = Field(default_factory=ConnectorConfig)

    @pydantic.model_validator(mode="after")
    def _block_divides_chunk(self):
        if self.chunk_size % self.effective_block_size:
            raise ValueError(f"block_size ({self.block_size}) must divide chunk_size ({self.chunk_size}); set it "
                             "to the engine's block size (16 on GPU vLLM, 128 on vLLM CPU) and chunk_size to a multiple")
        return self

    @property
    def l1_size_bytes(self) -> int:
        return int(self.l1_size_gb * GB)

    @property
    def effective_block_size(self) -> int:
        """Tokens per hashed block: ``block_size``, or ``chunk_size`` when it is None."""
        return self.block_size or self.chunk_size
