"""One configuration tree for kvtier.

Sources, in increasing priority: a YAML file (``KVTIER_CONFIG_FILE`` or ``--config``), ``KVTIER_*``
environment variables (nested keys joined by ``__``: ``KVTIER_KV_EVENTS__ENDPOINT``), then explicit
overrides (CLI flags). An LMCache-style YAML file (``chunk_size``, ``local_cpu``, ``max_local_cpu_size``,
``local_disk``, ...) is recognised and translated. Sizes go through ``parse_size``; booleans through
``parse_bool``; every error names the key and the nearest valid key.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import pydantic
import yaml
from pydantic import BeforeValidator, Field

from kvtier.errors import ConfigError
from kvtier.hashing import ALGORITHMS, DEFAULT_ALGORITHM, DEFAULT_SEED

_UNITS = {"": None, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([a-zA-Z]*)\s*$")
EVICTION_POLICIES = ("LRU", "ARC", "S3FIFO")
EVENT_ENCODINGS = ("vllm", "vllm-legacy", "sglang")


def parse_size(value: Any, default_unit: str = "GB") -> float:
    """Parse a size into a number of ``default_unit`` (GB by default).

    ``"5GB"``, ``"512MiB"``, ``"100B"``, ``"1.5"`` (bare: ``default_unit``), ``2`` (number: ``default_unit``).
    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) of 1024.

    Raises:
        ConfigError: negative, unparsable, or an unknown unit (valid units listed).
    """
    per_unit = _UNITS[default_unit.lower()]
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number or a string like '5GB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), None
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(f"cannot parse size {value!r}; write e.g. '5GB', '512MiB' or '1.5' (GB)")
        number, suffix = float(m.group(1)), m.group(2).lower()
        if suffix not in _UNITS:
            raise ConfigError(f"unknown size unit {m.group(2)!r} in {value!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
        unit = _UNITS[suffix]
    else:
        raise ConfigError(f"size must be a number or a string like '5GB', got {type(value).__name__}")
    if number < 0:
        raise ConfigError(f"size must not be negative, got {value!r}")
    return number if unit is None else number * unit / per_unit


def parse_bool(value: Any) -> bool:
    """``true/1/yes/on`` and ``false/0/no/off`` (any case), or a real bool. Raises ConfigError otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on", "y"):
        return True
    if text in ("false", "0", "no", "off", "n", ""):
        return False
    raise ConfigError(f"cannot read {value!r} as a boolean; use true/false, 1/0, yes/no or on/off")


def _as_value_error(fn):
    """Re-raise ConfigError as ValueError so pydantic attaches the key name to the message."""
    def wrapped(value):
        try:
            return fn(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return wrapped


SizeGB = Annotated[float, BeforeValidator(_as_value_error(parse_size)), Field(ge=0)]
# a size in bytes: a bare number is bytes, a string may carry a unit ("64MiB", "5MB")
SizeBytes = Annotated[int, BeforeValidator(_as_value_error(lambda v: int(parse_size(v, "B")))), Field(ge=0)]
Bool = Annotated[bool, BeforeValidator(_as_value_error(parse_bool))]


def _policy(value: Any) -> str:
    name = str(value).upper().replace("-", "").replace("_", "")
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {value!r}; valid: {', '.join(EVICTION_POLICIES)}")
    return name


def _algorithm(value: Any) -> str:
    if value not in ALGORITHMS:
        raise ValueError(f"unknown hash algorithm {value!r}; valid: {', '.join(ALGORITHMS)}")
    return value


_UNIT_NOTES = {("_ms", "_seconds"): "the value is now in seconds: divide the milliseconds by 1000",
               ("_mb", "_bytes"): "the value is now in bytes; a size such as '64MiB' also works"}


class RenamedKeyError(ValueError):
    """A configuration key given under a former name; the message names the new one."""


class StrictModel(pydantic.BaseModel):
    """A config section: unknown keys are refused, and so are former names (``renamed_fields``: old -> new,
    merged with the base classes') with a message naming the new key: a dropped setting would go unseen."""

    model_config = pydantic.ConfigDict(extra="forbid")
    renamed_fields: ClassVar[dict[str, str]] = {}

    @pydantic.model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            msgs, renamed = [], {}
            for klass in reversed(cls.__mro__):
                renamed.update(vars(klass).get("renamed_fields", {}))
            for old, new in renamed.items():
                if old in data:
                    note = next((n for (a, b), n in _UNIT_NOTES.items() if old.endswith(a) and new.endswith(b)), "")
                    msgs.append(f"key {old!r} was renamed to {new!r}" + (f" ({note})" if note else ""))
            if msgs:
                raise RenamedKeyError("; ".join(msgs))
        return data


class _Section(StrictModel):
    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)


class KVEventsConfig(_Section):
    """KV cache event publishing (vLLM ``--kv-events-config`` names where they exist)."""

    renamed_fields = {"batch_max_delay_ms": "batch_max_delay_seconds"}

    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = "kv-events"
    encoding: Literal["vllm", "vllm-legacy", "sglang"] = "vllm"
    hash_format: Literal["int", "bytes"] = "int"
    hwm: int = Field(100_000, ge=0)
    buffer_steps: int = Field(10_000, gt=0)  # replay ring size, in batches
    buffer_max_bytes: int = Field(64 << 20, gt=0)  # replay ring size, in encoded bytes (the oldest batches go first)
    max_queue_size: int = Field(100_000, gt=0)  # events queued before the publisher thread; overflow is dropped and counted
    batch_max_events: int = Field(1_000, gt=0)
    batch_max_delay_seconds: float = Field(0.01, ge=0)
    data_parallel_rank: int = Field(0, ge=0)
    replay_auth: Bool = True  # with server.auth: replay consumers need the secret (CurveZMQ); false: vLLM-compatible


class ServerConfig(_Section):
    """``kvtier server`` sockets, data plane and admin HTTP."""

    host: str = "127.0.0.1"
    port: int = Field(5555, ge=0, le=65535)
    admin_host: str = "127.0.0.1"
    admin_port: int = Field(8080, ge=0, le=65535)
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
    hash_offload_min_tokens: int = Field(4096, gt=0)  # longer prompts not memoised are hashed on a worker thread
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
    l2_adapters: list[dict] = Field(default_factory=list)  # in cascade order; see l2.create_adapter
    l2_write_queue_size: int = Field(64, ge=0)  # chunks waiting for L2; a full queue drops the write
    l2_promote_to_faster_l2: Bool = False  # also copy hits into L2 adapters ahead of the one that had it
    l2_record_key: pydantic.SecretStr | None = None  # key authenticating L2 records (KVTIER_L2_RECORD_KEY)
    l2_record_auth: Literal["blake3", "hmac-sha256"] = "blake3"  # the MAC new records are signed with
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
        return int(self.l1_size_gb * 10**9)

    @property
    def effective_block_size(self) -> int:
        """Tokens per hashed block: ``block_size``, or ``chunk_size`` when it is None."""
        return self.block_size or self.chunk_size


# KVTIER_* variables that are not configuration keys (tooling, tests, the model cache).
NON_CONFIG_ENV = {"KVTIER_CONFIG_FILE", "KVTIER_ADMIN_TOKEN", "KVTIER_AUTH_SECRET_FILE", "KVTIER_MODEL_CACHE", "KVTIER_SERVICES_DIR",
                  "KVTIER_AZURITE_BLOB", "KVTIER_VENV", "KVTIER_PYTHON", "KVTIER_FUZZ_MESSAGES"}


def _env_value(name: str, value: str) -> Any:
    """A variable's value: JSON/YAML when it starts with ``[`` or ``{`` (a list or mapping), else the text."""
    if not value.strip().startswith(("[", "{")):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at column {where.column + 1}" if where is not None else ""
        raise ConfigError(f"environment variable {name} is not valid JSON/YAML{at}: "
                          f"{getattr(exc, 'problem', None) or exc}; fix or unset it") from None


def _env_overrides(environ: dict[str, str]) -> dict:
    out: dict = {}
    for name, value in environ.items():
        if not name.startswith("KVTIER_") or name in NON_CONFIG_ENV:
            continue
        path = name[len("KVTIER_"):].lower().split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _env_value(name, value)
    if environ.get("KVTIER_ADMIN_TOKEN"):
        out.setdefault("server", {})["admin_token"] = environ["KVTIER_ADMIN_TOKEN"]
    if environ.get("KVTIER_AUTH_SECRET_FILE"):  # the same variable clients read
        out.setdefault("server", {})["auth_secret_file"] = environ["KVTIER_AUTH_SECRET_FILE"]
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and key in out and (not value or not isinstance(out[key], dict)):
            # flags of a section that the file gives as something else (``server: 5``): keep the file's value, so
            # that build_config refuses it rather than the section silently taking defaults
            continue
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _nearest(key: str, model: type[pydantic.BaseModel]) -> str:
    near = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else f"; valid keys: {', '.join(model.model_fields)}"


def _section_of(loc: tuple) -> type[pydantic.BaseModel]:
    model: type[pydantic.BaseModel] = KVTierConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
            model = ann
    return model


# removed key path -> what to use instead
_REMOVED = {("kv_events", "event_block_size"): "events are published per engine block of the top-level "
            "'block_size' (flag --block-size, variable KVTIER_BLOCK_SIZE); set that to the engine's block size",
            ("l2_promote",): "L2 hits are always copied into L1; remove the key (l2_promote_to_faster_l2 "
            "also copies them into faster L2 adapters)"}


def build_config(data: dict) -> KVTierConfig:
    """Validate a plain dict (already merged from every source) into a KVTierConfig.

    Raises:
        ConfigError: naming the offending key, what was wrong, and the nearest valid key.
    """
    for path, instead in _REMOVED.items():
        node = data
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            raise ConfigError(f"invalid configuration: key '{'.'.join(path)}' was removed: {instead}")
    try:
        return KVTierConfig(**data)
    except pydantic.ValidationError as exc:
        msgs = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            key = ".".join(str(p) for p in loc)
            if err["type"] == "extra_forbidden":
                msgs.append(f"unknown key {key!r}{_nearest(str(loc[-1]), _section_of(loc))}")
            else:
                cause = err.get("ctx", {}).get("error")  # kvtier's own validators already quote the value
                if not key:  # a check across keys (block_size vs chunk_size): its message names them
                    msgs.append(str(cause or err["msg"]))
                elif isinstance(cause, RenamedKeyError):  # raised by the section, so loc is the section
                    msgs.append(f"in section {key!r}: {cause}")
                else:
                    msgs.append(f"key {key!r}: {cause}" if cause else f"key {key!r}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("invalid configuration: " + "; ".join(msgs)) from None


def load_config(path: str | os.PathLike | None = None, overrides: dict | None = None,
                environ: dict[str, str] | None = None) -> KVTierConfig:
    """Load the configuration: YAML file < ``KVTIER_*`` environment < ``overrides`` (CLI flags).

    Args:
        path: YAML file; defaults to ``$KVTIER_CONFIG_FILE`` when set. kvtier or LMCache keys.
        overrides: explicit values (flags); ``None`` values are ignored.
        environ: environment to read (default ``os.environ``).

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or bad value.
    """
    from kvtier.lmcache_config import from_lmcache  # it imports parse_size / parse_bool from this module

    environ = dict(os.environ if environ is None else environ)
    path = path or environ.get("KVTIER_CONFIG_FILE")
    data: dict = {}
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
        data = from_lmcache(data)
    data = _merge(data, _env_overrides(environ))
    data = _merge(data, _drop_none(overrides or {}))
    return build_config(data)


def _drop_none(d: dict) -> dict:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}
